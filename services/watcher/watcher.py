"""Follow `policies/<run>/LATEST` and hot-reload the engine with each new version.

One pass (`Watcher.sync_once`): read LATEST; if it names a version other than the one
the engine serves, download it into a staging folder, verify every sha256 against the
manifest, rename it into place, ask the engine to `/update_weights_from_disk` with
`weight_version = str(version)`, confirm through `/model_info`, then record the serving
version in Redis and announce `PolicyLoaded` on the `policy` stream. A version that
fails verification or loading is refused and remembered for a while; the engine keeps
serving what it has. LATEST moving backwards (`nextstate rollback`) is followed too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from services.watcher.settings import WatcherConfig, WatcherSettings
from shared import checkpoints as ckpt
from shared.engine_client import EngineClient
from shared.errors import ChecksumMismatch, EngineError, StoreError
from shared.schemas import PolicyLoaded
from shared.store import AsyncBucket
from shared.streams import Bus

log = logging.getLogger(__name__)

SERVING = Gauge("nextstate_watcher_policy_version", "Policy version the engine serves")
RELOADS = Counter("nextstate_watcher_reloads_total", "Versions loaded into the engine")
REFUSED = Counter("nextstate_watcher_refused_total", "Versions refused", ["reason"])
SYNC_SECONDS = Histogram(
    "nextstate_watcher_sync_seconds", "LATEST commit to the engine serving it",
    buckets=(0.5, 1, 2, 3, 5, 8, 13, 21, 34, 60, 120, 300),
)
DOWNLOAD_SECONDS = Histogram("nextstate_watcher_download_seconds", "Download and verify time")
LOAD_SECONDS = Histogram("nextstate_watcher_load_seconds", "Engine weight swap time")


@dataclass
class Watcher:
    settings: WatcherSettings
    bucket: AsyncBucket
    engine: EngineClient
    bus: Bus
    serving: int | None = None
    _refused: dict[int, float] = field(default_factory=dict)

    @property
    def cfg(self) -> WatcherConfig:
        return self.settings.watcher

    async def discover_serving(self) -> None:
        """What the engine serves now (a numeric weight_version is a policy version)."""
        wv = await self.engine.weight_version()
        self.serving = int(wv) if wv.isdigit() else None
        if self.serving is not None:
            SERVING.set(self.serving)

    def _engine_path(self, folder: Path) -> str:
        """The installed folder as the engine sees it."""
        if self.cfg.engine_dir:
            return f"{self.cfg.engine_dir.rstrip('/')}/{folder.name}"
        return str(folder.resolve())

    async def sync_once(self) -> PolicyLoaded | None:
        """One poll. Returns the announcement when a new version was loaded."""
        run = self.settings.run
        pointer = await self.bucket.run(ckpt.read_latest, self.bucket.sync, run)
        if pointer is None or pointer.version == self.serving:
            return None
        version = pointer.version
        refused_at = self._refused.get(version)
        if refused_at is not None and time.monotonic() - refused_at < self.cfg.retry_bad_after_s:
            return None
        started = time.monotonic()
        try:
            manifest = await self.bucket.run(ckpt.read_manifest, self.bucket.sync, pointer.manifest)
            folder = await self.bucket.run(
                ckpt.download_checkpoint, self.bucket.sync, manifest, self.cfg.local_dir
            )
        except ChecksumMismatch as exc:
            self._refuse(version, "checksum", str(exc))
            return None
        except StoreError as exc:
            self._refuse(version, "download", str(exc))
            return None
        downloaded = time.monotonic()
        DOWNLOAD_SECONDS.observe(downloaded - started)
        ok, message = await self.engine.update_weights(
            self._engine_path(folder), str(version), abort_all_requests=self.cfg.abort_requests
        )
        if not ok:
            self._refuse(version, "engine", message)
            return None
        served = await self.engine.weight_version()
        if served != str(version):
            self._refuse(version, "confirm", f"engine reports weight_version {served!r} after loading {version}")
            return None
        loaded = time.monotonic()
        LOAD_SECONDS.observe(loaded - downloaded)
        sync_s = max(0.0, time.time() - pointer.committed_at)
        SYNC_SECONDS.observe(sync_s)
        self.serving = version
        self._refused.pop(version, None)
        SERVING.set(version)
        RELOADS.inc()
        await self.bus.redis.set(self.bus.keys.policy_version, version)
        event = PolicyLoaded(
            run=run, version=version, weight_version=str(version), engine=self.cfg.engine_url,
            download_s=round(downloaded - started, 3), load_s=round(loaded - downloaded, 3),
            sync_s=round(sync_s, 3),
        )
        await self.bus.publish("policy", event)
        log.info("policy loaded", extra={"version": version, "download_s": event.download_s,
                                         "load_s": event.load_s, "sync_s": event.sync_s})
        await self.bucket.run(ckpt.prune_local, self.cfg.local_dir, self.cfg.keep_local, protect=[version])
        return event

    def _refuse(self, version: int, reason: str, detail: str) -> None:
        REFUSED.labels(reason).inc()
        self._refused[version] = time.monotonic()
        log.error("version refused; the engine keeps serving its current weights",
                  extra={"version": version, "reason": reason, "detail": detail[:500],
                         "serving": self.serving})

    async def run_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                if self.serving is None:
                    await self.discover_serving()
                await self.sync_once()
            except (EngineError, StoreError, OSError) as exc:
                log.warning("watch pass failed, retrying", extra={"error": f"{type(exc).__name__}: {exc}"})
                self.serving = None  # re-discover: the engine may have restarted on other weights
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.poll_interval_s)
            except asyncio.TimeoutError:
                pass
