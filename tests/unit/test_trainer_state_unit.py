"""The resume state's cadence, which one a trainer resumes from, what retention keeps, and
the lane's bookkeeping (services/trainer/trainer_state.py): pure, no bucket."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest

from services.trainer.trainer_state import (
    Cadence,
    ResumeLane,
    ResumeState,
    ancestors_of,
    needed_resume_states,
    resume_order,
)


# -- cadence ------------------------------------------------------------------------------------------
def test_due_every_k_versions() -> None:
    c = Cadence(every=3, every_s=1e9, last_at=0.0)
    dues = []
    for _ in range(7):
        c.made()
        dues.append(c.due(now=1.0))
        if dues[-1]:
            c.taken(now=1.0)
    assert dues == [False, False, True, False, False, True, False]


def test_due_after_t_seconds_but_only_once_a_version_was_made() -> None:
    c = Cadence(every=10, every_s=600.0, last_at=0.0)
    assert not c.due(now=10_000.0) and c.wait(now=10_000.0) is None  # nothing new to save
    c.made()
    assert not c.due(now=599.0) and c.wait(now=599.0) == pytest.approx(1.0)
    assert c.due(now=600.0) and c.wait(now=600.0) == 0.0
    c.taken(now=600.0)
    c.made()
    assert not c.due(now=700.0)
    c.versions = 10  # the count comes first, whatever the clock
    assert c.due(now=700.0)


def test_a_state_not_written_is_due_again_after_the_retry_delay() -> None:
    c = Cadence(every=10, every_s=600.0, retry_s=30.0, last_at=0.0)
    c.made()
    c.taken(now=100.0)  # taken with v1 at t=100 …
    c.missed(now=110.0)  # … and its upload failed at t=110
    assert c.versions == 1  # v1's optimizer state is still unsaved
    assert not c.due(now=120.0) and c.wait(now=120.0) == pytest.approx(20.0)
    assert c.due(now=140.0)
    c.restart(now=200.0)  # a rebase: the optimizer is what was loaded
    assert c.wait(now=10_000.0) is None


# -- which resume state -------------------------------------------------------------------------------
def test_resume_order_is_the_lineage_newest_first_never_above_or_aside() -> None:
    # v5 was trained from v4, v2, v1 (v3 belongs to a lineage a rollback to v2 abandoned).
    have = {1, 3, 4, 6}
    assert resume_order(5, [1, 2, 4], have) == [4, 1]
    assert resume_order(4, [1, 2], have) == [4, 1]  # its own first
    assert resume_order(2, [1], have) == [1]
    assert resume_order(2, [], have) == []  # none in its lineage: a fresh optimizer
    assert resume_order(3, [1, 2, 7], have) == [3, 1]  # a bogus ancestor above it is ignored


def test_ancestors_of_a_record_and_of_an_older_one() -> None:
    assert ancestors_of({"step": 3, "parent": 4, "ancestors": [1, 2, 4]}) == [1, 2, 4]
    assert ancestors_of({"step": 3, "parent": 4}) == [4]  # written before ancestors were recorded
    assert ancestors_of({"step": 1, "parent": 0, "ancestors": []}) == []
    assert ancestors_of(None, parent=7) == [7]  # no record: the manifest's parent
    assert ancestors_of(None, parent=0) == [] and ancestors_of(None) == []


def test_retention_keeps_the_resume_state_each_kept_version_needs() -> None:
    have = {10, 20, 23}
    lineage = list(range(1, 30))
    kept = {21: lineage[:20], 22: lineage[:21], 24: lineage[:23]}  # 24 descends from 23
    assert needed_resume_states(kept, have) == {20, 23}
    # A version without a readable record keeps the newest at or below it.
    assert needed_resume_states({22: None}, have) == {20}
    assert needed_resume_states({5: [1, 2, 3, 4]}, have) == set()


# -- the lane -------------------------------------------------------------------------------------------
def lane(committed: int = 0, every: int = 1) -> ResumeLane:
    return ResumeLane(cast(Any, None), "run", Path("/nonexistent"), Cadence(every, 1e9), committed)


def state(version: int, epoch: int = 0) -> ResumeState:
    return ResumeState(version=version, step=version, tensors={}, epoch=epoch)


def queued(lane: ResumeLane) -> list[int | None]:
    out = []
    while not lane.queue.empty():
        s = lane.queue.get_nowait()
        out.append(None if s is None else s.version)
    return out


def test_a_state_is_written_only_once_its_version_is_committed() -> None:
    async def main() -> None:
        ln = lane(committed=2)
        ln.cadence.made()
        assert ln.due()
        ln.hold(state(3))
        assert ln.busy and not ln.due() and queued(ln) == []  # v3 still uploading
        ln.cadence.made()
        assert not ln.due()  # one copy at a time: v4's is skipped …
        assert ln.due(final=True)  # … except at a clean stop
        ln.committed(3, 0)
        assert queued(ln) == [3] and ln.busy  # being written
        ln.writing -= 1
        ln._settle()
        assert not ln.busy and ln.due()  # the next version takes one
        ln.hold(state(2))  # taken for a version already committed: released at once
        assert queued(ln) == [2]

    asyncio.run(main())


def test_a_rebase_drops_what_the_abandoned_lineage_held() -> None:
    async def main() -> None:
        ln = lane(committed=3)
        ln.hold(state(4, epoch=0))
        ln.abandoned()
        assert not ln.busy
        await asyncio.wait_for(ln.idle(), 1)
        ln.rebased(1, epoch=1)
        ln.hold(state(5, epoch=0))  # an old epoch's: never released by the new lineage's commits
        ln.committed(5, 1)
        assert queued(ln) == []
        ln.hold(state(6, epoch=1))
        ln.committed(6, 1)
        assert queued(ln) == [6]
        ln.close()  # the stop: what is still held is dropped, the writer ends
        assert queued(ln) == [None] and ln.held == []

    asyncio.run(main())
