"""An episode turn's reward from its Outcome, against hand-computed values (no Redis).

rewards.py: the group statistics, each advantage mode and outcome+prm; episodes.py: the
plan a session gets from its outcome and its group (missing, failed, partial, too small).
"""

from __future__ import annotations

import math

import pytest

from services.buffer.episode_store import Group, GroupEntry, HeldOutcome
from services.buffer.episodes import (
    EPISODE_FAILED,
    GROUP_TOO_SMALL,
    OUTCOME_MISSING,
    Plan,
    Wait,
    group_plan,
    group_settlement,
    outcome_plan,
)
from services.buffer.rewards import GroupStats, advantage, group_stats, settle, turn_reward

EPS = 1e-6


def test_group_statistics_mean_and_bessel_corrected_std() -> None:
    # [1, -1, 1, 1]: mean 0.5; squared deviations 0.25 + 2.25 + 0.25 + 0.25 = 3; 3 / (4 - 1) = 1.
    s = group_stats([1.0, -1.0, 1.0, 1.0])
    assert (s.mean, s.std, s.n, s.partial) == (0.5, 1.0, 4, False)
    # [1, 0, 0, -1]: mean 0; (1 + 0 + 0 + 1) / 3 = 2/3.
    s = group_stats([1.0, 0.0, 0.0, -1.0])
    assert s.mean == 0.0 and s.std == pytest.approx(math.sqrt(2 / 3))
    with pytest.raises(ValueError, match="at least 2"):
        group_stats([1.0])


def test_raw_is_the_outcome_reward() -> None:
    assert advantage(1.0, "raw", None, EPS) == 1.0
    assert advantage(-0.25, "raw", None, EPS) == -0.25


def test_group_mean() -> None:
    stats = group_stats([1.0, -1.0, 1.0, 1.0])  # mean 0.5
    assert advantage(1.0, "group_mean", stats, EPS) == 0.5
    assert advantage(-1.0, "group_mean", stats, EPS) == -1.5


def test_group_norm() -> None:
    stats = group_stats([1.0, 0.0, 0.0, -1.0])  # mean 0, std sqrt(2/3)
    assert advantage(1.0, "group_norm", stats, EPS) == pytest.approx(math.sqrt(3 / 2), rel=1e-5)
    assert advantage(-1.0, "group_norm", stats, EPS) == pytest.approx(-math.sqrt(3 / 2), rel=1e-5)
    assert advantage(0.0, "group_norm", stats, EPS) == 0.0
    same = group_stats([1.0, 1.0, 1.0])  # std 0: eps keeps it finite, and R - mean is 0
    assert advantage(1.0, "group_norm", same, EPS) == 0.0
    with pytest.raises(ValueError, match="statistics"):
        advantage(1.0, "group_norm", None, EPS)


def test_outcome_ignores_the_judge_and_outcome_plus_prm_adds_it() -> None:
    assert [turn_reward(0.5, s, "outcome", 0.5) for s in (1, 0, -1)] == [0.5, 0.5, 0.5]
    # A = 0.5 (group_mean of R = 1 in [1, -1, 1, 1]), w = 0.5: 0.5 + 0.5 * s.
    a = advantage(1.0, "group_mean", group_stats([1.0, -1.0, 1.0, 1.0]), EPS)
    assert [turn_reward(a, s, "outcome+prm", 0.5) for s in (1, 0, -1)] == [1.0, 0.5, 0.0]
    assert turn_reward(-1.0, 1, "outcome+prm", 0.2) == pytest.approx(-0.8)


def outcome(reward: float = 1.0, error: str | None = None, size: int = 4) -> HeldOutcome:
    return HeldOutcome(reward=reward, error=error, group="g", group_index=0, group_size=size)


def group(*rewards: float | None, first: float = 100.0) -> Group:
    """Entries by index; None is a failed episode."""
    entries = {i: GroupEntry(f"s{i}", r or 0.0, r is None) for i, r in enumerate(rewards)}
    return Group(entries, first, False, None)


def test_missing_or_failed_outcome_drops_raw_rewards_at_once() -> None:
    assert outcome_plan(None, "raw") == Plan(drop=OUTCOME_MISSING)
    assert outcome_plan(None, "group_norm") == Plan(drop=OUTCOME_MISSING)
    assert outcome_plan(outcome(error="policy unreachable"), "group_mean") == Plan(drop=EPISODE_FAILED)
    assert outcome_plan(outcome(-1.0), "raw") == Plan(term=-1.0)
    assert outcome_plan(outcome(), "group_mean") is None  # needs its group


def test_a_group_waits_for_all_its_outcomes_until_its_deadline() -> None:
    three = group(1.0, -1.0, 1.0)  # of 4, first outcome at t = 100, wait 60
    assert group_settlement(three, 4, now=150.0, wait_s=60.0) == Wait(160.0)
    complete = group_settlement(group(1.0, -1.0, 1.0, 1.0), 4, now=101.0, wait_s=60.0)
    assert complete == GroupStats(mean=0.5, std=1.0, n=4, partial=False)


def test_a_partial_group_uses_the_outcomes_that_came() -> None:
    partial = group_settlement(group(1.0, -1.0, 1.0), 4, now=160.0, wait_s=60.0)
    assert isinstance(partial, GroupStats)
    # [1, -1, 1]: mean 1/3; (4/9 + 16/9 + 4/9) / 2 = 4/3.
    assert partial.partial and partial.n == 3
    assert partial.mean == pytest.approx(1 / 3) and partial.std == pytest.approx(math.sqrt(4 / 3))
    assert group_plan(1.0, partial, "group_mean", EPS) == Plan(term=pytest.approx(2 / 3))


def test_failed_episodes_count_as_arrived_but_not_in_the_statistics() -> None:
    stats = group_settlement(group(1.0, None, -1.0, None), 4, now=101.0, wait_s=60.0)
    assert stats == GroupStats(mean=0.0, std=math.sqrt(2), n=2, partial=False)
    assert group_plan(1.0, stats, "group_norm", EPS).term == pytest.approx(1 / math.sqrt(2), rel=1e-5)


def test_fewer_than_two_successful_outcomes_drop_the_group() -> None:
    assert group_settlement(group(1.0), 4, now=160.0, wait_s=60.0) is None  # partial, 1 came
    assert group_settlement(group(1.0, None), 2, now=101.0, wait_s=60.0) is None  # one succeeded
    assert settle([0.5]) is None
    assert group_plan(1.0, None, "group_mean", EPS) == Plan(drop=GROUP_TOO_SMALL)
