"""Watcher settings: which engine to reload, how often to poll, where to keep versions,
and the promotion gate (`NEXTSTATE_GATE__*`, off unless enabled)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from shared.settings import Settings


class WatcherConfig(BaseModel):
    # The engine to keep on the right version, and what speaks there.
    engine_url: str = "http://127.0.0.1:30000"
    engine_kind: Literal["sglang", "vllm"] = "sglang"
    # Each poll reads LATEST *and* asks the engine what it serves, reloading on any mismatch.
    poll_interval_s: float = Field(2.0, gt=0)
    # Where verified versions are installed (`<local_dir>/v000042`), and the same folder
    # as the engine sees it when they mount it at different paths (docker volumes).
    local_dir: Path = Path(".nextstate/checkpoints")
    engine_dir: str | None = None
    # The model the engine serves (its HF folder), which every version must fit before the
    # engine is asked to load it (compat.py); default: the engine's reported model path.
    base_model: str | None = None
    served_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the dtype the engine serves: a full version in another is refused "
        "(shared/dtypes.py). auto: the served model's folder's (config.json, else its weights), "
        "which the engine serves as v0; set it when the engine casts whatever it loads (--dtype)")
    keep_local: int = Field(3, ge=1, description="verified versions kept in local_dir")
    # The engine waits for in-flight requests before swapping unless this is set.
    abort_requests: bool = False
    reload_timeout_s: float = Field(600.0, gt=0)
    # A version that failed verification is tried again only after this long (a
    # re-publish may fix it); the engine keeps serving meanwhile.
    retry_bad_after_s: float = Field(60.0, ge=0)
    host: str = "127.0.0.1"
    port: int = Field(9104, ge=0, le=65535)


class GateConfig(BaseModel):
    """The promotion gate (services/watcher/gate_rules.py has the rule).

        NEXTSTATE_GATE__ENABLED=true            serve only versions whose suites pass
        NEXTSTATE_GATE__SUITES=["demo","drift"]  the suites every version must pass
        NEXTSTATE_GATE__ALPHA=0.05              higher-is-better suites: refused only when a paired
                                                test against the best version on the same tasks says
                                                "worse" at this level (one-sided; gate_rules.py)
        NEXTSTATE_GATE__DELTA=0.05              results without per-task scores (nothing to pair):
                                                score >= best - delta
        NEXTSTATE_GATE__DRIFT_MAX=0.5           lower-is-better suites (drift): score <= this
        NEXTSTATE_GATE__WAIT_S=1800             a version without all its results this long
                                                after it was first seen is refused (unevaluated)
        NEXTSTATE_GATE__CONSUMER_NAME=gate      its name in the `gate` group on `evals`
        NEXTSTATE_GATE__KEEP_VERSIONS=1000      version records kept in `gate-state`
    """

    enabled: bool = False
    suites: list[str] = Field(default_factory=lambda: ["demo", "drift"], min_length=1)
    alpha: float = Field(0.05, gt=0, lt=1)
    delta: float = Field(0.05, ge=0)
    drift_max: float = Field(0.5, ge=0)
    wait_s: float = Field(1800.0, gt=0)
    # Stable, so a restarted watcher takes back the results it read and had not acked.
    consumer_name: str = "gate"
    keep_versions: int = Field(1000, ge=10)

    @field_validator("suites")
    @classmethod
    def _suites(cls, v: list[str]) -> list[str]:
        names = [s.strip() for s in v if s.strip()]
        if not names:
            raise ValueError("name at least one suite, e.g. [\"demo\",\"drift\"]")
        return list(dict.fromkeys(names))


class WatcherSettings(Settings):
    watcher: WatcherConfig = WatcherConfig()
    gate: GateConfig = GateConfig()
