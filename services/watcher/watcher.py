"""Keep the engine serving the policy it should: reconcile on a timer, not only on LATEST.

One pass (`Watcher.sync_once`), every `poll_interval_s` (with the gate on, also as soon as an
evaluation result arrives: the wait between passes blocks on `evals`):
1. Read `policies/<run>/LATEST` (an unreadable one is noted, not fatal) and ask the engine
   what it really serves (`weight_version`). An unreachable engine is noted and the pass
   ends; the next one retries.
2. Choose the target (target.py): LATEST's version when it verifies and loads, else the
   last good version this process knows (at start: what the engine serves), else the
   newest committed version below LATEST's that verifies. Refused versions wait
   `retry_bad_after_s`.
3. Whenever the engine serves something else — a new LATEST, a rollback, an engine that
   restarted on its base weights, a lost reload, weights someone else loaded — install the
   version (a complete local copy is used as is, without the bucket; otherwise download
   into staging — rebuilding files stored as deltas on the versions they build on — check
   every sha256, rename), verify the folder in full right before the load (compat.py:
   every file's size and sha256 again, the base model's identity, config and tensor
   shapes against the served model, and a full version's dtype against the one served
   — vLLM dies of a reload that fails, so nothing unverified is ever sent), ask the engine to serve it as `str(version)` (a full version
   through `/update_weights_from_disk`, an adapter loaded by that name and the one it
   replaces unloaded: shared/engine_client/versions.py), and confirm what it serves. A
   delta that cannot be rebuilt refuses its version (`delta`), and the fallbacks below
   reach the full snapshot its chain starts from. A version failing any step is refused and the next choice tried; the
   engine keeps its weights meanwhile. An engine that dies of a load it was asked for
   (`EngineDied`: vLLM after a failed reload) is reported at once, at CRITICAL: the
   supervisor restarts it, the version that broke it is held off like any refused one,
   and the next passes put the restarted engine back on the last good version.
4. Report (report.py): the `watcher-state` hash, `policy-version` = what the engine
   actually serves, metrics, `refused-versions`, and a `PolicyLoaded` on the `policy`
   stream for each load, with its cause (`new_version` or `reconcile`). `check_serving`
   (in /readyz) fails while a mismatch outlives a pass's reload attempts.

With the promotion gate on (NEXTSTATE_GATE__ENABLED, gate.py), each pass first lets the
gate take new evaluation results and decide; then only promoted versions are candidates
(step 2 becomes: the newest promoted version at or below LATEST's, then older promoted
ones). A version not promoted is treated like a refused one: never loaded, not even as a
fallback, and the engine stays on (or is put back on, after a restart) the last promoted
version; with none promoted yet it keeps what it has. Each load's `PolicyLoaded` carries
the gate's reasons in `promotion`.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import ValidationError
from redis.exceptions import RedisError

from services.watcher.compat import verify_folder
from services.watcher.gate import Gate
from services.watcher.report import (
    DOWNLOAD_SECONDS,
    LOAD_SECONDS,
    RELOADS,
    SYNC_SECONDS,
    WatcherState,
    publish_state,
    record_refusal,
)
from services.watcher.settings import WatcherConfig, WatcherSettings
from services.watcher.target import (
    Latest,
    Refusals,
    fallbacks,
    first_choices,
    label,
    policy_version,
)
from shared import checkpoints as ckpt
from shared.engine_client import EngineClient
from shared.engine_client.versions import serve_version
from shared.errors import (
    BrokenDelta,
    BusError,
    ChecksumMismatch,
    EngineDied,
    EngineError,
    IncompatibleCheckpoint,
    NextstateError,
    StoreError,
)
from shared.schemas import CheckpointManifest, PolicyLoaded
from shared.store import AsyncBucket, Bucket
from shared.streams import Bus

log = logging.getLogger(__name__)

Cause = Literal["new_version", "reconcile"]


def install(bucket: Bucket, root: Path, run: str, version: int, manifest_key: str) -> Path:
    """(blocking) The verified folder of `version` under `root`: a complete local copy is
    returned at once (no bucket needed); otherwise it is downloaded and every sha256 checked."""
    try:
        manifest = CheckpointManifest.model_validate_json(
            (root / ckpt.version_dirname(version) / ckpt.MANIFEST).read_bytes())
    except (OSError, ValidationError):
        manifest = ckpt.read_manifest(bucket, manifest_key)
    if (manifest.run, manifest.version) != (run, version):
        raise StoreError(f"{manifest_key} describes {manifest.run} v{manifest.version}, "
                         f"not {run} v{version}")
    return ckpt.download_checkpoint(bucket, manifest, root)


@dataclass
class Watcher:
    settings: WatcherSettings
    bucket: AsyncBucket
    engine: EngineClient
    bus: Bus
    good: int | None = None  # the last version seen verified and served: kept when LATEST fails
    reference: Path | None = None  # the served model's folder, for compat.check_fits
    _no_reference_noted: bool = field(default=False, init=False)
    _reached: bool = field(default=False, init=False)  # the engine answered the last pass
    state: WatcherState = field(init=False)
    refusals: Refusals = field(init=False)
    gate: Gate | None = field(init=False)  # the promotion gate, when enabled

    def __post_init__(self) -> None:
        self.state = WatcherState(engine=self.cfg.engine_url)
        self.refusals = Refusals(self.cfg.retry_bad_after_s)
        self.gate = Gate(self.settings, self.bus, self.bucket) if self.settings.gate.enabled else None

    @property
    def cfg(self) -> WatcherConfig:
        return self.settings.watcher

    async def check_serving(self) -> None:
        """Readiness: fails while the engine serves other than its target after a pass tried."""
        if problem := self.state.problem():
            raise RuntimeError(problem)

    def _note(self, error: str) -> None:
        self.state.errors.append(error)

    # -- the pass --------------------------------------------------------------------------
    async def sync_once(self) -> PolicyLoaded | None:
        """One reconciliation pass. Returns the announcement when it loaded a version."""
        before, self.state.errors = self.state.errors, []
        latest = await self._read_latest()
        if self.gate is not None:
            await self._step_gate(latest)
        event = None
        try:
            if await self._observe():
                event = await self._reconcile(latest)
        except EngineError as exc:
            self._note(f"engine failed mid-reload: {exc}")
            self.state.observe(None)  # its weights are unknown until the next pass asks
        except (StoreError, OSError) as exc:
            self._note(f"{type(exc).__name__}: {exc}")
        self.state.unfixed = self.state.mismatch
        self._log_change(before)
        await publish_state(self.bus, self.state)
        return event

    def _log_change(self, before: list[str]) -> None:
        """Log a pass's errors when they differ from the last pass's (not every poll)."""
        extra = {"engine_version": self.state.observed, "target": self.state.target}
        if self.state.errors and self.state.errors != before:
            log.warning("watch pass: %s", "; ".join(self.state.errors)[:1000], extra=extra)
        elif before and not self.state.errors:
            log.info("watch pass clean again", extra=extra)

    async def _read_latest(self) -> Latest:
        try:
            pointer = await self.bucket.run(ckpt.read_latest, self.bucket.sync, self.settings.run)
        except StoreError as exc:
            self._note(f"LATEST unreadable, keeping the last good version: {exc}")
            latest = Latest(unreadable=str(exc))
        else:
            latest = Latest(pointer=pointer)
        self.state.latest = latest.version
        return latest

    async def _step_gate(self, latest: Latest) -> None:
        """Let the gate take new results and decide (an outage is noted: the engine stays
        on what the gate promoted so far, or keeps its weights before the gate could load)."""
        assert self.gate is not None
        try:
            await self.gate.step(latest.version)
        except (RedisError, BusError) as exc:
            loaded = self.gate.book is not None
            self._note(f"gate: {type(exc).__name__}: {exc}" + ("" if loaded else "; nothing is loaded "
                       "until the gate has read its state"))

    async def _observe(self) -> bool:
        """Ask the engine what it serves; False (noted) when it cannot be reached."""
        try:
            served = await self.engine.weight_version()
        except EngineError as exc:
            if self._reached:  # it answered until now: said at once, loudly, not only as a note
                log.critical("THE ENGINE STOPPED ANSWERING; the collector answers 502 until it is back "
                             "(nextstate up restarts it), then the last good version is put back",
                             extra={"engine": self.cfg.engine_url, "last_good": self.good, "error": str(exc)[:300]})
            self._reached = False
            self.state.observe(None)
            self._note(f"engine unreachable: {exc}")
            return False
        if not self._reached:
            log.info("engine answering", extra={"engine": self.cfg.engine_url, "serves": served})
        self._reached = True
        self.state.observe(served)
        if self.good is None:  # a fresh watcher: what the engine serves is the last good version
            version = policy_version(served)
            if self.gate is None or self.gate.promoted(version):
                self.good = version
        return True

    async def _reconcile(self, latest: Latest) -> PolicyLoaded | None:
        """Make the engine serve the best version that verifies and loads."""
        if self.gate is not None:
            return await self._reconcile_gated(latest)
        previous = self.state.target
        now = time.monotonic()
        if latest.version is not None and (why := self.refusals.why(latest.version, now)):
            self._note(f"LATEST v{latest.version} was refused ({why})")
        order = first_choices(latest.version, self.good, self.refusals.recent(now))
        served, event = await self._serve_first(order, latest)
        if served is None and latest.published:
            listed = await self.bucket.run(ckpt.list_versions, self.bucket.sync, self.settings.run)
            skip = self.refusals.recent(time.monotonic()) | set(order)
            more = fallbacks(listed, latest.version, skip)
            served, event = await self._serve_first(more, latest)
            order += more
        self.state.target = served if served is not None else (order[0] if order else previous)
        return event

    async def _reconcile_gated(self, latest: Latest) -> PolicyLoaded | None:
        """Make the engine serve the best promoted version that verifies and loads."""
        assert self.gate is not None
        order = self.gate.choices(latest.version, self.refusals.recent(time.monotonic()))
        served, event = await self._serve_first(order, latest)
        self.state.target = served if served is not None else (order[0] if order else None)
        engine_on = policy_version(self.state.observed)
        if self.state.target is None and engine_on is not None and not self.gate.promoted(engine_on):
            self._note(f"engine serves {label(self.state.observed)}, which the gate has not promoted; "
                       "no promoted version to serve instead")
        return event

    async def _serve_first(self, order: list[int], latest: Latest) -> tuple[int | None, PolicyLoaded | None]:
        """The first version of `order` the engine serves, loading it if need be, and the
        announcement if a load happened; (None, None) when none would verify and load."""
        for version in order:
            self.state.target = version
            if self.state.observed == str(version):
                self.good = version
                return version, None
            await publish_state(self.bus, self.state)  # shows the mismatch while it is fixed
            event = await self._load(version, latest)
            if event is not None:
                return version, event
        return None, None

    # -- one load --------------------------------------------------------------------------
    def _engine_path(self, folder: Path) -> str:
        """The installed folder as the engine sees it."""
        if self.cfg.engine_dir:
            return f"{self.cfg.engine_dir.rstrip('/')}/{folder.name}"
        return str(folder.resolve())

    async def _install(self, version: int, latest: Latest) -> tuple[Path, CheckpointManifest] | None:
        """The verified local folder of `version` and its manifest; None (refused) if it does not verify."""
        run = self.settings.run
        key = latest.pointer.manifest if latest.pointer and latest.version == version \
            else ckpt.manifest_key(run, version)
        folder = None
        try:
            folder = await self.bucket.run(install, self.bucket.sync, self.cfg.local_dir, run, version, key)
            served = None if self.cfg.served_dtype == "auto" else self.cfg.served_dtype
            manifest = await self.bucket.run(verify_folder, folder, await self._reference(), served)
            return folder, manifest
        except BrokenDelta as exc:
            await self._refuse(version, "delta", str(exc))
        except ChecksumMismatch as exc:
            await self._refuse(version, "checksum", str(exc))
        except IncompatibleCheckpoint as exc:
            await self._refuse(version, "incompatible", str(exc))
        except StoreError as exc:
            await self._refuse(version, "download", str(exc))
        if folder is not None:  # a retry downloads it again rather than reuse a bad local copy
            await asyncio.to_thread(shutil.rmtree, folder, True)
        return None

    async def _reference(self) -> Path | None:
        """The served model's folder: NEXTSTATE_WATCHER__BASE_MODEL, else the engine's
        model path when this machine has it; None (noted once) when neither is at hand."""
        if self.reference is not None:
            return self.reference
        candidates = [self.cfg.base_model] if self.cfg.base_model else []
        try:
            candidates.append(str((await self.engine.model_info()).get("model_path") or ""))
        except EngineError:
            pass
        for c in candidates:
            if c and (Path(c) / "config.json").is_file():
                self.reference = Path(c)
                return self.reference
        if not self._no_reference_noted:
            self._no_reference_noted = True
            log.warning("no folder of the served model to check versions against: files and sha256 "
                        "are verified, config and tensor shapes are not (set NEXTSTATE_WATCHER__BASE_MODEL)")
        return None

    async def _load(self, version: int, latest: Latest) -> PolicyLoaded | None:
        """Install, load and confirm `version`; None (refused and recorded) if any step fails."""
        cause: Cause = "reconcile" if version == self.good else "new_version"
        started = time.monotonic()
        installed = await self._install(version, latest)
        if installed is None:
            return None
        folder, manifest = installed
        downloaded = time.monotonic()
        try:
            ok, message = await serve_version(self.engine, self._engine_path(folder), manifest,
                                              abort_all_requests=self.cfg.abort_requests)
        except EngineDied as exc:
            await self._engine_died(version, str(exc))
            return None
        served = await self.engine.weight_version()
        self.state.observe(served)
        if not ok:
            await self._refuse(version, "engine", message)
            return None
        if served != str(version):
            await self._refuse(version, "confirm",
                               f"engine reports weight_version {served!r} after loading {version}")
            return None
        loaded = time.monotonic()
        DOWNLOAD_SECONDS.observe(downloaded - started)
        LOAD_SECONDS.observe(loaded - downloaded)
        self.good = version
        self.refusals.clear(version)
        return await self._announce(version, cause, latest, downloaded - started, loaded - downloaded)

    async def _engine_died(self, version: int, detail: str) -> None:
        """The engine was asked to load `version` and is not healthy since: said loudly, the
        version held off (loading it again would break the engine again), what it serves unknown."""
        self.state.observe(None)
        log.critical("THE ENGINE IS DOWN after it was asked to load a verified version; it must be "
                     "restarted (nextstate up does), then the last good version is put back",
                     extra={"version": version, "last_good": self.good, "engine": self.cfg.engine_url,
                            "detail": detail[:500]})
        await self._refuse(version, "engine-died", detail)

    async def _refuse(self, version: int, reason: str, detail: str) -> None:
        self.refusals.add(version, reason, time.monotonic())
        self._note(f"v{version} refused ({reason}): {detail[:500]}")
        log.error("version refused; the engine keeps serving its current weights",
                  extra={"version": version, "reason": reason, "detail": detail[:500],
                         "engine_version": self.state.observed})
        await record_refusal(self.bus, version, reason, detail)

    async def _announce(
        self, version: int, cause: Cause, latest: Latest, download_s: float, load_s: float
    ) -> PolicyLoaded:
        sync_s = None
        if cause == "new_version" and latest.pointer is not None and latest.version == version:
            sync_s = max(0.0, time.time() - latest.pointer.committed_at)
            SYNC_SECONDS.observe(sync_s)
        RELOADS.labels(cause).inc()
        event = PolicyLoaded(
            run=self.settings.run, version=version, weight_version=str(version),
            engine=self.cfg.engine_url, download_s=round(download_s, 3), load_s=round(load_s, 3),
            sync_s=None if sync_s is None else round(sync_s, 3), cause=cause,
            promotion=None if self.gate is None else self.gate.why(version),
        )
        try:
            await self.bus.publish("policy", event)
        except BusError as exc:
            log.warning("could not announce the loaded policy", extra={"error": str(exc)})
        log.info("policy loaded", extra={"version": version, "cause": cause, "download_s": event.download_s,
                                         "load_s": event.load_s, "sync_s": event.sync_s})
        await self.bucket.run(ckpt.prune_local, self.cfg.local_dir, self.cfg.keep_local, protect=[version])
        return event

    async def run_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sync_once()
            except (NextstateError, OSError) as exc:  # a pass notes its own errors; this is a guard
                log.warning("watch pass failed, retrying", extra={"error": f"{type(exc).__name__}: {exc}"})
            await self._pause(stop)

    async def _pause(self, stop: asyncio.Event) -> None:
        """Wait `poll_interval_s` between passes, or less: until `stop`, or (gate on) until
        an evaluation result arrives, so that the gate decides on it at once."""
        waits: list[asyncio.Task[bool]] = [asyncio.create_task(stop.wait())]
        if self.gate is not None:
            waits.append(asyncio.create_task(self.gate.wait(self.cfg.poll_interval_s)))
        try:
            done, _ = await asyncio.wait(waits, timeout=self.cfg.poll_interval_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and isinstance(task.exception(), (RedisError, BusError)):
                    # The next pass meets the outage too and notes it; do not spin meanwhile.
                    await asyncio.wait_for(stop.wait(), self.cfg.poll_interval_s)
        except asyncio.TimeoutError:
            pass
        finally:
            for task in waits:
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
