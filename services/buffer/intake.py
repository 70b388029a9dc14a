"""The `scored` handler: rules, dedupe, staleness, session accounting, then the batch.

For each ScoredTurn (see rules.py for the rules themselves):

1. classify it; excluded and not a candidate for the at-least-one rule → done (counted);
2. already in a published batch (its turn id is marked) or waiting in this buffer's
   open batch → done, counted as a duplicate (the waiting case waits for that batch);
3. staler than `max_staleness` behind `keys.trainer_version` → dropped (counted);
4. recorded in the session's sample set (atomic: the at-least-one decision is made
   there) → not kept / kept / kept as forced;
5. built into a TrainSample and handed to the batcher; the handler returns — and the
   consumer acknowledges the entry — only once that sample's batch is published.
"""

from __future__ import annotations

import logging

from services.buffer import metrics as M
from services.buffer.batcher import Batcher
from services.buffer.ledger import FORCED, NOT_KEPT, Ledger
from services.buffer.rules import build_sample, classify, is_stale
from services.buffer.settings import BufferConfig
from shared.consumer import Delivery
from shared.schemas import ScoredTurn

log = logging.getLogger(__name__)


class Intake:
    def __init__(self, ledger: Ledger, batcher: Batcher, cfg: BufferConfig) -> None:
        self.ledger = ledger
        self.batcher = batcher
        self.cfg = cfg

    async def handle(self, scored: ScoredTurn, delivery: Delivery) -> None:
        turn = scored.turn
        verdict = classify(scored, self.cfg.mode)
        minimum = self.cfg.min_samples_per_session
        if not verdict.eligible and not (verdict.may_force and minimum > 0):
            M.EXCLUDED.labels(verdict.reason or "unknown").inc()
            return
        waiter = self.batcher.waiter(turn.id)
        if waiter is not None:  # a redelivery racing the original: settle with its batch
            M.DUPLICATES.inc()
            await waiter
            return
        batched, trainer_version = await self.ledger.lookup(turn.id)
        if batched:
            M.DUPLICATES.inc()
            log.debug("turn already batched", extra={"turn_id": turn.id, "entry": delivery.entry_id})
            return
        if is_stale(scored, trainer_version, self.cfg.max_staleness):
            M.STALE.inc()
            log.debug("stale sample dropped", extra={
                "turn_id": turn.id, "policy_version": turn.policy_version,
                "trainer_version": trainer_version})
            return
        kept = await self.ledger.record(
            turn.session_id, turn.id, eligible=verdict.eligible, minimum=minimum
        )
        if kept == NOT_KEPT:
            M.EXCLUDED.labels(verdict.reason or "unknown").inc()
            return
        forced = kept == FORCED
        M.SAMPLES.labels("forced" if forced else "kept").inc()
        await self.batcher.add(build_sample(scored, self.cfg.mode, forced=forced))
