"""The trainer state beside each version, and the resume state written at a cadence of its own.

A version is its weights (policies/<run>/vN/) plus a small per-version record. What only a
restart needs — the optimizer's state (whatever `optimizer.state_dict()` returns, kept
opaque: AdamW's moments and, under mixed precision, its fp32 masters), the RNG, the step,
with LoRA the adapter — is the *resume state*: written every `RESUME_EVERY` versions or
`RESUME_EVERY_S` seconds and on a clean stop, after its version is committed, on a lane of
its own, so no version's commit waits for it (docs/design.md#resume-and-rollback):

    trainer-state/<run>/v000042/state.json   every version: step, parent, ancestors, consumed ids
    trainer-state/<run>/v000042/adapter.pt   every version with LoRA published merged: its adapter
    trainer-state/<run>/v000040/state.pt     the resume state, of some versions only

A trainer resumes on the weights of the newest committed version L and the optimizer of the
newest resume state at or below it *in L's lineage* (L itself or one of the `ancestors` its
record lists), the versions in between known by their records (their consumed batch ids are
in L's); with none, the optimizer starts fresh on L's weights (logged). Retention keeps, for
every version kept, the resume state it would resume from (`needed_resume_states`).
"""

from __future__ import annotations

import asyncio
import copy
import io
import json
import logging
import random
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.trainer import metrics as M
from shared.checkpoints import trainer_state_prefix, version_dirname
from shared.errors import CorruptCheckpoint, ObjectNotFound, StoreError
from shared.store import AsyncBucket, Bucket

log = logging.getLogger(__name__)

STATE_META = "state.json"  # per version
STATE_ADAPTER = "adapter.pt"  # per version, LoRA published merged (the weights cannot give it back)
STATE_TENSORS = "state.pt"  # the resume state
ANCESTRY = 1000  # ancestors a version's record lists, newest last: far more than RESUME_EVERY
_VERSION_DIR = re.compile(r"v(\d{6,})")


def state_key(run: str, version: int, name: str) -> str:
    return f"{trainer_state_prefix(run)}{version_dirname(version)}/{name}"


def cpu_clone(obj: Any) -> Any:
    """Deep copy with every tensor copied to CPU (the live ones keep changing)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_clone(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(cpu_clone(v) for v in obj)
    return copy.deepcopy(obj)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- the resume state: taken, written, read ---------------------------------------------------------
@dataclass
class ResumeState:
    """The trainer's state right after the step that made `version`, copied off the trainer."""

    version: int
    step: int
    tensors: dict[str, Any]  # version, step, optimizer, rng, adapter (None without LoRA)
    epoch: int = 0  # the service's rebase count when taken (an older one is abandoned)


def take_resume_state(trainer: Any, version: int, step: int, epoch: int = 0) -> ResumeState:
    """Copy the optimizer state, RNG and (LoRA) adapter; call between steps, on the thread
    that trains, when the weights are `version`'s."""
    from services.trainer.model import adapter_state, is_lora

    tensors = {
        "version": version,
        "step": step,
        "optimizer": cpu_clone(trainer.optimizer.state_dict()),
        "rng": rng_state(),
        "adapter": cpu_clone(adapter_state(trainer.model)) if is_lora(trainer.model) else None,
    }
    return ResumeState(version=version, step=step, tensors=tensors, epoch=epoch)


def write_resume_state(bucket: Bucket, run: str, state: ResumeState, work_dir: Path) -> int:
    """Upload `state` as its version's resume state; returns its size in bytes."""
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / f"resume-{version_dirname(state.version)}.pt"
    try:
        torch.save(state.tensors, path)
        size = path.stat().st_size
        bucket.put_file(state_key(run, state.version, STATE_TENSORS), path)
    finally:
        path.unlink(missing_ok=True)
    return size


def load_resume_state(bucket: Bucket, run: str, version: int) -> dict[str, Any]:
    """The resume state of `version`: `ObjectNotFound` if it has none, `CorruptCheckpoint` if
    it cannot be read."""
    key = state_key(run, version, STATE_TENSORS)
    return _load_tensors(bucket.get_bytes(key), f"the resume state of {run} v{version}")


def load_adapter(bucket: Bucket, run: str, version: int) -> dict[str, torch.Tensor] | None:
    """The adapter a LoRA version published merged was trained as (None: it has none)."""
    try:
        data = bucket.get_bytes(state_key(run, version, STATE_ADAPTER))
    except ObjectNotFound:
        return None
    return _load_tensors(data, f"the adapter of {run} v{version}")


def _load_tensors(data: bytes, what: str) -> dict[str, Any]:
    try:
        tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CorruptCheckpoint(f"{what} cannot be read: {exc}") from exc
    if not isinstance(tensors, dict):
        raise CorruptCheckpoint(f"{what} holds a {type(tensors).__name__}")
    return tensors


def read_state_meta(bucket: Bucket, run: str, version: int) -> dict[str, Any] | None:
    """The version's record (step, consumed ids, parent, ancestors); None if it has none,
    `CorruptCheckpoint` if it is there but unreadable."""
    key = state_key(run, version, STATE_META)
    try:
        data = bucket.get_bytes(key)
    except ObjectNotFound:
        return None
    try:
        meta = json.loads(data)
    except ValueError as exc:
        raise CorruptCheckpoint(f"{key} is not JSON: {exc}") from None
    if not (isinstance(meta, dict) and isinstance(meta.get("step"), int)
            and isinstance(meta.get("consumed_batch_ids"), list)):
        raise CorruptCheckpoint(f"{key} is not a trainer-state record (step, consumed_batch_ids)")
    return meta


def ancestors_of(meta: Mapping[str, Any] | None, parent: int | None = None) -> list[int]:
    """The versions a record says its version descends from, oldest first (a record written
    before ancestors were recorded: its parent alone)."""
    listed = meta.get("ancestors") if meta else None
    if isinstance(listed, list) and all(isinstance(v, int) for v in listed):
        return [v for v in listed if v > 0]
    parent = meta.get("parent", parent) if meta else parent
    return [parent] if isinstance(parent, int) and parent > 0 else []


def state_versions(bucket: Bucket, run: str, name: str | None = None) -> set[int]:
    """Versions with anything under trainer-state/<run>/ (with `name`: with that file)."""
    base = trainer_state_prefix(run)
    found = set()
    for obj in bucket.list(base, recursive=True):
        head, _, rest = obj.key[len(base):].partition("/")
        if (m := _VERSION_DIR.fullmatch(head)) and (name is None or rest == name):
            found.add(int(m.group(1)))
    return found


# -- which resume state: pure ---------------------------------------------------------------------------
def resume_order(version: int, ancestors: Sequence[int], have: set[int]) -> list[int]:
    """The resume states to try for a trainer on `version`'s weights, newest first: its own
    and its ancestors' (never another lineage's, never one above it)."""
    return sorted({v for v in (version, *ancestors) if v in have and v <= version}, reverse=True)


def needed_resume_states(kept: Mapping[int, Sequence[int] | None], have: set[int]) -> set[int]:
    """The resume states retention keeps: for each kept version, the one it would resume from.
    A version whose lineage is unknown (None: no record) keeps the newest at or below it."""
    needed = set()
    for version, ancestors in kept.items():
        if ancestors is None:
            order = sorted((v for v in have if v <= version), reverse=True)
        else:
            order = resume_order(version, ancestors, have)
        needed.update(order[:1])
    return needed


@dataclass
class Cadence:
    """When the next resume state is due: `every` versions or `every_s` seconds after the
    last one was taken — time counts only once a version was made since (an idle trainer
    has nothing new to save). One that was not written is due again, `retry_s` later."""

    every: int
    every_s: float
    retry_s: float = 30.0
    versions: int = 0  # versions made since the last resume state was taken
    last_at: float = field(default_factory=time.monotonic)
    retry_at: float = 0.0

    def made(self) -> None:
        self.versions += 1

    def wait(self, now: float | None = None) -> float | None:
        """Seconds until it is due (0: now); None: no version made since the last one."""
        if self.versions == 0:
            return None
        now = time.monotonic() if now is None else now
        until = 0.0 if self.versions >= self.every else self.every_s - (now - self.last_at)
        return max(0.0, until, self.retry_at - now)

    def due(self, now: float | None = None) -> bool:
        wait = self.wait(now)
        return wait is not None and wait <= 0

    def taken(self, now: float | None = None) -> None:
        self.versions = 0
        self.last_at = time.monotonic() if now is None else now

    def missed(self, now: float | None = None) -> None:
        """The state taken was not written: due again (what it held is not saved), in `retry_s`."""
        now = time.monotonic() if now is None else now
        self.versions = max(self.versions, 1)
        self.last_at = -float("inf")
        self.retry_at = now + self.retry_s

    def restart(self, now: float | None = None) -> None:
        """Count from here (a start, a rebase: the optimizer state is what was loaded)."""
        self.versions, self.retry_at = 0, 0.0
        self.last_at = time.monotonic() if now is None else now


# -- the lane that writes them ------------------------------------------------------------------------
class ResumeLane:
    """Writes resume states one at a time, each once its version is committed. A state taken
    for a version still uploading is *held*; `committed(v, epoch)` from the upload lane
    releases it; a rebase drops what is held. At most one state is held or being written:
    while one is, the cadence waits (`due` is False), so no second copy of the optimizer
    state piles up — except the one taken at a clean stop."""

    def __init__(self, bucket: AsyncBucket, run: str, work_dir: Path, cadence: Cadence,
                 committed: int) -> None:
        self.bucket, self.run_name, self.work_dir, self.cadence = bucket, run, work_dir, cadence
        self.last_committed = (committed, 0)  # (version, epoch) of the newest commit seen
        self.held: list[ResumeState] = []
        self.queue: asyncio.Queue[ResumeState | None] = asyncio.Queue()
        self.writing = 0  # released, not yet written or failed
        self.quiet = asyncio.Event()
        self.quiet.set()
        self.closed = False

    @property
    def busy(self) -> bool:
        return bool(self.held) or self.writing > 0

    def due(self, *, final: bool = False) -> bool:
        """Take a resume state with this version? `final` (a clean stop): whenever a version
        was made since the last one."""
        if final:
            return self.cadence.versions > 0
        return not self.busy and self.cadence.due()

    def hold(self, state: ResumeState) -> None:
        """A state just taken (the cadence restarts): written once its version is committed."""
        self.cadence.taken()
        self.held.append(state)
        self.quiet.clear()
        self._release()

    def committed(self, version: int, epoch: int) -> None:
        """The upload lane committed `version` in `epoch`: write what it held up to it."""
        self.last_committed = (version, epoch)
        self._release()

    def idle_wait(self) -> float | None:
        """How long an idle train loop may wait before taking a state due by time (None: none
        to take; while one is still being written, it looks again each second)."""
        wait = self.cadence.wait()
        return max(wait, 1.0) if wait is not None and self.busy else wait

    def abandoned(self) -> None:
        """A rollback was decided: what is held belongs to the lineage left."""
        self.held = []
        self._settle()

    def rebased(self, version: int, epoch: int) -> None:
        """Rebased on `version`: its commits are the new epoch's; the cadence counts from here."""
        self.abandoned()
        self.last_committed = (version, epoch)
        self.cadence.restart()

    def _release(self) -> None:
        version, epoch = self.last_committed
        ready = [s for s in self.held if s.epoch == epoch and s.version <= version]
        self.held = [s for s in self.held if s not in ready]
        for s in ready:
            self.writing += 1
            self.queue.put_nowait(s)

    def _settle(self) -> None:
        if not self.busy:
            self.quiet.set()

    async def idle(self) -> None:
        """Returns once nothing is held or being written."""
        await self.quiet.wait()

    def close(self) -> None:
        """No more commits: what is still held is dropped, `run` ends after the writes."""
        if self.closed:
            return
        self.closed = True
        for s in self.held:
            log.warning("resume state not written: its version was not committed",
                        extra={"version": s.version})
        self.held = []
        self._settle()
        self.queue.put_nowait(None)

    async def run(self) -> None:
        while (state := await self.queue.get()) is not None:
            started = time.perf_counter()
            try:
                size = await self.bucket.run(write_resume_state, self.bucket.sync, self.run_name, state,
                                             self.work_dir)
            except (StoreError, OSError, RuntimeError) as exc:  # RuntimeError: torch.save's disk full
                M.RESUME_FAILURES.inc()
                self.cadence.missed()
                log.error("resume state not written; the next version takes another",
                          extra={"version": state.version, "error": str(exc)})
            else:
                seconds = time.perf_counter() - started
                M.RESUME_STATES.inc()
                M.RESUME_SECONDS.observe(seconds)
                log.info("resume state written", extra={
                    "version": state.version, "step": state.step, "bytes": size, "seconds": round(seconds, 3)})
            finally:
                self.writing -= 1
                self._settle()
        self._settle()
