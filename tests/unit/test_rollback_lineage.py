"""When the trainer rebases and onto what (services/trainer/rebase.py): pure, no I/O."""

from __future__ import annotations

from typing import Any, cast

import pytest

from services.trainer.follow import Follower
from services.trainer.rebase import Abandoned, LineageView, Rebase, decide, followed_at_start
from services.trainer.resume import ResumePoint, rebase_candidates
from shared.errors import MalformedMessage
from shared.lineage import RebaseRecord, parse_record
from shared.schemas import LatestPointer


def pointer(version: int, at: float) -> LatestPointer:
    return LatestPointer(version=version, manifest=f"policies/r/v{version:06d}/manifest.json", committed_at=at)


def record(base: int, at: float, by: str = "operator") -> RebaseRecord:
    return RebaseRecord.model_validate({"base": base, "at": at, "by": by})


# The trainer committed v3 at t=100 (its LATEST), nothing followed yet.
AT_V3 = LineageView(head=3, head_at=100.0)


def test_a_new_record_is_a_rebase_onto_its_base_whatever_latest_says() -> None:
    r = record(1, 150.0, "gate")
    assert decide(AT_V3, r, pointer(3, 100.0)) == Rebase(base=1, by="gate", record=r, at=150.0)
    assert decide(AT_V3, r, None) == Rebase(base=1, by="gate", record=r, at=150.0)  # LATEST unreadable
    # A record followed already is not a new one, even with LATEST still on the old lineage.
    followed = LineageView(head=1, head_at=150.0, followed=r)
    assert decide(followed, r, pointer(3, 100.0)) is None
    # A second rollback (another `at`) is new, even onto the same base.
    again = record(1, 300.0)
    assert decide(followed, again, pointer(1, 151.0)) == Rebase(base=1, by="operator", record=again, at=300.0)


def test_latest_moved_back_by_hand_after_the_last_commit_is_a_rebase() -> None:
    assert decide(AT_V3, None, pointer(1, 200.0)) == Rebase(base=1, by="latest", record=None, at=200.0)
    assert decide(AT_V3, None, pointer(3, 100.0)) is None  # the trainer's own commit
    assert decide(AT_V3, None, pointer(4, 200.0)) is None  # forward: not a rollback
    assert decide(AT_V3, None, pointer(1, 90.0)) is None  # older than the last commit: not new
    assert decide(AT_V3, None, None) is None


def test_the_pointer_that_carries_out_a_followed_record_is_not_a_second_rollback() -> None:
    r = record(1, 150.0)
    view = AT_V3.rebased(decide(AT_V3, r, None) or Rebase(0, "latest", None, 0), 1)
    assert (view.head, view.head_at, view.followed) == (1, 150.0, r)
    # `nextstate rollback` writes LATEST right after the record.
    assert decide(view, r, pointer(1, 150.5)) is None
    # ...even when the trainer committed v5 (parent 1) before that write landed.
    after_v5 = view.committed(5, 151.0)
    assert decide(after_v5, r, pointer(1, 152.0)) is None
    # A later hand-made rollback to v1 again is new: written before the record? no, after v5.
    other = record(1, 160.0)
    assert decide(after_v5, other, pointer(1, 161.0)) is not None
    # LATEST moved by hand to another version than the record's base is a rollback.
    assert decide(after_v5, r, pointer(2, 170.0)) == Rebase(base=2, by="latest", record=None, at=170.0)


def test_a_rebase_onto_a_lower_version_than_asked_is_not_undone_by_latest() -> None:
    r = record(2, 150.0)
    view = AT_V3.rebased(Rebase(2, "operator", r, 150.0), 1)  # v2 did not verify: on v1
    assert decide(view, r, pointer(2, 150.2)) is None  # LATEST (v2) is not below the head (v1)


def test_a_record_at_start_is_done_when_resumed_from_its_base_or_older_than_latest() -> None:
    r = record(1, 150.0)
    assert followed_at_start(None, 3, pointer(3, 100.0))
    assert followed_at_start(r, 1, pointer(1, 150.1))  # the rollback's own LATEST
    assert followed_at_start(r, 5, pointer(5, 400.0))  # v5 was trained on it since
    assert not followed_at_start(r, 3, pointer(3, 100.0))  # its LATEST write never happened
    assert not followed_at_start(r, 3, None)


def test_abandoned_versions_are_ranges_above_each_base() -> None:
    a = Abandoned(keep=2)
    a.add(3, 3)  # nothing above the resume point: nothing abandoned
    assert a.ranges == []
    a.add(1, 4)  # rolled back from v4 (v4 uploading) to v1
    assert [v in a for v in range(7)] == [False, False, True, True, True, False, False]
    a.add(5, 6)  # later, from v6 to v5: v2..v4 stay abandoned, v5 is the new base
    assert 6 in a and 5 not in a and 3 in a
    a.add(7, 9)  # only the newest `keep` ranges are kept
    assert 3 not in a and 6 in a and 8 in a and "3" not in a


def test_rebase_candidates_start_at_the_asked_version() -> None:
    assert rebase_candidates(3, [1, 2, 3, 5, 7]) == [3, 2, 1]
    assert rebase_candidates(4, [1, 2, 5]) == [4, 2, 1]  # 4 tried (refused without a manifest)


def test_the_record_parses_strictly_enough() -> None:
    assert parse_record('{"base": 2, "at": 1.5, "by": "gate"}') == record(2, 1.5, "gate")
    assert parse_record(None) is None
    for bad in ("not json", '{"base": -1, "at": 1, "by": "operator"}', '{"base": 2, "at": 1, "by": "someone"}'):
        with pytest.raises(MalformedMessage, match="rebase record"):
            parse_record(bad)


def test_what_the_follower_counts_abandoned() -> None:
    # Resumed from v2 (v3's trainer state did not verify) while LATEST serves v3; v4 half-uploaded.
    resume = ResumePoint(version=2, step=2, next_version=5, consumed=[], latest=pointer(3, 100.0))
    f = Follower(cast(Any, None), cast(Any, None), "r", resume, None, on_decided=lambda: None)
    assert [v in f.abandoned for v in range(6)] == [False, False, False, False, True, False]
    assert (f.view.head, f.view.head_at) == (2, 100.0)
    # A rebase asked onto v3 that could only load v1: v3 is served, so its samples still train.
    r = record(3, 200.0)
    f.decided(Rebase(base=3, by="operator", record=r, at=200.0))
    assert f.pending is not None and f.epoch == 1
    f.rebased(f.pending, 1, 6)
    assert f.pending is None and (f.view.head, f.view.followed) == (1, r)
    assert [v in f.abandoned for v in range(8)] == [False, False, False, False, True, True, True, False]
