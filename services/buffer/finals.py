"""The at-least-one rule, decided once a session's earlier turns are: parked final turns.

A session's final turn that no rule keeps (no next state, r = 0, stale...) may still
become its session's one sample. Deciding that the moment it arrives would be a race:
a final turn without a next state skips the judge and often reaches the buffer *before*
the session's earlier turns, which are still being judged — the rule would force it in,
and a moment later an earlier turn would be batched too. So the intake parks such a
turn (ledger.py: `park`), and this loop decides it when it is due:

- every earlier turn of its session (turn indexes 0..k-1 of a turn with index k) is
  decided, or
- its deadline (`force_settle_s` after it arrived) has passed (an earlier turn was lost
  or went elsewhere; the rule must not wait forever).

Deciding = the ledger's atomic `record`: FORCED (the session has fewer samples than the
minimum) → built as a forced sample (an anchor only when it was stale) and batched;
otherwise → excluded with its reason. Only then is the candidate removed, so a buffer
killed mid-decision leaves it parked; its claim is a lease that ends `force_lease_s`
later, and whoever runs the loop then decides it again (the ledger makes that a no-op
when it already was).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.exceptions import RedisError

from services.buffer import metrics as M
from services.buffer.batcher import Batcher, BatcherStopped
from services.buffer.intake import STALE, unpark_data
from services.buffer.ledger import FORCED, Ledger
from services.buffer.rules import build_sample
from services.buffer.settings import BufferConfig
from shared.errors import MalformedMessage

log = logging.getLogger(__name__)


class Finals:
    def __init__(self, ledger: Ledger, batcher: Batcher, cfg: BufferConfig) -> None:
        self.ledger = ledger
        self.batcher = batcher
        self.cfg = cfg
        self._where: dict[str, tuple[str, int]] = {}  # turn id -> (session, index), cached
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        """Sweep until `stop()`, then let in-flight decisions finish (their batches publish)."""
        while not self._stopping.is_set():
            try:
                await self.sweep()
            except RedisError as exc:
                log.warning("force-candidate sweep failed, retrying", extra={"error": str(exc)})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.cfg.force_sweep_s)
        if self._inflight:
            await asyncio.gather(*self._inflight.values(), return_exceptions=True)

    async def sweep(self) -> int:
        """Claim and start deciding every candidate that is due. Returns how many started."""
        now = time.time()
        started = 0
        rows = await self.ledger.candidates(self.cfg.force_scan)
        live = {turn_id for turn_id, _ in rows}
        for gone in set(self._where) - live:
            self._where.pop(gone, None)
        for turn_id, score in rows:
            if turn_id in self._inflight or not await self._due(turn_id, score, now):
                continue
            data = await self.ledger.claim(turn_id, score, -(now + self.cfg.force_lease_s))
            if data is None:
                continue  # another buffer took it, or it is gone
            self._inflight[turn_id] = asyncio.create_task(self._decide(turn_id, data))
            started += 1
        M.SWEEPS.labels("final").inc()
        return started

    async def _due(self, turn_id: str, score: float, now: float) -> bool:
        if score < 0:  # claimed: due again only once the claimer's lease ran out
            return now >= -score
        if now >= score:
            return True
        where = self._where.get(turn_id)
        if where is None:
            data = await self.ledger.bus.redis.get(self.ledger.keys.force_candidate(turn_id))
            if data is None:
                return False
            try:
                scored, _ = unpark_data(data)
            except (ValueError, KeyError, MalformedMessage):
                return True  # unreadable: let _decide drop it loudly
            where = self._where[turn_id] = (scored.turn.session_id, scored.turn.turn_index)
        return await self.ledger.ancestors_settled(*where)

    async def _decide(self, turn_id: str, data: str) -> None:
        try:
            await self._decide_once(turn_id, data)
        finally:
            self._inflight.pop(turn_id, None)

    async def _decide_once(self, turn_id: str, data: str) -> None:
        try:
            try:
                scored, reason = unpark_data(data)
            except (ValueError, KeyError) as exc:
                log.error("unreadable force candidate dropped", extra={"turn_id": turn_id, "error": str(exc)})
                await self.ledger.unpark(turn_id)
                return
            turn = scored.turn
            kept = await self.ledger.record(
                turn.session_id, turn.id, eligible=False, minimum=self.cfg.min_samples_per_session,
                index=turn.turn_index, reason=reason,
            )
            if kept == FORCED:
                M.SAMPLES.labels("forced").inc()
                sample = build_sample(scored, self.cfg.mode, forced=True, anchor_only=reason == STALE)
                await self.batcher.add(sample)
            elif reason == STALE:
                M.STALE.inc()
            else:
                M.EXCLUDED.labels(reason).inc()
            await self.ledger.unpark(turn_id)
        except (RedisError, BatcherStopped) as exc:
            # Left parked under its lease: decided again once the lease runs out.
            log.warning("force decision interrupted, will retry", extra={"turn_id": turn_id, "error": str(exc)})
