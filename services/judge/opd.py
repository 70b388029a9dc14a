"""OPD: a hint from hindsight, the teacher prompt it makes, and the teacher's log-probs.

1. m concurrent calls of the hint judge (prompt `hint-v1`): each answers `\\boxed{1}`
   with a 1–3 sentence hint between [HINT_START] and [HINT_END] when the next state
   holds a lesson for this response, else `\\boxed{-1}`. Same quorum rule as the PRM.
   (`HINT_SOURCE=rule`, no model: the next state itself, quoted, when the rule judge
   reads it as a correction; prompt version `hint-rule`.)
2. The accepted hint: among votes that said 1 and carry a non-trivial hint
   (>= min_hint_chars, with words; cut at max_hint_chars), the longest. None -> no
   teacher: the teacher fields stay None.
3. The hint is appended to the LAST user message of the turn's request, and the
   messages (and tools) are rendered with the POLICY's chat template: teacher_prompt_ids.
4. One token-in scoring call to the policy engine on teacher_prompt_ids + the turn's
   own response_ids from len(teacher_prompt_ids): one log-prob per response token,
   aligned with response_ids (A_t = teacher_lp_t − old_lp_t in the trainer). An engine
   that is down or times out fails the turn (retried, then dead-lettered); an engine
   that rejects the request (4xx, e.g. over its context length) leaves the teacher
   fields None, since retrying cannot help.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.judge import metrics
from services.judge.backend import JudgeBackend
from services.judge.judges import RuleJudge
from services.judge.parsing import HINT_END, HINT_START, accepted_hint, cut_words, extract_hint
from services.judge.prompts import HINT_PROMPTS, judge_messages, message_text, prompt_for
from services.judge.settings import JudgeConfig
from services.judge.verdict import render_for_judge
from services.judge.votes import cast_votes
from shared.errors import EngineNotSupported, EngineRejected
from shared.schemas import Turn, Vote

if TYPE_CHECKING:  # the engine client is imported only when OPD runs
    from shared.engine_client import EngineClient

log = logging.getLogger(__name__)

HINT_FORMAT = "\n\n[Hint] {hint}"


@dataclass
class OPDResult:
    votes: list[Vote] = field(default_factory=list)
    hint: str | None = None
    teacher_prompt_ids: list[int] | None = None
    teacher_logprobs: list[float] | None = None
    teacher_topk_ids: list[list[int]] | None = None  # NEXTSTATE_JUDGE__TOPK > 0
    teacher_topk_logprobs: list[list[float]] | None = None
    experience_ids: list[str] | None = None  # the experience teacher's records (experience.py)


def best_hint(votes: Sequence[Vote], min_chars: int, max_chars: int) -> str | None:
    """The longest acceptable hint among votes that said 1."""
    hints = [
        h for v in votes if v.score == 1
        if (h := accepted_hint(extract_hint(v.text), min_chars, max_chars)) is not None
    ]  # fmt: skip
    return max(hints, key=len) if hints else None


def with_hint(messages: Sequence[dict[str, Any]], hint: str) -> list[dict[str, Any]] | None:
    """A copy of `messages` with the hint added to the last user message (None: no user message)."""
    out = copy.deepcopy(list(messages))
    for message in reversed(out):
        if message.get("role") != "user":
            continue
        suffix = HINT_FORMAT.format(hint=hint)
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = [*content, {"type": "text", "text": suffix.lstrip("\n")}]
        else:
            message["content"] = (content or "") + suffix
        return out
    return None


@dataclass
class TeacherScore:
    """The teacher's view of a turn's own response under a teacher prompt."""

    prompt_ids: list[int]
    logprobs: list[float]
    topk_ids: list[list[int]] | None = None  # NEXTSTATE_JUDGE__TOPK > 0
    topk_logprobs: list[list[float]] | None = None


class Scorer:
    """Teacher log-probs of a turn's response ids under other messages: the messages (and
    tools) rendered with the policy's chat template, then one token-in scoring call to the
    policy engine (with the teacher's top-K when `topk`). `template` is a shared.chat.ChatTemplate."""

    def __init__(self, engine: EngineClient, template: Any, cfg: JudgeConfig) -> None:
        self.engine = engine
        self.template = template
        self.cfg = cfg
        # One thread: the tokenizer is used from one thread at a time, off the event loop.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="teacher-encode")

    def close(self) -> None:
        self._encoder.shutdown(wait=False, cancel_futures=True)

    async def score(self, turn: Turn, messages: list[dict[str, Any]]) -> TeacherScore | None:
        """None when the engine refuses the request (4xx: e.g. over its context length, or
        an engine that cannot score at this temperature): retrying cannot help. An engine
        that is down or times out raises (the turn is retried)."""
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        prompt_ids: list[int] = await loop.run_in_executor(
            self._encoder, self.template.encode, messages, turn.tools
        )
        ids, start, temperature = prompt_ids + list(turn.response_ids), len(prompt_ids), self.temperature(turn)
        topk_ids: list[list[int]] | None = None
        topk_logprobs: list[list[float]] | None = None
        try:
            if self.cfg.topk:
                logprobs, rows = await self.engine.score_topk(ids, start, self.cfg.topk, temperature=temperature)
                topk_ids = [[tid for tid, _ in row] for row in rows]
                topk_logprobs = [[min(lp, 0.0) for _, lp in row] for row in rows]
            else:
                logprobs = await self.engine.score(ids, start, temperature=temperature)
        except (EngineRejected, EngineNotSupported) as exc:
            metrics.HINTS.labels("teacher_rejected").inc()
            log.warning("teacher scoring rejected; no teacher log-probs for this turn",
                        extra={"turn_id": turn.id, "error": str(exc)})  # fmt: skip
            return None
        metrics.TEACHER_SECONDS.observe(time.perf_counter() - started)
        return TeacherScore(prompt_ids, logprobs, topk_ids, topk_logprobs)

    def temperature(self, turn: Turn) -> float:
        if self.cfg.teacher_temperature is not None:
            return self.cfg.teacher_temperature
        t = turn.sampling.temperature
        return t if t > 0 else 1.0


RULE_HINTS = "hint-rule"


class RuleHints:
    """HINT_SOURCE=rule: the next state itself is the hint when the rule judge reads it as a
    correction (no model needed: demos, tests); one vote, 1 with a hint, else -1."""

    def __init__(self, cfg: JudgeConfig) -> None:
        self.cfg = cfg
        self.rule = RuleJudge(cfg.positive, cfg.negative)

    def vote(self, turn: Turn) -> Vote:
        text = " ".join(" ".join(message_text(m).split()) for m in turn.next_state or [])
        score, why = self.rule.score(text)
        if score != -1:
            return Vote(score=-1, text=why)
        hint = cut_words(f'Your answer will get this reply: "{text}"', self.cfg.max_hint_chars)
        return Vote(score=1, text=f"{why}\n{HINT_START} {hint} {HINT_END}")


class Teacher:
    """Hint votes + teacher log-probs for one turn."""

    def __init__(self, backend: JudgeBackend | None, scorer: Scorer, cfg: JudgeConfig) -> None:
        self.backend = backend
        self.scorer = scorer
        self.cfg = cfg
        self.rule = RuleHints(cfg) if cfg.hint_source == "rule" else None
        self.prompt = prompt_for(cfg.hint_prompt_version, HINT_PROMPTS)
        if self.rule is None and backend is None:
            raise ValueError("llm hints need the judge model (NEXTSTATE_JUDGE__URL)")

    @property
    def prompt_version(self) -> str:
        return RULE_HINTS if self.rule is not None else self.prompt.version

    async def run(self, turn: Turn) -> OPDResult:
        if self.rule is not None:
            votes = [self.rule.vote(turn)]
        else:
            assert self.backend is not None
            messages = judge_messages(self.prompt, render_for_judge(turn, self.cfg))
            votes = await cast_votes(self.backend, messages, self.cfg.votes, self.cfg.needed, "hint")
        hint = best_hint(votes, self.cfg.min_hint_chars, self.cfg.max_hint_chars)
        if hint is None:
            metrics.HINTS.labels("none").inc()
            return OPDResult(votes=votes)
        teacher_messages = with_hint(turn.messages, hint)
        if teacher_messages is None or not turn.response_ids:
            metrics.HINTS.labels("no_user" if teacher_messages is None else "no_response_ids").inc()
            return OPDResult(votes=votes, hint=hint)
        metrics.HINTS.labels("accepted").inc()
        score = await self.scorer.score(turn, teacher_messages)
        if score is None:
            return OPDResult(votes=votes, hint=hint)
        return OPDResult(
            votes=votes, hint=hint, teacher_prompt_ids=score.prompt_ids, teacher_logprobs=score.logprobs,
            teacher_topk_ids=score.topk_ids, teacher_topk_logprobs=score.topk_logprobs,
        )  # fmt: skip
