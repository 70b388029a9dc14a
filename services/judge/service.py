"""The judge worker: `turns` in (consumer group `judge`), `ScoredTurn`s out to `scored`.

Per turn:
- side turn (`turn_type == "side"`): acknowledged, nothing published.
- no next state (None or empty: the session ended, the turn expired): a ScoredTurn with
  `judged=False`, reward 0, no calls — the buffer's at-least-one rule needs to see it.
- otherwise, by `mode`: `rl` runs the configured judge (reward); `opd` runs the hint
  judge and the teacher scoring (reward 0); `combine` runs both concurrently. Reward
  votes go to `votes`, hint votes to `hint_votes`; in combine `prompt_version` names
  both ("prm-v1+hint-v1").

With NEXTSTATE_JUDGE__TEACHER=experience (experiential learning) a turn first goes
through replay.py: held until its session's experience exists (published later, by a
Replay), or an ending (its session's lessons extracted and stored) — see there.

The ScoredTurn's id is the turn's id, so a redelivered turn that is judged twice is
deduplicated downstream. Each published turn's reward goes into the reward-collapse window that every replica
shares (collapse.py). Any failure (quorum not met, plugin error, engine down)
raises: the entry stays pending, is retried with backoff and dead-lettered after
`streams.max_deliveries`. Publishing waits (bounded) for room when `scored` is over
its bound rather than dropping a judged turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import AsyncExitStack
from typing import Any, Protocol

from redis.exceptions import RedisError

from services.judge import metrics
from services.judge.backend import JudgeBackend, make_backend
from services.judge.collapse import RewardWindow
from services.judge.experience import ExperienceStore, ExperienceTeacher, build_extractor
from services.judge.judges import build_judge
from services.judge.opd import OPDResult, Scorer, Teacher
from services.judge.replay import Experiential
from services.judge.settings import JudgeConfig, JudgeSettings
from services.judge.verdict import Judge, Verdict
from shared import keys as K
from shared.consumer import Consumer, Delivery, consumer_name, stop_on_signals
from shared.errors import BusError
from shared.schemas import Replay, ScoredTurn, Turn
from shared.streams import Bus
from shared.telemetry import Check, serve_ops

log = logging.getLogger(__name__)

PUBLISH_CONCURRENCY = 32  # Redis connections used for publishing at once (of the pool's 100)


class TeacherLike(Protocol):
    """opd.Teacher (hints) or experience.ExperienceTeacher."""

    @property
    def prompt_version(self) -> str: ...

    async def run(self, turn: Turn) -> OPDResult: ...


class JudgeService:
    def __init__(
        self, cfg: JudgeConfig, bus: Bus, judge: Judge | None, teacher: TeacherLike | None
    ) -> None:
        if cfg.mode != "opd" and judge is None:
            raise ValueError(f"mode {cfg.mode} needs a reward judge")
        if cfg.mode != "rl" and teacher is None:
            raise ValueError(f"mode {cfg.mode} needs a teacher")
        self.cfg = cfg
        self.bus = bus
        self.judge = judge
        self.teacher = teacher
        # redis-py's pool refuses (MaxConnectionsError) past 100 connections instead of
        # waiting: with hundreds of turns in flight, publishes queue here instead.
        self._publish_slots = asyncio.Semaphore(PUBLISH_CONCURRENCY)
        self.experiential: Experiential | None = None  # TEACHER=experience: set by `run`
        # The reward-collapse alarm's window, shared by every replica (collapse.py).
        self.window = RewardWindow(bus, cfg) if cfg.collapse_window > 0 else None

    async def handle(self, turn: Turn, delivery: Delivery) -> None:
        if turn.turn_type == "side":
            metrics.TURNS.labels("side").inc()
            return
        metrics.INFLIGHT.inc()
        started = time.perf_counter()
        try:
            if self.experiential is not None and await self.experiential.arrive(turn):
                metrics.TURNS.labels("held").inc()
                return
            scored = await self.score(turn)
            await self.publish(scored)
        except Exception:
            metrics.TURNS.labels("failed").inc()
            raise
        finally:
            metrics.INFLIGHT.dec()
        metrics.TURNS.labels("scored" if scored.judged else "unjudged").inc()
        metrics.REWARDS.labels(scored.judge, metrics.score_label(scored.reward)).inc()
        log.debug(
            "turn judged",
            extra={"turn_id": turn.id, "session_id": turn.session_id, "reward": scored.reward,
                   "judged": scored.judged, "hint": scored.hint is not None,
                   "deliveries": delivery.deliveries, "seconds": round(time.perf_counter() - started, 3)},
        )  # fmt: skip

    async def score(self, turn: Turn) -> ScoredTurn:
        if not turn.next_state:
            return ScoredTurn(
                id=turn.id, turn=turn, reward=0, judged=False, mode=self.cfg.mode,
                judge=self.judge.name if self.judge is not None else self._teacher_kind,
            )  # fmt: skip
        verdict: Verdict | None = None
        opd: OPDResult | None = None
        if self.cfg.mode == "rl":
            assert self.judge is not None
            verdict = await self.judge.judge(turn)
        elif self.cfg.mode == "opd":
            assert self.teacher is not None
            opd = await self.teacher.run(turn)
        else:
            assert self.judge is not None and self.teacher is not None
            verdict, opd = await asyncio.gather(self.judge.judge(turn), self.teacher.run(turn))
        return self.assemble(turn, verdict, opd)

    def assemble(self, turn: Turn, verdict: Verdict | None, opd: OPDResult | None) -> ScoredTurn:
        fields: dict[str, Any] = {"id": turn.id, "turn": turn, "mode": self.cfg.mode, "reward": 0}
        votes = []
        hint_votes = []
        versions = []
        if verdict is not None:
            fields.update(reward=verdict.reward, judge=verdict.judge, judge_model=verdict.judge_model)
            votes += verdict.votes
            if verdict.prompt_version:
                versions.append(verdict.prompt_version)
        if opd is not None:
            assert self.teacher is not None
            hint_votes += opd.votes
            versions.append(self.teacher.prompt_version)
            fields.update(
                hint=opd.hint,
                teacher_prompt_ids=opd.teacher_prompt_ids,
                teacher_logprobs=opd.teacher_logprobs,
                teacher_topk_ids=opd.teacher_topk_ids,
                teacher_topk_logprobs=opd.teacher_topk_logprobs,
                experience_ids=opd.experience_ids,
                judge_model=self.cfg.model,
            )
            kind = self._teacher_kind
            fields["judge"] = kind if verdict is None else f"{verdict.judge}+{kind}"
        return ScoredTurn(
            **fields, votes=votes, hint_votes=hint_votes,
            prompt_version="+".join(versions) if versions else None,
        )

    @property
    def _teacher_kind(self) -> str:
        """ScoredTurn.judge of the teacher: `opd` (hints) or `experience`."""
        return "experience" if self.cfg.experience else "opd"

    async def publish(self, scored: ScoredTurn) -> None:
        """Add to `scored`; when it is full, wait (bounded) for the buffer to catch up."""
        data = scored.to_json()
        deadline = time.monotonic() + self.cfg.publish_wait_s
        delay = 0.1
        while await self._publish_once(data) is None:
            if time.monotonic() + delay > deadline:
                raise BusError(
                    f"{K.SCORED} stayed over its bound for {self.cfg.publish_wait_s}s: "
                    "is the buffer consuming it?"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        if self.window is not None:
            await self._watch(scored)

    async def _watch(self, scored: ScoredTurn) -> None:
        """Count a published turn in the collapse window; a Redis failure here only costs
        the alarm this turn (the turn is published: it is never judged again for it)."""
        assert self.window is not None
        try:
            await self.window.add(scored)
        except (RedisError, BusError) as exc:
            log.warning("the reward-collapse window was not updated", extra={"turn_id": scored.id, "error": str(exc)})

    async def _publish_once(self, data: str) -> str | None:
        async with self._publish_slots:
            return await self.bus.publish_raw(K.SCORED, data)


async def run(settings: JudgeSettings) -> None:
    """Run one judge worker until SIGTERM/SIGINT (then finish or hand back in-flight turns)."""
    cfg = settings.judge
    async with AsyncExitStack() as stack:
        bus = await stack.enter_async_context(Bus(settings))
        checks: dict[str, Check] = {"redis": bus.ping}
        backend: JudgeBackend | None = None
        if cfg.uses_llm:
            backend = await stack.enter_async_context(make_backend(cfg))
            checks["judge"] = backend.health
        judge = build_judge(cfg, backend) if cfg.mode != "opd" else None
        if judge is not None and (aclose := getattr(judge, "aclose", None)) is not None:
            stack.push_async_callback(aclose)  # the classifier's batching worker
        token = settings.internal.secret()
        scorer = await _scorer(cfg, stack, checks, token) if cfg.mode != "rl" else None
        name = consumer_name(cfg.consumer_name, "judge")
        experiential: Experiential | None = None
        if scorer is not None and cfg.experience:  # experiential learning: replay.py
            store = ExperienceStore(bus, cfg)
            extractor = build_extractor(cfg, backend)
            service = JudgeService(cfg, bus, judge, ExperienceTeacher(scorer, store, cfg, extractor.version))
            experiential = service.experiential = Experiential(
                cfg, bus, store, extractor, service.score, service.publish)
        else:
            service = JudgeService(cfg, bus, judge, Teacher(backend, scorer, cfg) if scorer is not None else None)
        consumers: list[Consumer[Any]] = [Consumer(bus, K.TURNS, K.GROUP_JUDGE, Turn, service.handle,
                                                   name=name, concurrency=cfg.concurrency)]  # fmt: skip
        sweeps: asyncio.Task[None] | None = None
        if experiential is not None:
            consumers.append(Consumer(bus, K.REPLAYS, K.GROUP_REPLAY, Replay, experiential.replay, name=name,
                                      concurrency=cfg.replay_concurrency))  # fmt: skip
            sweeps = asyncio.create_task(experiential.run_sweeps(), name="experience-sweeps")

        def stop_all() -> None:
            for c in consumers:
                c.stop()
            if experiential is not None:
                experiential.stop()

        ops = asyncio.create_task(serve_ops(cfg.host, cfg.port, checks, settings.internal), name="ops")
        ops.add_done_callback(lambda _: stop_all())  # the ops server died: stop too
        stop_on_signals(*consumers, *([experiential] if experiential is not None else []))
        log.info(
            "judge started",
            extra={"judge": cfg.type, "mode": cfg.mode, "backend": cfg.backend, "model": cfg.model,
                   "votes": cfg.votes, "quorum": cfg.needed, "concurrency": cfg.concurrency,
                   "prompt_version": cfg.prompt_version, "teacher": cfg.teacher if scorer else None,
                   "ops_port": cfg.port},
        )  # fmt: skip
        try:
            runs = [asyncio.create_task(c.run(), name=f"consume-{c.stream}") for c in consumers]
            try:
                # One consumer that stops (or fails) stops the other: they share the process.
                done, _ = await asyncio.wait(runs, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop_all()
                await asyncio.gather(*runs, return_exceptions=True)
                if sweeps is not None:
                    await asyncio.gather(sweeps, return_exceptions=True)
            for task in done:
                task.result()
        finally:
            if not ops.done():
                ops.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(ops, return_exceptions=True)
        if ops.done() and not ops.cancelled() and ops.exception() is not None:
            raise RuntimeError(f"the ops server on {cfg.host}:{cfg.port} failed") from ops.exception()


async def _scorer(
    cfg: JudgeConfig, stack: AsyncExitStack, checks: dict[str, Check], internal_token: str | None,
) -> Scorer:
    """The teacher's scoring: the policy's chat template and the policy engine."""
    from shared.chat import ChatTemplate
    from shared.engine_client import make_engine_client

    assert cfg.engine_url is not None and cfg.tokenizer is not None
    template = await asyncio.to_thread(ChatTemplate.from_pretrained, cfg.tokenizer)
    engine = make_engine_client(
        cfg.engine_kind, cfg.engine_url, timeout=cfg.engine_timeout_s,
        max_connections=min(cfg.concurrency, 1024), api_key=internal_token, adapters=cfg.engine_adapters,
    )  # fmt: skip
    stack.push_async_callback(engine.aclose)

    async def engine_ready() -> None:
        if not await engine.health():
            raise ConnectionError(f"the policy engine at {cfg.engine_url} is not healthy")

    checks["engine"] = engine_ready
    scorer = Scorer(engine, template, cfg)
    stack.callback(scorer.close)
    return scorer
