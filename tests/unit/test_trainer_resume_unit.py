"""Which versions a resume tries, in which order: pure, no bucket."""

from __future__ import annotations

from services.trainer.resume import resume_candidates
from shared.schemas import LatestPointer


def pointer(version: int) -> LatestPointer:
    return LatestPointer(version=version, manifest=f"policies/r/v{version:06d}/manifest.json")


def test_a_readable_latest_bounds_the_candidates() -> None:
    assert resume_candidates(pointer(5), False, [1, 3, 5, 7], None) == [5, 3, 1]  # 7: rolled back
    assert resume_candidates(pointer(4), False, [1, 2], None) == [4, 2, 1]  # 4 tried, refused: no manifest
    assert resume_candidates(pointer(5), False, [3, 5, 6], 6) == [6, 5, 3]  # an interrupted commit first


def test_an_unreadable_latest_leaves_every_committed_version() -> None:
    assert resume_candidates(None, True, [2, 9, 4], None) == [9, 4, 2]


def test_no_latest_only_an_interrupted_commit() -> None:
    assert resume_candidates(None, False, [1, 2], None) == []
    assert resume_candidates(None, False, [1, 2], 2) == [2]
