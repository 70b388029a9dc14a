"""Group samples into batches of B, or fewer once the oldest has waited `max_wait_s`.

`await batcher.add(sample)` returns only once a batch holding that sample is published,
so the consumer acknowledges a `scored` entry only after its sample is safely on
`batches`: a crash mid-batch loses nothing (the entries are redelivered). The same
sample id added twice (a redelivery racing the original) waits on the same batch.

Publishing goes through an injected coroutine (`ledger.Ledger.publish_batch` in the
service) that reports one of three outcomes: published; some samples were already in
an earlier batch (they are settled, the rest retried at once); or the stream was full
(retried with backoff — backpressure: handlers keep waiting, so the consumer stops
reading). Errors are retried the same way; nothing is dropped.

`drain()` (shutdown) publishes partial batches without waiting; `stop()` ends the loop
and fails whatever is still unpublished, so those entries stay unacknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from services.buffer import metrics as M
from shared.schemas import TrainBatch, TrainSample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """What one publish attempt did: a batch, or the ids already batched, or neither (shed)."""

    batch: TrainBatch | None = None
    already_batched: frozenset[str] = frozenset()


Publish = Callable[[list[TrainSample]], Awaitable[Outcome]]


class BatcherStopped(Exception):
    """The batcher stopped before this sample's batch was published."""


@dataclass
class _Slot:
    sample: TrainSample
    future: asyncio.Future[None]
    added: float = field(default_factory=time.monotonic)


class Batcher:
    def __init__(
        self,
        publish: Publish,
        *,
        size: int,
        max_wait_s: float,
        retry_max_s: float = 5.0,
    ) -> None:
        self._publish = publish
        self.size = size
        self.max_wait_s = max_wait_s
        self.retry_max_s = retry_max_s
        self._queue: list[_Slot] = []  # waiting for a batch, oldest first
        self._by_id: dict[str, _Slot] = {}  # waiting or being published
        self._changed = asyncio.Event()
        self._draining = False
        self._stopped = asyncio.Event()

    # -- producers ------------------------------------------------------------------
    async def add(self, sample: TrainSample) -> bool:
        """Wait until `sample` is in a published batch. False: its id was already waiting."""
        if self._stopped.is_set():
            raise BatcherStopped("the batcher is stopped")
        slot = self._by_id.get(sample.id)
        fresh = slot is None
        if slot is None:
            slot = _Slot(sample, asyncio.get_running_loop().create_future())
            self._by_id[sample.id] = slot
            self._queue.append(slot)
            M.PENDING.inc()
            self._changed.set()
        await asyncio.shield(slot.future)
        return fresh

    def waiter(self, sample_id: str) -> Awaitable[None] | None:
        """If `sample_id` waits for a batch here, an awaitable that ends when it is published."""
        slot = self._by_id.get(sample_id)
        return None if slot is None else asyncio.shield(slot.future)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    # -- lifecycle -------------------------------------------------------------------------
    def drain(self) -> None:
        """From now on publish whatever waits at once (shutdown: finish in-flight work)."""
        self._draining = True
        self._changed.set()

    def stop(self) -> None:
        self._stopped.set()
        self._changed.set()

    async def run(self) -> None:
        try:
            while not self._stopped.is_set():
                take = self._ready()
                if take:
                    await self._publish_until_done(take)
                    continue
                self._changed.clear()
                timeout = None
                if self._queue:
                    timeout = max(0.0, self._queue[0].added + self.max_wait_s - time.monotonic())
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout)
        finally:
            self._fail_all()

    def _ready(self) -> list[_Slot]:
        if not self._queue:
            return []
        full = len(self._queue) >= self.size
        due = time.monotonic() - self._queue[0].added >= self.max_wait_s
        if not (full or due or self._draining):
            return []
        take, self._queue = self._queue[: self.size], self._queue[self.size :]
        return take

    async def _publish_until_done(self, slots: list[_Slot]) -> None:
        delay = 0.05
        while slots and not self._stopped.is_set():
            try:
                outcome = await self._publish([s.sample for s in slots])
            except Exception as exc:  # Redis down, script error: retry, never drop
                log.warning("batch publish failed, retrying",
                            extra={"samples": len(slots), "retry_in_s": delay, "error": str(exc)})
                outcome = None
            if outcome is not None and outcome.already_batched:
                done = [s for s in slots if s.sample.id in outcome.already_batched]
                M.DUPLICATES.inc(len(done))
                self._settle(done)
                slots = [s for s in slots if s.sample.id not in outcome.already_batched]
                continue
            if outcome is not None and outcome.batch is not None:
                M.BATCHES.inc()
                M.BATCH_SIZE.observe(len(slots))
                M.BATCH_WAIT.observe(time.monotonic() - min(s.added for s in slots))
                log.info("batch published", extra={"batch_id": outcome.batch.id, "samples": len(slots)})
                self._settle(slots)
                return
            M.PUBLISH_RETRIES.inc()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), delay)
            delay = min(delay * 2, self.retry_max_s)
        if slots:  # stopped while retrying: back in the queue, failed by run()'s finally
            self._queue[:0] = slots

    def _settle(self, slots: list[_Slot]) -> None:
        for s in slots:
            self._by_id.pop(s.sample.id, None)
            M.PENDING.dec()
            if not s.future.done():
                s.future.set_result(None)

    def _fail_all(self) -> None:
        for s in self._queue:
            self._by_id.pop(s.sample.id, None)
            M.PENDING.dec()
            if not s.future.done():
                s.future.set_exception(BatcherStopped("stopped before the batch was published"))
                s.future.exception()  # retrieved here: a waiter may already be gone
        self._queue = []
