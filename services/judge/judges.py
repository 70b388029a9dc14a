"""Pluggable judges: a turn (with its next state) in, a `Verdict` out (the `Verdict`, the
`Judge` protocol and `render_for_judge` are in services/judge/verdict.py).

- `prm`: the LLM judge; m concurrent votes under a versioned prompt, aggregated by
  `NEXTSTATE_JUDGE__SCORES` (labels: the vote threshold, default a strict majority;
  graded / probability scores: their mean; services/judge/parsing.py).
- `rule`: keyword / regex cues in the next state's text. Only positive cues -> 1, only
  negative -> -1, both or none -> 0. Free and instant: for demos, tests, and as a filter.
- `rule+prm`: the rule first; when it is decisive (1 or -1) its verdict stands and no
  LLM call is made; when it is not (0: no cue, or cues both ways) the PRM decides.
  ScoredTurn.judge names the one that decided ("rule" or "prm").
- `classifier`: a sequence-classification reward model in this process, batched
  (services/judge/classifier.py); reward 2p - 1, p the positive class's probability.
- `module:callable`: a user plugin, sync or async, called with the `Turn`; returns a
  score (an int in {-1, 0, 1} or a float in [-1, 1]) or `(score, text)`. A sync plugin runs in a worker thread so it cannot
  stall the other turns in flight. A plugin that raises or returns anything else fails
  the turn (retried, then dead-lettered), never silently scores it.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import re
from collections.abc import Callable
from typing import Any

from services.judge.backend import JudgeBackend
from services.judge.classifier import ClassifierJudge
from services.judge.parsing import Score, aggregate
from services.judge.prompts import PRM_PROMPTS, judge_messages, message_text, prompt_for
from services.judge.settings import JudgeConfig
from services.judge.verdict import Judge, Verdict, render_for_judge
from services.judge.votes import cast_votes
from shared.errors import NextstateError, SettingsError
from shared.schemas import Turn, Vote


class PluginError(NextstateError):
    """A judge plugin failed or returned something other than a score in [-1, 1] or (score, text)."""


class PRMJudge:
    name = "prm"

    def __init__(self, backend: JudgeBackend, cfg: JudgeConfig) -> None:
        self.backend = backend
        self.cfg = cfg
        self.prompt = prompt_for(cfg.prompt_version, PRM_PROMPTS)

    async def judge(self, turn: Turn) -> Verdict:
        messages = judge_messages(self.prompt, render_for_judge(turn, self.cfg))
        cfg = self.cfg
        votes = await cast_votes(self.backend, messages, cfg.votes, cfg.needed, "prm", cfg.scores)
        return Verdict(
            reward=aggregate([v.score for v in votes], cfg.scores, cfg.vote_threshold),
            votes=votes,
            judge=self.name,
            judge_model=self.cfg.model,
            prompt_version=self.prompt.version,
        )


class RuleJudge:
    name = "rule"

    def __init__(self, positive: list[str], negative: list[str]) -> None:
        self.positive = [re.compile(p, re.IGNORECASE) for p in positive]
        self.negative = [re.compile(p, re.IGNORECASE) for p in negative]

    def score(self, text: str) -> tuple[Score, str]:
        pos = [m.group(0) for p in self.positive if (m := p.search(text))]
        neg = [m.group(0) for p in self.negative if (m := p.search(text))]
        reward: Score = 1 if pos and not neg else -1 if neg and not pos else 0
        return reward, f"rule: positive {pos} negative {neg}"

    async def judge(self, turn: Turn) -> Verdict:
        text = "\n".join(message_text(m) for m in turn.next_state or [])
        reward, why = self.score(text)
        return Verdict(reward=reward, votes=[Vote(score=reward, text=why)], judge=self.name)


class RuleThenPRM:
    name = "rule+prm"

    def __init__(self, rule: RuleJudge, prm: PRMJudge) -> None:
        self.rule = rule
        self.prm = prm

    async def judge(self, turn: Turn) -> Verdict:
        verdict = await self.rule.judge(turn)
        if verdict.reward != 0:
            return verdict
        return await self.prm.judge(turn)


PluginFn = Callable[[Turn], Any]


def load_plugin(spec: str) -> PluginFn:
    """`package.module:callable` (the callable may be dotted: `module:Class.method`)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise SettingsError(f"judge plugin {spec!r}: expected module:callable")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise SettingsError(
            f"judge plugin {spec!r}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?"
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SettingsError(f"judge plugin {spec!r}: {module_name!r} has no {attr!r}") from None
    if not callable(obj):
        raise SettingsError(f"judge plugin {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    fn: PluginFn = obj
    return fn


def plugin_result(spec: str, value: Any) -> tuple[float, str]:
    """Validate what a plugin returned: a score (int in {-1, 0, 1}, float in [-1, 1]) or (score, text)."""
    text = ""
    if isinstance(value, tuple):
        if len(value) != 2 or not isinstance(value[1], str):
            raise PluginError(f"judge plugin {spec!r} returned {value!r}: expected score or (score, text)")
        value, text = value
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not -1 <= value <= 1
    ):
        raise PluginError(
            f"judge plugin {spec!r} returned {value!r}: the score must be a number in [-1, 1]"
        )
    return float(value), text


class PluginJudge:
    def __init__(self, spec: str, fn: PluginFn | None = None) -> None:
        self.name = spec
        self.fn = fn if fn is not None else load_plugin(spec)
        self.is_async = inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(
            getattr(self.fn, "__call__", None)  # noqa: B004 (async __call__ objects)
        )

    async def judge(self, turn: Turn) -> Verdict:
        try:
            if self.is_async:
                value = await self.fn(turn)
            else:
                value = await asyncio.to_thread(self.fn, turn)
                if inspect.isawaitable(value):
                    value = await value
        except PluginError:
            raise
        except Exception as exc:
            raise PluginError(f"judge plugin {self.name!r} raised {type(exc).__name__}: {exc}") from exc
        score, text = plugin_result(self.name, value)
        return Verdict(reward=score, votes=[Vote(score=score, text=text)], judge=self.name)


def build_judge(cfg: JudgeConfig, backend: JudgeBackend | None) -> Judge:
    """The judge named by `cfg.type` (`backend` is required for prm and rule+prm)."""
    if cfg.type == "rule":
        return RuleJudge(cfg.positive, cfg.negative)
    if cfg.type == "classifier":
        return ClassifierJudge(cfg)  # torch and transformers: imported only as it loads its model
    if cfg.type in ("prm", "rule+prm"):
        if backend is None:
            raise SettingsError(f"judge type {cfg.type} needs a judge backend (NEXTSTATE_JUDGE__URL)")
        prm = PRMJudge(backend, cfg)
        return prm if cfg.type == "prm" else RuleThenPRM(RuleJudge(cfg.positive, cfg.negative), prm)
    return PluginJudge(cfg.type)
