"""What every judge shares: the `Verdict` it returns, the `Judge` protocol, and the text a
model judge reads (`render_for_judge`). The built-in judges (services/judge/judges.py) and
the classifier judge (services/judge/classifier.py) both build on these, and `build_judge`
in judges.py builds the classifier one, so they live apart from both."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from services.judge.prompts import render_turn
from services.judge.settings import JudgeConfig
from shared.schemas import Turn, Vote


@dataclass
class Verdict:
    reward: float  # in [-1, 1]
    votes: list[Vote] = field(default_factory=list)
    judge: str = "prm"
    judge_model: str | None = None
    prompt_version: str | None = None


class Judge(Protocol):
    name: str

    async def judge(self, turn: Turn) -> Verdict: ...


def render_for_judge(turn: Turn, cfg: JudgeConfig) -> str:
    """The turn as a model judge reads it: the request, the response and the next state,
    each cut to its configured length."""
    return render_turn(
        turn.messages, turn.response, turn.next_state or [],
        max_response_chars=cfg.max_response_chars,
        max_next_state_chars=cfg.max_next_state_chars,
        max_context_chars=cfg.max_context_chars,
    )  # fmt: skip
