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
    NEXTSTATE_ENVS__SWE_BENCH_PATH=              `swe`: SWE-bench instances (a .json list, a .jsonl file, or a
                                                 folder of them) instead of the shipped tasks (swebench.py)
    NEXTSTATE_ENVS__SWE_BENCH_REPOS=             the instances' repositories: one git clone each, named
                                                 owner__name (or owner/name); nothing is downloaded
    NEXTSTATE_ENVS__TOOLS_CONFIG=                `toolcall`: its tools (and tasks) from this JSON file
                                                 (tools_config.py) instead of the built-in ones
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

from pathlib import Path

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

from services.envs.sandbox import SandboxConfig
from shared.settings import Settings, load_settings


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
    # -- where the built-in environments' tasks and tools come from ------------------------
    swe_bench_path: Path | None = Field(
        None, description="swe: SWE-bench-format instances (.json list, .jsonl, or a folder of them) "
        "instead of the shipped tasks")
    swe_bench_repos: Path | None = Field(
        None, description="swe: a folder with one git clone per instance repository, named owner__name "
        "(or owner/name); nothing is downloaded at run time")
    swe_bench_heldout_share: float = Field(
        0.2, ge=0, le=1, description="swe: instances without a `split` field that are held out "
        "(chosen by a hash of the instance id)")
    swe_bench_test_timeout_s: float = Field(
        300.0, gt=0, description="swe: one test run of an instance (the run_tests tool, the grading) "
        "may take this long, wall clock and CPU")
    swe_bench_memory_mb: int = Field(
        4096, ge=64, description="swe: address space of each command of an instance's episode")
    tools_config: Path | None = Field(
        None, description="toolcall: a JSON file of tools (name, description, parameters, how each "
        "answers) and optionally tasks, instead of the built-in python and submit")
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


_current: EnvsConfig | None = None


def configure(cfg: EnvsConfig | None) -> None:
    """The configuration environments read (`current()`): the worker sets the one it
    started with; None: read the environment again on the next `current()`."""
    global _current
    _current = cfg


def current() -> EnvsConfig:
    """The environments' configuration in this process. Environments are built without
    arguments (`load_environment`) and list their tasks from a class method, so the sources
    of their tasks and tools (SWE-bench instances, a tools config) are read from here: the
    worker's own settings, else `NEXTSTATE_ENVS__*` (e.g. a script that lists tasks)."""
    global _current
    if _current is None:
        _current = load_settings(EnvsSettings).envs
    return _current
