"""The reward of an environment episode's turn from its Outcome: pure functions.

With R the episode's outcome reward, the group's outcome rewards R_1..R_n (failed
episodes excluded, n >= 2), mean = sum(R_i)/n and std = sqrt(sum((R_i - mean)^2)/(n - 1))
(Bessel's correction, as torch.std in GRPO implementations):

    advantage   raw         A = R
                group_mean  A = R - mean
                group_norm  A = (R - mean) / (std + eps)

    reward      outcome      A
                outcome+prm  A + w * s     (s the judge's score of this turn, -1/0/1)

The group statistics apply to the outcome term only; the judge's step-wise term is
added after them (the original system's step-wise mode).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.buffer.settings import GroupAdvantage, OutcomeMode

MIN_GROUP = 2  # the fewest successful outcomes a group statistic is taken over


@dataclass(frozen=True)
class GroupStats:
    """The statistics of one group's outcome rewards. `partial`: taken before all of
    the group's outcomes came (its wait ran out)."""

    mean: float
    std: float
    n: int
    partial: bool = False


def group_stats(rewards: Sequence[float], *, partial: bool = False) -> GroupStats:
    """Mean and Bessel-corrected std of `rewards` (at least MIN_GROUP of them)."""
    n = len(rewards)
    if n < MIN_GROUP:
        raise ValueError(f"a group statistic needs at least {MIN_GROUP} rewards, got {n}")
    mean = math.fsum(rewards) / n
    var = math.fsum((r - mean) ** 2 for r in rewards) / (n - 1)
    return GroupStats(mean=mean, std=math.sqrt(var), n=n, partial=partial)


def advantage(reward: float, how: GroupAdvantage, stats: GroupStats | None, eps: float) -> float:
    """The outcome term A of an episode whose outcome reward is `reward`."""
    if how == "raw":
        return reward
    if stats is None:
        raise ValueError(f"{how} needs the group's statistics")
    if how == "group_mean":
        return reward - stats.mean
    return (reward - stats.mean) / (stats.std + eps)


def turn_reward(outcome_term: float, judge_score: float, mode: OutcomeMode, prm_weight: float) -> float:
    """The sample reward of one turn of the episode."""
    if mode == "outcome":
        return outcome_term
    return outcome_term + prm_weight * judge_score


def settle(rewards: Sequence[float], *, partial: bool = False) -> GroupStats | None:
    """The statistics of a group's successful outcome rewards; None with fewer than
    MIN_GROUP of them (the group's turns are then dropped: nothing to compare with)."""
    return group_stats(rewards, partial=partial) if len(rewards) >= MIN_GROUP else None
