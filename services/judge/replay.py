"""Experiential learning's timing: a session's turns wait for its experience, then replay.

A turn is distilled against its session's lessons, which exist only once the session
has ended, so (NEXTSTATE_JUDGE__TEACHER=experience):

1. **A turn with a next state** is held in Redis (its session's hash of held turns,
   experience.py's store; the session enters the waiting index with a deadline
   EXPERIENCE_WAIT_S after its latest held turn), and its `turns` entry is acknowledged:
   nothing is published yet. When the session's experience already exists (the turn
   came late) or the session holds EXPERIENCE_MAX_HELD turns, it is scored at once
   instead. Holding and the "ended?" check are one script, so a turn is never held
   after its session's replay looked.
2. **A turn without one** ends its session (`X-Session-Done`, an expired turn): the
   extractor writes the session's lessons and they are stored (once per ending turn: a
   redelivered ending reuses the stored record, it does not call the model again), then
   a `Replay` (reason `experience`, id `experience.<turn id>`) is published on the
   `replays` stream, then the turn's own unjudged ScoredTurn; then it is acknowledged.
3. **A Replay** (consumer group `judge` on `replays`, shared/consumer.py) scores every
   held turn of its session as any turn is scored (the teacher now reads the stored
   experience), publishes each ScoredTurn and only then removes it from the hash; the
   session leaves the index once nothing is held. Then the Replay is acknowledged.
4. **The sweep** (every judge process, each EXPERIENCE_SWEEP_S) claims sessions whose
   deadline passed — their end never came (a lost ending) — for EXPERIENCE_LEASE_S and
   publishes a Replay (reason `deadline`): their turns are scored with whatever
   experience there is (cross scope: the store's; session scope: none, so no teacher).

A SIGKILL loses nothing and duplicates nothing downstream: every step is acknowledged
after its effect, so a killed judge's turn, ending or Replay is delivered again (its own
pending entries at its restart, or another judge's janitor); a held turn leaves Redis
only after its ScoredTurn is published, and a turn published twice (killed between the
two) carries its turn id as message id, which the buffer deduplicates. A Replay that
keeps failing (the engine down) is retried with backoff and dead-lettered after
`NEXTSTATE_STREAMS__MAX_DELIVERIES` (`nextstate dlq requeue` runs it again); its turns
stay held, and the sweep replays them again once their deadline passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from services.judge import metrics
from services.judge.experience import Experience, ExperienceStore, Extractor
from services.judge.settings import JudgeConfig
from shared import keys as K
from shared.consumer import Delivery
from shared.errors import BusError, MalformedMessage
from shared.schemas import DeadLetter, Replay, ScoredTurn, Turn
from shared.streams import Bus

log = logging.getLogger(__name__)

SWEEP_SCAN = 100  # overdue sessions looked at per sweep
REPLAY_TURNS = 16  # held turns of one session scored at once


def replay_id(reason: str, key: str) -> str:
    """`<reason>.<key>`, or `<reason>.<digest of key>` when that would pass a message id's
    256 characters (session and turn ids may be that long)."""
    out = f"{reason}.{key}"
    return out if len(out) <= 256 else f"{reason}.{hashlib.sha256(key.encode()).hexdigest()}"


class Experiential:
    def __init__(
        self, cfg: JudgeConfig, bus: Bus, store: ExperienceStore, extractor: Extractor,
        score: Callable[[Turn], Awaitable[ScoredTurn]], publish: Callable[[ScoredTurn], Awaitable[None]],
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.bus = bus
        self.store = store
        self.extractor = extractor
        self.score = score
        self.publish = publish
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    # -- the turns handler's part ------------------------------------------------------------
    async def arrive(self, turn: Turn) -> bool:
        """True when the turn is held (nothing to publish now); an ending is handled here
        and returns False (its own ScoredTurn, unjudged, is the caller's to publish)."""
        if not turn.next_state:
            await self.ended(turn)
            return False
        state = await self.store.hold(turn, time.time() + self.cfg.experience_wait_s)
        metrics.HELD.labels(state).inc()
        return state == "held"

    async def ended(self, turn: Turn) -> None:
        """The session ended with `turn`: its experience stored (once), then its Replay."""
        record = await self.store.recorded(turn.session_id, turn.id)
        if record is None:
            lessons = await self.extractor.extract(turn)
            record = Experience(
                id=turn.id, session_id=turn.session_id, user=turn.user, lessons=lessons,
                turn_ids=[*await self.store.held_ids(turn.session_id), turn.id], turn_index=turn.turn_index,
                prompt_version=self.extractor.version, extractor_model=self.extractor.model,
            )  # fmt: skip
            wrote = await self.store.save(record)
            metrics.EXPERIENCE.labels(("extracted" if lessons else "empty") if wrote else "reused").inc()
            log.info("session experience", extra={"session_id": turn.session_id, "turn_id": turn.id,
                                                  "lessons": len(lessons), "stored": wrote})  # fmt: skip
        else:
            metrics.EXPERIENCE.labels("reused").inc()
        await self.request(Replay(id=replay_id("experience", turn.id), session_id=turn.session_id,
                                  reason="experience"))  # fmt: skip

    async def request(self, replay: Replay) -> None:
        if await self.bus.publish(K.REPLAYS, replay) is None:
            raise BusError(f"{K.REPLAYS} is over its bound: is a judge consuming it?")

    # -- the replays handler --------------------------------------------------------------------
    async def replay(self, replay: Replay, delivery: Delivery) -> None:
        """Score, publish and release every held turn of the session (idempotent)."""
        held = await self.store.held(replay.session_id)
        slots = asyncio.Semaphore(REPLAY_TURNS)

        async def one(turn_id: str, data: str) -> None:
            try:
                turn = Turn.from_json(data)
            except MalformedMessage as exc:  # never written so by us: keep it for the operator
                letter = DeadLetter(stream=K.REPLAYS, group=K.GROUP_REPLAY, entry_id=delivery.entry_id,
                                    data=data, error=str(exc)[:2000], deliveries=delivery.deliveries)  # fmt: skip
                await self.bus.redis.xadd(self.bus.keys.dead, {K.FIELD: letter.to_json()})
            else:
                async with slots:
                    await self.publish(await self.score(turn))
                metrics.REPLAYED.labels(replay.reason).inc()
            await self.store.release(replay.session_id, turn_id)

        results = await asyncio.gather(*(one(t, d) for t, d in held.items()), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        await self.store.finish(replay.session_id)
        log.info("session replayed", extra={"session_id": replay.session_id, "reason": replay.reason,
                                            "turns": len(held)})  # fmt: skip

    # -- the deadline sweep -------------------------------------------------------------------------
    async def sweep(self) -> int:
        """Request a replay of every session whose deadline (or an earlier claim's lease)
        passed; returns how many."""
        now = time.time()
        requested = 0
        for session_id, score in await self.store.overdue(now, SWEEP_SCAN):
            if not await self.store.claim(session_id, score, now + self.cfg.experience_lease_s):
                continue  # another judge took it
            replay = Replay(id=replay_id("deadline", f"{session_id}.{score!r}"), session_id=session_id,
                            reason="deadline")  # fmt: skip
            await self.request(replay)
            requested += 1
        return requested

    async def run_sweeps(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.sweep()
            except (RedisError, BusError) as exc:
                log.warning("experience sweep failed, retrying", extra={"error": str(exc)})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.cfg.experience_sweep_s)
