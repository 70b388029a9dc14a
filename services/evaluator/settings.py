"""The evaluator's configuration: `NEXTSTATE_EVAL__*` on top of the shared settings.

    NEXTSTATE_EVAL__SUITES=demo,drift            suites enqueued for every committed version (built-in
                                                 names or module:callable; unknown ones refuse to start):
                                                 a comma list, or a JSON list (["demo","drift"]; also
                                                 as a shell that sourced .env leaves it: [demo,drift])
    NEXTSTATE_EVAL__ENGINE_URL=http://127.0.0.1:30001   the evaluation engine: a second engine that
                                                 loads candidates (never the one users talk to);
                                                 one per worker: it serves one candidate at a time
    NEXTSTATE_EVAL__ENGINE_KIND=sglang           sglang | vllm (the same client code as the watcher)
    NEXTSTATE_EVAL__ENGINE_DIR=                  where that engine sees installed versions (volumes;
                                                 default: LOCAL_DIR as this process sees it)
    NEXTSTATE_EVAL__LOCAL_DIR=.nextstate/eval-checkpoints   verified copies of candidates
    NEXTSTATE_EVAL__KEEP_LOCAL=2                 copies kept there (the one being evaluated always)
    NEXTSTATE_EVAL__TOKENIZER=/models/policy     the policy's tokenizer folder (chat template;
                                                 default: the candidate's own folder)
    NEXTSTATE_EVAL__BASE_MODEL=/models/policy    the base model (drift's reference; default: the
                                                 manifest's base_model)
    NEXTSTATE_EVAL__JOB_TIMEOUT_S=900            one job's budget (rq kills it past this; also the
                                                 engine's weight-load timeout)
    NEXTSTATE_EVAL__RETRIES=2                    rq retries of a failed job, or of one whose worker died
    NEXTSTATE_EVAL__USER_URL=                    simulated-user suite: an OpenAI-compatible endpoint
    NEXTSTATE_EVAL__USER_MODEL= / __USER_API_KEY=     (e.g. the judge model) playing the user
    NEXTSTATE_EVAL__SCENARIOS=                   a folder of scenario files (default: the package's)
    NEXTSTATE_EVAL__DEMO_TASK=short              the demo criterion suite's task (shared/demo_tasks.py;
                                                 `nextstate demo`'s default; vowel for tiny test models)
    NEXTSTATE_EVAL__SAMPLES=128                  tasks / prompts per suite (n; a job may ask for more):
                                                 what the gate's paired test needs to see a drop of
                                                 ~0.14 (bench/gate_power.py)
    NEXTSTATE_EVAL__SUITE_SAMPLES={"drift":32}   per-suite n instead (drift has a limit, not a paired test)
    NEXTSTATE_EVAL__CONCURRENCY=16               requests in flight per suite (the evaluation engine
                                                 batches them: keep it at the engine's MAX_RUNNING)
    NEXTSTATE_EVAL__MAX_TOKENS=32                per answer
    NEXTSTATE_EVAL__BASELINE=true                evaluate the base model (v0) once per run, at start:
                                                 the gate's first baseline, every curve's first point
                                                 (needs BASE_MODEL; loaded from that path)
    NEXTSTATE_EVAL__NEWEST_ONLY=true             a version not begun when a newer one is committed is
                                                 skipped (the gate records it `skipped`): evaluation
                                                 stays on the newest version however fast training goes
    NEXTSTATE_EVAL__SEED=0
    NEXTSTATE_EVAL__CONSUMER_NAME=               stable name of the dispatcher's consumer on `checkpoints`
                                                 ({hostname}, {pid} filled in; default evaluator-<host>-<pid>)
    NEXTSTATE_EVAL__HOST=127.0.0.1  NEXTSTATE_EVAL__PORT=9105   (/healthz /readyz /metrics)

A worker whose process dies mid-job (SIGKILL, OOM, a lost node) leaves its job to rq, which
runs it again (with a retry) once it counts as abandoned (shared/rqworker.py;
whole seconds):

    NEXTSTATE_EVAL__HEARTBEAT_S=10               a busy worker heartbeats its job this often
    NEXTSTATE_EVAL__ABANDONED_AFTER_S=45         a job without a heartbeat this long is abandoned
    NEXTSTATE_EVAL__MAINTENANCE_S=15             an idle worker requeues abandoned jobs this often
    NEXTSTATE_EVAL__SHUTDOWN_GRACE_S=10          on SIGTERM the running job may finish this long,
                                                 then goes back to the queue (no retry spent)

so a dead worker's job runs again within ABANDONED_AFTER_S + 2 x MAINTENANCE_S of its last
heartbeat (75 s by default; rq's own defaults take up to ~15 minutes), on any worker that
is idle then. With RETRIES=0 such a job is not run again: rq marks it failed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from shared.settings import Settings


def parse_name_list(text: str) -> list[str]:
    """`demo,drift`, `["demo","drift"]`, or the latter after a shell's `source .env` took
    its quotes (`[demo,drift]`): the same list of names. Names hold no quotes or commas
    (built-in suites, `env:<name>`, module:callable)."""
    s = text.strip()
    if s.startswith("["):
        try:
            loaded = json.loads(s)
        except ValueError:
            loaded = None
        if isinstance(loaded, list):
            return [str(x).strip() for x in loaded if str(x).strip()]
        s = s[1:-1] if s.endswith("]") else s[1:]
    return [p.strip().strip("\"'") for p in s.split(",") if p.strip().strip("\"'")]


class EvalConfig(BaseModel):
    suites: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["demo", "drift"])
    engine_url: str = "http://127.0.0.1:30001"
    engine_kind: Literal["sglang", "vllm"] = "sglang"
    engine_dir: str | None = None
    local_dir: Path = Path(".nextstate/eval-checkpoints")
    keep_local: int = Field(2, ge=1)
    tokenizer: str | None = None
    base_model: str | None = None
    job_timeout_s: float = Field(900.0, gt=0)
    retries: int = Field(2, ge=0)
    user_url: str | None = None
    user_model: str = "judge"
    user_api_key: SecretStr | None = None
    scenarios: Path | None = None
    demo_task: str = "short"
    samples: int = Field(128, ge=1)
    suite_samples: dict[str, int] = Field(default_factory=lambda: {"drift": 32})
    concurrency: int = Field(16, ge=1)
    max_tokens: int = Field(32, ge=1)
    baseline: bool = True
    newest_only: bool = True
    seed: int = 0
    consumer_name: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(9105, ge=0, le=65535)
    # Whole seconds: rq's heartbeats are key TTLs.
    heartbeat_s: int = Field(10, ge=1)
    abandoned_after_s: int = Field(45, ge=2)
    maintenance_s: int = Field(15, ge=1)
    shutdown_grace_s: float = Field(10.0, ge=0)

    def samples_for(self, suite: str) -> int:
        return self.suite_samples.get(suite, self.samples)

    @field_validator("suites", mode="before")
    @classmethod
    def _suites(cls, v: Any) -> Any:
        return parse_name_list(v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _heartbeat_within_abandon(self) -> EvalConfig:
        if self.abandoned_after_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"abandoned_after_s ({self.abandoned_after_s}) must be at least twice heartbeat_s "
                f"({self.heartbeat_s}): a live worker's job would be taken for abandoned"
            )
        return self


class EvalSettings(Settings):
    eval: EvalConfig = EvalConfig()
