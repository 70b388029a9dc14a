"""The trainer service's side of a rollback: look for one, guard commits, find where to rebase.

`Follower` holds what the service knows of its lineage (services/trainer/rebase.py) and
does the I/O around the decisions:

- `check()` (before each step and each commit) reads the rebase record (Redis) and
  LATEST (bucket) and asks `decide`; a rebase found is *pending* until the train loop
  carries it out, and bumps the `epoch`: every snapshot taken before is abandoned.
- `guard(snapshot)` is shown LATEST by `publish_checkpoint` before the manifest and
  before LATEST: it stops the commit of an abandoned snapshot, or of any snapshot once
  LATEST was moved back below the trainer's newest version (the rollback seen first there).
- `load(base)` finds version `base` (or the newest below it that verifies) the way a
  resume does; `restore_latest` puts LATEST back on the rollback's version when a commit
  of the abandoned lineage moved it before the rollback was seen.

Reading the record or LATEST can fail (Redis or the bucket down): that is "nothing new",
logged once, and training goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from services.trainer.checkpoint import Snapshot
from services.trainer.rebase import Abandoned, LineageView, Rebase, decide
from services.trainer.resume import ResumePoint, find_resume_point
from services.trainer.step import TrainerBroken
from shared.checkpoints import read_latest, set_latest
from shared.errors import MalformedMessage, NextstateError, StoreError
from shared.lineage import RebaseRecord, read_record
from shared.schemas import LatestPointer
from shared.store import AsyncBucket
from shared.streams import Bus

log = logging.getLogger(__name__)


class Superseded(NextstateError):
    """A commit stopped because a rollback abandoned the lineage of its version; `decision`
    when the guard saw the rollback first (LATEST moved back)."""

    def __init__(self, message: str, decision: Rebase | None = None) -> None:
        super().__init__(message)
        self.decision = decision


class RebaseNeedsRestart(TrainerBroken):
    """A rebase this process cannot do in place: it stops, and its restart resumes from the
    rollback (LATEST, or the rebase record when LATEST did not move)."""


class CommitGuard:
    """The `guard` of one commit (runs on the bucket's thread)."""

    def __init__(self, follower: Follower, snap: Snapshot) -> None:
        self.follower, self.snap = follower, snap
        self.passed_at = 0.0  # when it last let the commit go on (just before LATEST moved)

    def __call__(self, latest: LatestPointer | None) -> None:
        f, v = self.follower, self.snap.version
        if self.snap.epoch != f.epoch:
            raise Superseded(f"v{v} was trained on a lineage a rollback abandoned")
        if (d := decide(f.view, None, latest)) is not None:
            raise Superseded(f"LATEST was moved back to v{d.base}: v{v} is not committed", d)
        self.passed_at = time.time()


class Follower:
    def __init__(
        self, bus: Bus, bucket: AsyncBucket, run: str, resume: ResumePoint, record: RebaseRecord | None,
        on_decided: Callable[[], None],
    ) -> None:  # fmt: skip
        self.bus, self.bucket, self.run = bus, bucket, run
        latest_at = resume.latest.committed_at if resume.latest is not None else 0.0
        self.view = LineageView(head=resume.version, head_at=latest_at, followed=record)
        # Numbers above LATEST were never served and will not be built on (numbers only grow):
        # after a rollback made while no trainer ran, they are the abandoned lineage.
        self.abandoned = Abandoned()
        if resume.latest is not None:
            self.abandoned.add(resume.latest.version, resume.next_version - 1)
        self.pending: Rebase | None = None  # decided, not yet carried out
        self.epoch = 0  # rebases decided: a snapshot of an older epoch is abandoned
        self.on_decided = on_decided
        self._lock = asyncio.Lock()
        self._unreadable: set[str] = set()

    async def check(self) -> Rebase | None:
        """The rebase to carry out: the pending one, or one `decide` finds now."""
        async with self._lock:
            if self.pending is None:
                record = await self._read("rebase record", read_record(self.bus.redis, self.bus.keys))
                latest = await self._read("LATEST", self.bucket.run(read_latest, self.bucket.sync, self.run))
                if (decision := decide(self.view, record, latest)) is not None:
                    self.decided(decision)
            return self.pending

    async def _read(self, what: str, reading: Awaitable[Any]) -> Any:
        try:
            value = await reading
        except (RedisError, NextstateError) as exc:  # Redis, the bucket, a record that does not parse
            if what not in self._unreadable:
                log.warning("cannot read the %s to look for a rollback; going on", what,
                            extra={"error": str(exc)})
            self._unreadable.add(what)
            return None
        self._unreadable.discard(what)
        return value

    def decided(self, decision: Rebase) -> None:
        """From now on nothing of the current lineage is committed; the train loop rebases."""
        if self.pending is not None:
            return
        self.pending = decision
        self.epoch += 1
        log.warning("rollback to v%s (by %s): rebasing", decision.base, decision.by,
                    extra={"base": decision.base, "by": decision.by, "head": self.view.head})
        self.on_decided()

    def guard(self, snap: Snapshot) -> CommitGuard:
        return CommitGuard(self, snap)

    def committed(self, snap: Snapshot, guard: CommitGuard) -> bool:
        """Note a commit; False when its lineage was abandoned meanwhile (after its guard passed)."""
        if snap.epoch != self.epoch:
            return False
        self.view = self.view.committed(snap.version, guard.passed_at)
        return True

    def rebased(self, decision: Rebase, base: int, last_used: int) -> None:
        """The rebase is done, on `base`: the version asked for, or a lower one when that did
        not verify here. Abandoned: every number above the version *asked for* up to
        `last_used` (that version itself is served, whatever the trainer could load)."""
        self.abandoned.add(decision.base, last_used)
        self.view = self.view.rebased(decision, base)
        self.pending = None

    async def load(self, base: int, dest: Path, need_weights: bool, stopping: asyncio.Event,
                   retry_max_s: float) -> ResumePoint | None:
        """Version `base`, or the newest below it that verifies (reported as refusals), retried
        while the bucket does not answer; None once `stopping`."""
        delay = 1.0
        while not stopping.is_set():
            try:
                return await self.bucket.run(find_resume_point, self.bucket.sync, self.run, dest,
                                             need_weights=need_weights, at=base)
            except StoreError as exc:
                log.error("cannot load the version to rebase on, will retry",
                          extra={"base": base, "retry_in_s": delay, "error": str(exc)})
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stopping.wait(), delay)
                delay = min(delay * 2, retry_max_s)
        return None


async def restore_latest(bucket: AsyncBucket, run: str, base: int, last_used: int) -> None:
    """If LATEST names a version in (base, last_used] — the lineage a rebase onto `base`
    abandoned — point it at `base`: the trainer's only backward move of LATEST, onto a
    rollback and never past it. Best effort (logged)."""
    try:
        latest = await bucket.run(read_latest, bucket.sync, run)
        if latest is not None and base < latest.version <= last_used:
            log.warning("LATEST names v%s of the abandoned lineage: back to v%s", latest.version, base,
                        extra={"latest": latest.version, "base": base})
            await bucket.run(set_latest, bucket.sync, run, base)
    except StoreError as exc:
        log.error("could not check or restore LATEST after a rebase", extra={"base": base, "error": str(exc)})


async def startup_record(bus: Bus) -> RebaseRecord | None:
    """The rebase record at start (None without one, or when Redis does not answer)."""
    try:
        return await read_record(bus.redis, bus.keys)
    except (RedisError, MalformedMessage) as exc:
        log.warning("cannot read the rebase record; a rollback is followed through LATEST only",
                    extra={"error": str(exc)})
        return None
