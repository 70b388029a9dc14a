"""Paired tests of "is the candidate worse than the best on the same tasks?". Pure, no I/O.

The gate compares a candidate with the best version on the held-out tasks both were
scored on (matched by task id), so the tasks' own difficulty cancels out and only the
changes between the two versions count. The null hypothesis is "not worse"; the gate
refuses only when it is rejected at `alpha` (one-sided), and promotes otherwise.

- **Pass/fail tasks** (every paired task has `passed`): McNemar's exact test. Only the
  discordant tasks carry information: `b` that the best passes and the candidate fails,
  `c` the other way round. Under "no worse" a discordant task goes either way with
  probability 1/2, so p = P(Binomial(b + c, 1/2) >= b). Exact at any n (no normal
  approximation, no resampling noise), which matters at the n an evaluation can afford.
- **Graded scores** (ratings in [0, 1], anything without `passed`): a paired bootstrap
  over tasks. d_i = candidate_i - best_i; the d_i are resampled with replacement around
  their mean shifted to 0 (the null's boundary), and p is the share of resampled means at
  or below the observed one. No assumption on the ratings' distribution (bounded,
  discrete, skewed: a t-test's normality is a poor fit at small n); McNemar does not apply
  without pass/fail. Seeded, so the same results always give the same decision.

`effect` is the candidate's mean minus the best's on the paired tasks (negative: worse).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Test = Literal["mcnemar_exact", "paired_bootstrap"]

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class Comparison:
    """One paired test of a candidate against the best."""

    test: Test
    n: int  # paired tasks
    p_value: float  # of "the candidate is not worse"
    effect: float  # mean(candidate) - mean(best) on the paired tasks
    worse: int = 0  # McNemar: tasks the best passes and the candidate fails (b)
    better: int = 0  # McNemar: the other way round (c)

    def refuses(self, alpha: float) -> bool:
        return self.p_value < alpha


def mcnemar_exact(worse: int, better: int) -> float:
    """One-sided exact McNemar p-value: P(Binomial(worse + better, 1/2) >= worse)."""
    if worse < 0 or better < 0:
        raise ValueError(f"counts must be >= 0, got {worse}, {better}")
    m = worse + better
    if m == 0:
        return 1.0
    tail = math.fsum(math.comb(m, k) for k in range(worse, m + 1))
    return min(1.0, tail / 2.0**m)


def paired_bootstrap(diffs: list[float], resamples: int = BOOTSTRAP_RESAMPLES,
                     seed: int = BOOTSTRAP_SEED) -> float:
    """One-sided p-value of "mean(diffs) >= 0" by a bootstrap under the null (diffs shifted
    to mean 0): (1 + #{resampled mean <= observed mean}) / (1 + resamples)."""
    n = len(diffs)
    if n == 0:
        raise ValueError("a paired bootstrap needs at least one pair")
    observed = math.fsum(diffs) / n
    centred = [d - observed for d in diffs]
    rng = random.Random(seed)
    # A resampled mean at or below `observed` (with a hair of slack for float sums of
    # shifted values): at the null's boundary an exact tie counts as "as extreme".
    slack = 1e-12 * max(1.0, max(abs(d) for d in diffs))
    hits = sum(1 for _ in range(resamples)
               if math.fsum(rng.choices(centred, k=n)) / n <= observed + slack)
    return (1 + hits) / (1 + resamples)


def compare(best: Mapping[str, float], candidate: Mapping[str, float], binary: bool,
            resamples: int = BOOTSTRAP_RESAMPLES) -> Comparison | None:
    """The paired test of `candidate` against `best` (task id -> score) on their common
    tasks; None when they share none. `binary`: both are pass/fail (scores 0 or 1)."""
    common = sorted(set(best) & set(candidate))
    if not common:
        return None
    n = len(common)
    effect = math.fsum(candidate[t] - best[t] for t in common) / n
    if binary:
        worse = sum(1 for t in common if best[t] >= 0.5 > candidate[t])
        better = sum(1 for t in common if candidate[t] >= 0.5 > best[t])
        return Comparison("mcnemar_exact", n, mcnemar_exact(worse, better), effect, worse, better)
    diffs = [candidate[t] - best[t] for t in common]
    return Comparison("paired_bootstrap", n, paired_bootstrap(diffs, resamples), effect)
