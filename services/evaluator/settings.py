"""The evaluator's configuration: `NEXTSTATE_EVAL__*` on top of the shared settings.

    NEXTSTATE_EVAL__SUITES=["demo","drift"]      suites run on every committed version (built-in
                                                 names or module:callable)
    NEXTSTATE_EVAL__ENGINE_URL=http://127.0.0.1:30001   the evaluation engine: a second engine that
                                                 loads candidates (never the one users talk to)
    NEXTSTATE_EVAL__ENGINE_KIND=sglang           sglang | vllm (the same client code as the watcher)
    NEXTSTATE_EVAL__ENGINE_DIR=                  where that engine sees installed versions (volumes)
    NEXTSTATE_EVAL__LOCAL_DIR=.nextstate/eval-checkpoints   verified copies of candidates
    NEXTSTATE_EVAL__TOKENIZER=/models/policy     the policy's tokenizer folder (chat template)
    NEXTSTATE_EVAL__BASE_MODEL=/models/policy    the base model (drift's reference)
    NEXTSTATE_EVAL__JOB_TIMEOUT_S=900            NEXTSTATE_EVAL__RETRIES=2
    NEXTSTATE_EVAL__USER_URL=                    simulated-user suite: an OpenAI-compatible endpoint
    NEXTSTATE_EVAL__USER_MODEL= / __USER_API_KEY=     (e.g. the judge model) playing the user
    NEXTSTATE_EVAL__SCENARIOS=                   a folder of scenario files (default: the package's)
    NEXTSTATE_EVAL__DEMO_TASK=vowel              the demo criterion suite's task (shared/demo_tasks.py)
    NEXTSTATE_EVAL__SAMPLES=32                   tasks / prompts per suite (n)
    NEXTSTATE_EVAL__SEED=0
    NEXTSTATE_EVAL__CONSUMER_NAME=               stable name of the dispatcher's consumer ({hostname})
    NEXTSTATE_EVAL__HOST=127.0.0.1  NEXTSTATE_EVAL__PORT=9105   (/healthz /readyz /metrics)
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr

from shared.settings import Settings


class EvalConfig(BaseModel):
    suites: list[str] = Field(default_factory=lambda: ["demo", "drift"])
    engine_url: str = "http://127.0.0.1:30001"
    engine_kind: Literal["sglang", "vllm"] = "sglang"
    engine_dir: str | None = None
    local_dir: Path = Path(".nextstate/eval-checkpoints")
    tokenizer: str | None = None
    base_model: str | None = None
    job_timeout_s: float = Field(900.0, gt=0)
    retries: int = Field(2, ge=0)
    user_url: str | None = None
    user_model: str = "judge"
    user_api_key: SecretStr | None = None
    scenarios: Path | None = None
    demo_task: str = "vowel"
    samples: int = Field(32, ge=1)
    max_tokens: int = Field(32, ge=1)
    seed: int = 0
    consumer_name: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(9105, ge=0, le=65535)


class EvalSettings(Settings):
    eval: EvalConfig = EvalConfig()
