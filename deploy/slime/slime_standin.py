"""A minimal stand-in for slime's `Sample` and `RolloutFnTrainOutput`, for use without slime.

Inside a slime job `nextstate_rollout` imports the real classes (`slime.utils.types`,
`slime.rollout.base_types`). Where slime is not installed (this repo's tests and CI)
it falls back to these: the same names, the fields the conversion sets with slime's
names and defaults, and the same `Status` values, so the conversion runs unchanged.
This is not slime: it has none of its methods or its other fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class Sample:
    """The subset of slime's `Sample` that a rollout for training fills in."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    teacher_log_probs: list[float] | None = None
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    session_id: str | None = None


@dataclass
class RolloutFnTrainOutput:
    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None
