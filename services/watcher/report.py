"""What the watcher tells the rest of the stack: the truth about what the engine serves.

After each pass (and before each reload, so a slow reload shows the mismatch it fixes):
- the Redis hash `watcher-state`: `engine_version` (what the engine reports), `target_version`,
  `mismatch` 0|1, `checked_at`, `engine`, `error`, `latest_version`;
- the key `policy-version`: the policy version the engine *actually* serves, deleted while
  it serves its base weights or cannot be reached;
- Prometheus gauges for the same, and counters of reloads (by cause) and refusals.
Each refused version is also recorded in the hash `refused-versions`.

Redis writes are best effort: an outage is logged and the watcher goes on keeping the
engine on its policy (its /readyz shows Redis failing meanwhile).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge, Histogram
from redis.exceptions import RedisError

from services.watcher.target import label, policy_version
from shared.streams import Bus

log = logging.getLogger(__name__)

SERVING = Gauge("nextstate_watcher_policy_version",
                "Policy version the engine reports serving (0: base weights, -1: unreachable)")
TARGET = Gauge("nextstate_watcher_target_version",
               "Policy version the engine should serve (-1: none known yet)")
MISMATCH = Gauge("nextstate_watcher_mismatch", "1 while the engine serves other than the target")
RELOADS = Counter("nextstate_watcher_reloads_total", "Versions loaded into the engine", ["cause"])
REFUSED = Counter("nextstate_watcher_refused_total", "Versions refused", ["reason"])
SYNC_SECONDS = Histogram(
    "nextstate_watcher_sync_seconds", "LATEST commit to the engine serving it",
    buckets=(0.5, 1, 2, 3, 5, 8, 13, 21, 34, 60, 120, 300),
)
DOWNLOAD_SECONDS = Histogram("nextstate_watcher_download_seconds", "Download and verify time")
LOAD_SECONDS = Histogram("nextstate_watcher_load_seconds", "Engine weight swap time")


@dataclass
class WatcherState:
    """What the watcher last saw and decided."""

    engine: str  # the engine's URL
    observed: str | None = None  # the engine's weight_version; None: unreachable (or not asked)
    target: int | None = None  # what it should serve; None: no version known to serve
    latest: int | None = None  # LATEST's version; None: none yet, or unreadable
    errors: list[str] = field(default_factory=list)  # this pass's, in order
    checked_at: float = 0.0
    unfixed: bool = False  # the last pass ended with the mismatch still there

    @property
    def mismatch(self) -> bool:
        return self.target is not None and self.observed != str(self.target)

    def observe(self, weight_version: str | None) -> None:
        self.observed = weight_version
        self.checked_at = time.time()

    def problem(self) -> str | None:
        """Why the engine is not ready to be trusted, once a pass failed to fix a mismatch."""
        if not (self.unfixed and self.mismatch):
            return None
        why = f" ({self.errors[-1][:300]})" if self.errors else ""
        return f"engine serves {label(self.observed)}, should serve v{self.target}{why}"

    def fields(self) -> dict[str, str]:
        """The `watcher-state` hash."""
        return {
            "engine_version": self.observed or "",
            "target_version": "" if self.target is None else str(self.target),
            "mismatch": "1" if self.mismatch else "0",
            "checked_at": f"{self.checked_at:.3f}",
            "engine": self.engine,
            "error": "; ".join(self.errors)[:2000],
            "latest_version": "" if self.latest is None else str(self.latest),
        }


async def publish_state(bus: Bus, state: WatcherState) -> None:
    """Metrics, the `watcher-state` hash and the `policy-version` key, from `state`."""
    served = policy_version(state.observed)
    if state.observed is None:
        SERVING.set(-1)
    else:
        SERVING.set(served or 0)
    TARGET.set(-1 if state.target is None else state.target)
    MISMATCH.set(1 if state.mismatch else 0)
    pipe = bus.redis.pipeline(transaction=True)
    pipe.hset(bus.keys.watcher_state, mapping=state.fields())
    if served is None:
        pipe.delete(bus.keys.policy_version)
    else:
        pipe.set(bus.keys.policy_version, served)
    try:
        await pipe.execute()
    except RedisError as exc:
        log.warning("could not record the watcher state in Redis", extra={"error": str(exc)})


async def record_refusal(bus: Bus, version: int, reason: str, detail: str) -> None:
    """Count a refused version and record it in `refused-versions` (best effort)."""
    REFUSED.labels(reason).inc()
    record = {"by": "watcher", "reason": reason, "detail": detail[:2000], "at": time.time()}
    try:
        await bus.redis.hset(bus.keys.refused_versions, str(version), json.dumps(record))
    except RedisError as exc:
        log.warning("could not record a refused version in Redis",
                    extra={"version": version, "error": str(exc)})
