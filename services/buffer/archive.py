"""Archive every batched sample to the bucket as rolling gzip JSONL, off the hot path.

The archiver reads `batches` in a consumer group of its own (`archive`), beside the
trainer's: it sees every published batch, whatever happens to the buffer process that
published it, and it acknowledges a batch only once the archive object holding it is
uploaded. A buffer killed with a roll open therefore loses nothing: the restarted
buffer (same consumer name) takes its unacknowledged batches back and archives them.

`add(batch)` appends the batch's samples to the open roll and waits. A roll is sealed
when it holds `roll_samples` samples, `max_batches` batches, or its first sample is
`roll_s` old; it is then compressed (in a thread) and uploaded by the background task:

    samples/<run>/<YYYY-MM-DD>/<first sample ms>-<instance>-<seq>.jsonl.gz

one `TrainSample` JSON per line. A failed upload is retried with backoff and counted;
batching and training never wait for it (they do not read this group). If the bucket
stays away so long that more than `max_pending` sealed rolls pile up, the oldest is
dropped and its batches acknowledged (counted, logged): the archive is a record, never
a brake. On a graceful stop, rolls that could not be uploaded in time stay
unacknowledged and are archived after the restart.

Delivery is at least once: a crash between an upload and its acknowledgement archives
those batches again in a later object (sample ids tell the copies apart).

Holding a roll's batches unacknowledged for up to `roll_s` is the design, so the archive
says so: `report(state)` (the buffer writes it to `archive-state` in Redis, field = its
consumer name) gets `{roll_s, grace_s, held_since, uploaded_at, last_key, at}` whenever
what it holds changes (a roll opens, an object is uploaded, a roll is dropped).
`nextstate status` reads it to tell this hold from a stall: a stall is a hold older
than `roll_s + grace_s` (uploads failing, or the task stuck).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import gzip
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from services.buffer import metrics as M
from shared.checkpoints import samples_prefix
from shared.consumer import Delivery
from shared.schemas import TrainBatch, TrainSample
from shared.store import AsyncBucket

log = logging.getLogger(__name__)


@dataclass
class _Roll:
    seq: int
    lines: list[str] = field(default_factory=list)
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    started: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Sealed:
    key: str
    lines: tuple[str, ...]
    waiters: tuple[asyncio.Future[None], ...] = ()
    started: float = 0.0  # when its first sample came (its batches are held since)

    def settle(self) -> None:
        for w in self.waiters:
            if not w.done():
                w.set_result(None)


def encode(lines: tuple[str, ...] | list[str]) -> bytes:
    return gzip.compress(("\n".join(lines) + "\n").encode(), compresslevel=6)


def decode(data: bytes) -> list[TrainSample]:
    """The samples of one archive object (for tools and tests)."""
    text = gzip.decompress(data).decode()
    return [TrainSample.from_json(line) for line in text.splitlines() if line]


class Archiver:
    def __init__(
        self,
        bucket: AsyncBucket,
        run: str,
        *,
        roll_samples: int,
        roll_s: float,
        max_pending: int,
        retry_max_s: float,
        max_batches: int = 128,
        report: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = samples_prefix(run)
        self.roll_samples = roll_samples
        self.roll_s = roll_s
        self.max_pending = max_pending
        self.retry_max_s = retry_max_s
        self.max_batches = max_batches
        self.instance = uuid.uuid4().hex[:8]
        self._seq = 0
        self._roll = _Roll(seq=0)
        self._sealed: deque[Sealed] = deque()
        self._wake = asyncio.Event()
        self._closing = False
        self._report = report
        self._reported: tuple[float | None, str | None] | None = None  # (held_since, last_key) sent
        self.uploaded_at: float | None = None
        self.last_key: str | None = None

    # -- the `archive` group's handler ----------------------------------------------------
    async def add(self, batch: TrainBatch) -> None:
        """Append `batch` to the open roll; return once a roll holding it is uploaded."""
        waiter = asyncio.get_running_loop().create_future()
        if not self._roll.lines:
            self._roll.started = time.time()
        self._roll.lines.extend(s.to_json() for s in batch.samples)
        self._roll.waiters.append(waiter)
        if len(self._roll.lines) >= self.roll_samples or len(self._roll.waiters) >= self.max_batches:
            self._seal()
        self._wake.set()
        await asyncio.shield(waiter)

    async def handle(self, batch: TrainBatch, delivery: Delivery) -> None:
        await self.add(batch)

    @property
    def backlog(self) -> int:
        """Samples not yet uploaded (open roll + sealed rolls)."""
        return len(self._roll.lines) + sum(len(s.lines) for s in self._sealed)

    def _seal(self) -> None:
        roll = self._roll
        self._seq += 1
        self._roll = _Roll(seq=self._seq)
        if not roll.lines:
            return
        day = dt.datetime.fromtimestamp(roll.started, dt.timezone.utc).strftime("%Y-%m-%d")
        key = f"{self.prefix}{day}/{int(roll.started * 1000)}-{self.instance}-{roll.seq:06d}.jsonl.gz"
        self._sealed.append(Sealed(key, tuple(roll.lines), tuple(roll.waiters), roll.started))
        while len(self._sealed) > self.max_pending:
            dropped = self._sealed.popleft()
            dropped.settle()
            M.ARCHIVE_DROPPED.inc(len(dropped.lines))
            log.error("archive backlog full, dropping the oldest roll",
                      extra={"key": dropped.key, "samples": len(dropped.lines)})
        self._wake.set()

    # -- what it holds on purpose ----------------------------------------------------------
    @property
    def held_since(self) -> float | None:
        """When the oldest sample not yet uploaded came (None: it holds nothing)."""
        if self._sealed:
            return self._sealed[0].started
        return self._roll.started if self._roll.lines else None

    @property
    def grace_s(self) -> float:
        """How long past `roll_s` an upload may take before the hold counts as a stall:
        a few backoff rounds of failed uploads."""
        return max(60.0, 3 * self.retry_max_s)

    def state(self) -> dict[str, Any]:
        return {"roll_s": self.roll_s, "grace_s": self.grace_s, "held_since": self.held_since,
                "uploaded_at": self.uploaded_at, "last_key": self.last_key, "at": time.time()}  # fmt: skip

    async def _tell(self) -> None:
        """Report the state when what it holds changed (never a brake: failures are logged)."""
        now = (self.held_since, self.last_key)
        if self._report is None or now == self._reported:
            return
        try:
            await self._report(self.state())
            self._reported = now
        except Exception as exc:
            log.warning("could not report the archive's state", extra={"error": str(exc)})

    # -- the background task ------------------------------------------------------------
    async def run(self) -> None:
        """Seal rolls when due and upload them, until `close()`."""
        delay = 0.1
        while True:
            await self._tell()
            if self._roll.lines and time.time() - self._roll.started >= self.roll_s:
                self._seal()
            if self._sealed:
                ok = await self._upload(self._sealed[0])
                if ok:
                    self._sealed.popleft().settle()
                    delay = 0.1
                    continue
                if self._closing:
                    return
                await self._sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
                continue
            if self._closing:
                return
            await self._sleep(self._until_due())

    def _until_due(self) -> float:
        if not self._roll.lines:
            return self.roll_s
        return max(0.0, self._roll.started + self.roll_s - time.time())

    async def _sleep(self, seconds: float) -> None:
        self._wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    async def _upload(self, sealed: Sealed) -> bool:
        try:
            data = await asyncio.to_thread(encode, sealed.lines)
            await self.bucket.put_bytes(sealed.key, data, content_type="application/gzip")
        except Exception as exc:
            M.ARCHIVE_FAILURES.inc()
            log.warning("archive upload failed, will retry",
                        extra={"key": sealed.key, "samples": len(sealed.lines), "error": str(exc)})
            return False
        M.ARCHIVE_UPLOADS.inc()
        M.ARCHIVED.inc(len(sealed.lines))
        self.uploaded_at, self.last_key = time.time(), sealed.key
        log.info("archived samples", extra={"key": sealed.key, "samples": len(sealed.lines)})
        return True

    async def close(self, task: asyncio.Task[None], timeout: float) -> None:
        """Seal the open roll and give uploads `timeout` seconds (one try each). Batches
        of rolls not uploaded stay unacknowledged: the next start archives them."""
        self._seal()
        self._closing = True
        self._wake.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except asyncio.TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        left = self.backlog
        if left:
            log.warning("archive not uploaded before shutdown; its batches stay pending for the next start",
                        extra={"samples": left})
        for sealed in self._sealed:
            for w in sealed.waiters:
                w.cancel()
