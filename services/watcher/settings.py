"""Watcher settings: which engine to reload, how often to poll, where to keep versions."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from shared.settings import Settings


class WatcherConfig(BaseModel):
    engine_url: str = "http://127.0.0.1:30000"
    engine_kind: Literal["sglang", "vllm"] = "sglang"
    # Each poll reads LATEST *and* asks the engine what it serves, reloading on any mismatch.
    poll_interval_s: float = Field(2.0, gt=0)
    # Where verified versions are installed (`<local_dir>/v000042`), and the same folder
    # as the engine sees it when they mount it at different paths (docker volumes).
    local_dir: Path = Path(".nextstate/checkpoints")
    engine_dir: str | None = None
    keep_local: int = Field(3, ge=1)
    # The engine waits for in-flight requests before swapping unless this is set.
    abort_requests: bool = False
    reload_timeout_s: float = Field(600.0, gt=0)
    # A version that failed verification is tried again only after this long (a
    # re-publish may fix it); the engine keeps serving meanwhile.
    retry_bad_after_s: float = Field(60.0, ge=0)
    host: str = "127.0.0.1"
    port: int = Field(9104, ge=0, le=65535)


class WatcherSettings(Settings):
    watcher: WatcherConfig = WatcherConfig()
