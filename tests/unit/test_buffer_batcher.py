"""The batcher's timing and settlement rules, with an in-process publish function."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from services.buffer.batcher import Batcher, BatcherStopped, Outcome
from shared.schemas import TrainBatch, TrainSample
from tests.support.waiting import eventually


def sample(i: int | str) -> TrainSample:
    return TrainSample(id=f"t{i}", session_id="s", tokens=[1, 2], response_length=1,
                       loss_mask=[1], reward=1.0)


class Sink:
    """Records published batches; can refuse (shed), report duplicates, or fail."""

    def __init__(self) -> None:
        self.batches: list[TrainBatch] = []
        self.shed = 0
        self.fail = 0
        self.already: set[str] = set()
        self.calls = 0
        self.published_at: list[float] = []  # time.monotonic() of each batch

    async def __call__(self, samples: list[TrainSample]) -> Outcome:
        self.calls += 1
        if self.fail:
            self.fail -= 1
            raise ConnectionError("redis away")
        if self.shed:
            self.shed -= 1
            return Outcome()
        dup = frozenset(s.id for s in samples if s.id in self.already)
        if dup:
            return Outcome(already_batched=dup)
        batch = TrainBatch(samples=samples)
        self.batches.append(batch)
        self.published_at.append(time.monotonic())
        self.already |= {s.id for s in samples}
        return Outcome(batch=batch)

    def ids(self) -> list[list[str]]:
        return [[s.id for s in b.samples] for b in self.batches]


@pytest.fixture
def sink() -> Sink:
    return Sink()


Make = Callable[..., Batcher]


@pytest.fixture
async def make(sink: Sink) -> AsyncIterator[Make]:
    """Start batchers publishing to `sink`; stop them at the end."""
    made: list[tuple[Batcher, asyncio.Task[None]]] = []

    def factory(size: int = 4, max_wait_s: float = 60.0) -> Batcher:
        b = Batcher(sink, size=size, max_wait_s=max_wait_s, retry_max_s=0.05)
        made.append((b, asyncio.create_task(b.run())))
        return b

    yield factory
    for b, task in made:
        b.stop()
        await asyncio.wait_for(task, 5)


async def test_full_batches_of_size_b(make: Make, sink: Sink) -> None:
    b = make(size=4)
    await asyncio.wait_for(asyncio.gather(*(b.add(sample(i)) for i in range(8))), 5)
    assert sink.ids() == [["t0", "t1", "t2", "t3"], ["t4", "t5", "t6", "t7"]]


async def test_partial_batch_after_max_wait(make: Make, sink: Sink) -> None:
    b = make(size=16, max_wait_s=0.3)
    started = time.monotonic()
    waiters = [asyncio.create_task(b.add(sample(i))) for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*waiters), 5)
    assert sink.ids() == [["t0", "t1", "t2"]]  # one batch, published when it was due
    assert 0.3 <= sink.published_at[0] - started < 2.0


async def test_same_id_twice_waits_for_one_batch(make: Make, sink: Sink) -> None:
    b = make(size=2)
    first = asyncio.create_task(b.add(sample(0)))
    await asyncio.sleep(0)  # the task's first step runs before this one resumes
    waiter = b.waiter("t0")
    assert waiter is not None
    second = asyncio.create_task(b.add(sample(0)))
    await asyncio.sleep(0)
    assert b.waiting == 1  # the copy joined the waiting sample: one of the two a batch needs
    await asyncio.wait_for(b.add(sample(1)), 5)
    assert await first is True and await second is False
    await waiter
    assert sink.ids() == [["t0", "t1"]]
    assert b.waiter("t0") is None


async def test_already_batched_samples_settle_and_the_rest_publish(make: Make, sink: Sink) -> None:
    sink.already = {"t1"}
    b = make(size=3)
    await asyncio.wait_for(asyncio.gather(*(b.add(sample(i)) for i in range(3))), 5)
    assert sink.ids() == [["t0", "t2"]]


async def test_shed_and_errors_are_retried_not_dropped(make: Make, sink: Sink) -> None:
    sink.shed, sink.fail = 2, 2
    b = make(size=2)
    await asyncio.wait_for(asyncio.gather(b.add(sample(0)), b.add(sample(1))), 5)
    assert sink.ids() == [["t0", "t1"]]
    assert sink.calls == 5


async def test_drain_publishes_partial_batches_at_once(make: Make, sink: Sink) -> None:
    b = make(size=16, max_wait_s=60)
    waiters = [asyncio.create_task(b.add(sample(i))) for i in range(5)]
    await eventually(lambda: b.waiting == 5, 5, "five samples waiting")
    drained_at = time.monotonic()
    b.drain()
    await asyncio.wait_for(asyncio.gather(*waiters), 5)
    assert sink.ids() == [[f"t{i}" for i in range(5)]]
    assert sink.published_at[0] >= drained_at  # not before the drain (and not after the 60 s wait)


async def test_stop_fails_unpublished_waiters(sink: Sink) -> None:
    b = Batcher(sink, size=16, max_wait_s=60)
    task = asyncio.create_task(b.run())
    waiter = asyncio.create_task(b.add(sample(0)))
    await eventually(lambda: b.waiting == 1, 5, "the sample waiting")
    b.stop()
    await asyncio.wait_for(task, 5)
    with pytest.raises(BatcherStopped):
        await waiter
    assert not sink.batches
    with pytest.raises(BatcherStopped):
        await b.add(sample(1))
