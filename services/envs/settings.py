"""The environment workers' configuration: `NEXTSTATE_ENVS__*` on top of the shared settings.

    NEXTSTATE_ENVS__URL=http://127.0.0.1:8000/v1   the collector's OpenAI endpoint: episodes are
                                                 captured exactly like any agent's traffic
    NEXTSTATE_ENVS__API_KEY=local                one of the collector's API keys (NEXTSTATE_COLLECTOR__API_KEYS)
    NEXTSTATE_ENVS__MODEL=policy                 the model name sent (the collector serves its own)
    NEXTSTATE_ENVS__MAX_STEPS=8                  policy calls per episode (turns)
    NEXTSTATE_ENVS__MAX_TOKENS=512               per answer
    NEXTSTATE_ENVS__TEMPERATURE=1.0              sampling (on-policy: 1.0)
    NEXTSTATE_ENVS__REQUEST_TIMEOUT_S=120        one policy call; the client retries a failed
    NEXTSTATE_ENVS__REQUEST_RETRIES=2            call this often (backoff) before the episode fails
    NEXTSTATE_ENVS__JOB_TIMEOUT_S=600            one episode's budget (rq kills it past this)
    NEXTSTATE_ENVS__RETRIES=2                    rq retries of a failed episode, or of one whose worker died
    NEXTSTATE_ENVS__SANDBOX__ROOT=               where episode directories are made (services/envs/sandbox.py;
                                                 also __REQUIRE, __UID_BASE, __UID_COUNT, __UID_LOCK_DIR)
    NEXTSTATE_ENVS__SANDBOX__BACKEND=process     process | docker: each tool execution in a confined child
                                                 process, or in a `docker run --rm --network none` container
                                                 (services/envs/container.py; __DOCKER__IMAGE=python:3.12-slim,
                                                 __DOCKER__CPUS=1, __DOCKER__BINARY=docker, __DOCKER__PULL=missing)
    NEXTSTATE_ENVS__EVAL_ENGINES=["http://127.0.0.1:30001"]
                                                 evaluation engines this worker may run held-out
                                                 episodes against (the evaluator's `env:<name>`
                                                 suites name theirs in the job); the internal
                                                 credential is sent to them, to no other
    NEXTSTATE_ENVS__CONSUMER_NAME=               stable name of this worker ({hostname}, {pid} filled in;
                                                 default envs-<host>-<pid>); the Outcome's `worker`
    NEXTSTATE_ENVS__HOST=127.0.0.1  NEXTSTATE_ENVS__PORT=9106   (/healthz /readyz /metrics)

A worker that dies mid-episode (SIGKILL, OOM, a lost node) leaves its job to rq, which runs
it again (a new attempt, a new session id) once it counts as abandoned (shared/rqworker.py;
whole seconds), on any worker idle then:

    NEXTSTATE_ENVS__HEARTBEAT_S=10               a busy worker heartbeats its job this often
    NEXTSTATE_ENVS__ABANDONED_AFTER_S=45         a job without a heartbeat this long is abandoned
    NEXTSTATE_ENVS__MAINTENANCE_S=15             an idle worker requeues abandoned jobs this often
    NEXTSTATE_ENVS__SHUTDOWN_GRACE_S=10          on SIGTERM the running episode may finish this
                                                 long, then goes back to the queue (no retry spent)
"""

from __future__ import annotations

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

from services.envs.sandbox import SandboxConfig
from shared.settings import Settings


class EnvsConfig(BaseModel):
    url: str = "http://127.0.0.1:8000/v1"
    api_key: SecretStr = SecretStr("local")
    model: str = "policy"
    max_steps: int = Field(8, ge=1)
    max_tokens: int = Field(512, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    request_timeout_s: float = Field(120.0, gt=0)
    request_retries: int = Field(2, ge=0)
    job_timeout_s: float = Field(600.0, gt=0)
    retries: int = Field(2, ge=0)
    sandbox: SandboxConfig = SandboxConfig()
    eval_engines: list[str] = ["http://127.0.0.1:30001"]
    consumer_name: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(9106, ge=0, le=65535)
    # Whole seconds: rq's heartbeats are key TTLs.
    heartbeat_s: int = Field(10, ge=1)
    abandoned_after_s: int = Field(45, ge=2)
    maintenance_s: int = Field(15, ge=1)
    shutdown_grace_s: float = Field(10.0, ge=0)

    @field_validator("eval_engines")
    @classmethod
    def _engine_roots(cls, v: list[str]) -> list[str]:
        return [u.rstrip("/") for u in v]

    @model_validator(mode="after")
    def _heartbeat_within_abandon(self) -> EnvsConfig:
        if self.abandoned_after_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"abandoned_after_s ({self.abandoned_after_s}) must be at least twice heartbeat_s "
                f"({self.heartbeat_s}): a live worker's job would be taken for abandoned"
            )
        return self


class EnvsSettings(Settings):
    envs: EnvsConfig = EnvsConfig()
