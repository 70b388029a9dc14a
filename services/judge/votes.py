"""Casting m concurrent votes and the partial-failure rule.

A vote is one call to the judge model; its whole raw answer is kept on the Vote (`text`)
next to the score read from it on the configured scale (`parse_score`). Calls that answered count toward the quorum
(`JudgeConfig.needed`, default a majority of m), whether or not their text parses;
calls that failed (down, timed out, 5xx/429 after retries, 4xx) do not. Below the
quorum the turn is NOT scored: `JudgeUnavailable` is raised, the consumer leaves the
entry unacknowledged, retries it later and dead-letters it after `max_deliveries`.
A judge that is down therefore never turns into a silent reward of 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from services.judge import metrics
from services.judge.backend import JudgeBackend
from services.judge.parsing import ScoreScale, parse_score, unanimous
from shared.errors import EngineUnavailable
from shared.schemas import Vote


class JudgeUnavailable(EngineUnavailable):
    """Fewer judge calls answered than the quorum needs; the turn is retried later."""


async def cast_votes(
    backend: JudgeBackend, messages: Sequence[dict[str, str]], m: int, needed: int, kind: str,
    scale: ScoreScale = "label",
) -> list[Vote]:
    """m concurrent calls -> m Votes (score None when unparsable or failed), or raise."""
    results = await asyncio.gather(*(backend.call(messages, kind) for _ in range(m)))
    votes: list[Vote] = []
    for r in results:
        if r.text is None:
            metrics.VOTES.labels(kind, "error").inc()
            votes.append(Vote(score=None, text="", latency_s=round(r.latency_s, 4), error=r.error))
            continue
        score = parse_score(r.text, scale)
        if score is None:
            metrics.VOTES.labels(kind, "unparsable").inc()
            metrics.PARSE_FAILURES.labels(kind).inc()
        else:
            metrics.VOTES.labels(kind, metrics.score_label(score)).inc()
        votes.append(Vote(score=score, text=r.text, latency_s=round(r.latency_s, 4)))
    answered = sum(r.text is not None for r in results)
    if answered < needed:
        errors = "; ".join(sorted({r.error for r in results if r.error}))
        raise JudgeUnavailable(
            f"{kind} judge: only {answered} of {m} calls answered (need {needed}): {errors}"
        )
    if not unanimous(v.score for v in votes):
        metrics.DISAGREEMENT.labels(kind).inc()
    return votes
