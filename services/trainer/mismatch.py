"""The train/inference mismatch alarm: a rolling window of the step-0 ratio's figures.

Each step reports, over the tokens of samples the engine drew from the very version the
trainer holds, Σ|log ρ| and how many fell outside the clip range (services/trainer/
offpolicy.py). `MismatchWatch` keeps the last `window` steps' sums, so the figure is over
enough tokens to mean something; past `threshold` (mean |log ρ|) it raises the alarm —
a log warning when it goes off and when it clears, the gauges, and the
`trainer-mismatch` hash `nextstate status` reads (docs/troubleshooting.md#the-trainer-and-the-engine-disagree).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass
class MismatchState:
    tokens: float
    abs_log_ratio: float
    outside_frac: float
    alarm: bool
    since: float | None

    def fields(self, threshold: float, window: int) -> dict[str, str]:
        """The `trainer-mismatch` hash."""
        return {"tokens": f"{self.tokens:.0f}", "abs_log_ratio": f"{self.abs_log_ratio:.6f}",
                "outside_frac": f"{self.outside_frac:.6f}", "alarm": "1" if self.alarm else "",
                "alarm_since": "" if self.since is None else f"{self.since:.3f}",
                "threshold": f"{threshold}", "window_steps": str(window), "updated_at": f"{time.time():.3f}"}


class MismatchWatch:
    """The last `window` steps' mismatch sums and the alarm they raise (`min_tokens` before
    any verdict: a few tokens say nothing)."""

    def __init__(self, threshold: float, window: int = 20, min_tokens: int = 256) -> None:
        self.threshold = threshold
        self.window = window
        self.min_tokens = min_tokens
        self.steps: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.since: float | None = None

    def observe(self, metrics: Mapping[str, float]) -> MismatchState | None:
        """Take one step's metrics (Trainer.step's); the window's state, or None when the
        step had no sample of the trainer's own version."""
        n = metrics.get("mismatch_tokens", 0.0)
        if n <= 0:
            return None
        self.steps.append((n, metrics["mismatch_abs_log_ratio"] * n, metrics["mismatch_outside_frac"] * n))
        tokens = sum(s[0] for s in self.steps)
        mean = sum(s[1] for s in self.steps) / tokens
        outside = sum(s[2] for s in self.steps) / tokens
        alarm = tokens >= self.min_tokens and mean > self.threshold
        if alarm and self.since is None:
            self.since = time.time()
        elif not alarm:
            self.since = None
        return MismatchState(tokens, mean, outside, alarm, self.since)
