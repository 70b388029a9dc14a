"""95% confidence intervals for suite scores: Wilson for pass rates, Student's t for means.

Pure functions, no I/O. Wilson's interval stays inside [0, 1] and is not degenerate at
0/n or n/n, where the normal approximation claims certainty. The t interval of a mean
uses the exact 0.975 quantile for up to 30 degrees of freedom (a table) and the
Cornish-Fisher expansion beyond (Abramowitz & Stegun 26.7.5, error < 1e-4 there), so
no scipy is needed; it needs at least two values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z975 = 1.959963984540054  # the standard normal's 0.975 quantile

# Student's t 0.975 quantiles for 1..30 degrees of freedom.
_T975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)  # fmt: skip


def wilson(successes: int, n: int, z: float = Z975) -> tuple[float, float]:
    """Wilson score interval of a pass rate `successes / n` (n >= 1)."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got {successes}/{n}")
    p = successes / n
    z2 = z * z
    denom = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact at the ends, where
    high = 1.0 if successes == n else min(1.0, centre + half)  # rounding would leave 1e-17
    return low, high


def t975(df: int) -> float:
    """Student's t 0.975 quantile with `df` >= 1 degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = Z975
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("the mean of no values")
    return math.fsum(values) / len(values)


def mean_ci(values: Sequence[float]) -> tuple[float, float] | None:
    """The 95% t interval of the mean of `values`; None for fewer than two values."""
    n = len(values)
    if n < 2:
        return None
    m = mean(values)
    sd = math.sqrt(math.fsum((v - m) ** 2 for v in values) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return m - half, m + half


def clip(interval: tuple[float, float] | None, low: float, high: float) -> tuple[float, float] | None:
    """`interval` cut to [low, high] (a mean of values in that range lies in it too)."""
    if interval is None:
        return None
    return max(low, interval[0]), min(high, interval[1])
