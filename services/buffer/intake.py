"""The `scored` handler: rules, dedupe, staleness, then the batch or the at-least-one rule.

For each ScoredTurn (see rules.py for the rules themselves):

1. classify it; a turn that can never be a sample (side, no tokens) → decided, done;
2. already in a published batch (its turn id is marked) or waiting in this buffer's
   open batch → a duplicate, done (the waiting case waits for that batch);
3. an environment episode's turn (session id `env:...`) is held until its Outcome
   (episodes.py decides it then, with its outcome reward); done; a member of a chat
   group (n > 1) under a group advantage counts as arrived in its group and, when
   judged, is held until its group came (chat_groups.py); done;
4. eligible and no more than `max_staleness` versions behind `keys.trainer_version` →
   recorded as kept in its session's sample set and handed to the batcher; the handler
   returns — and the consumer acknowledges the entry — only once that sample's batch
   is published;
5. otherwise (excluded by a rule, or stale): a session's *final* turn is parked as a
   force candidate (finals.py decides it once the session's earlier turns are decided);
   any other turn is decided as excluded, with its reason (`stale` for stale ones).

Every decision is written once per turn with its outcome (ledger.py), so redeliveries
never count twice and the per-rule counts in `nextstate status` are exact.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable

from services.buffer import metrics as M
from services.buffer.batcher import Batcher
from services.buffer.ledger import NOT_KEPT, Ledger
from services.buffer.rules import build_sample, classify, staleness
from services.buffer.settings import BufferConfig
from shared.consumer import Delivery
from shared.schemas import EPISODE_SESSION_PREFIX, ScoredTurn

log = logging.getLogger(__name__)

STALE = "stale"


class Intake:
    def __init__(
        self, ledger: Ledger, batcher: Batcher, cfg: BufferConfig,
        hold_episode: Callable[[ScoredTurn], Awaitable[None]] | None = None,
        take_group: Callable[[ScoredTurn], Awaitable[bool]] | None = None,
    ) -> None:
        self.ledger = ledger
        self.batcher = batcher
        self.cfg = cfg
        self.hold_episode = hold_episode  # episodes.Episodes.hold; None: no episode join
        self.take_group = take_group  # chat_groups.ChatGroups.take: True when it holds the turn

    async def handle(self, scored: ScoredTurn, delivery: Delivery) -> None:
        turn = scored.turn
        verdict = classify(scored, self.cfg.mode)
        if not verdict.buildable:
            await self._exclude(scored, verdict.reason or "unknown")
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
        if self.hold_episode is not None and turn.session_id.startswith(EPISODE_SESSION_PREFIX):
            await self.hold_episode(scored)
            return
        if self.take_group is not None and await self.take_group(scored):
            return
        behind = staleness(scored, trainer_version)
        if behind is not None:
            M.STALENESS.observe(behind)
        stale = behind is not None and behind > self.cfg.max_staleness
        if verdict.eligible and not stale:
            kept = await self.ledger.record(
                turn.session_id, turn.id, eligible=True, minimum=self.cfg.min_samples_per_session,
                index=turn.turn_index,
            )
            if kept != NOT_KEPT:
                M.SAMPLES.labels("kept").inc()
                await self.batcher.add(build_sample(scored, self.cfg.mode))
            return
        reason = STALE if verdict.eligible else (verdict.reason or "unknown")
        if verdict.final and self.cfg.min_samples_per_session > 0:
            due = time.time() + self.cfg.force_settle_s
            if await self.ledger.park(turn.session_id, turn.id, park_data(scored, reason), due):
                M.PARKED.inc()
            return
        await self._exclude(scored, reason)

    async def _exclude(self, scored: ScoredTurn, reason: str) -> None:
        turn = scored.turn
        await self.ledger.exclude(turn.session_id, turn.id, turn.turn_index, reason)
        if reason == STALE:
            M.STALE.inc()
        else:
            M.EXCLUDED.labels(reason).inc()


def park_data(scored: ScoredTurn, reason: str) -> str:
    """What a parked force candidate holds: the scored turn and why it was not kept."""
    return f'{{"reason":{json.dumps(reason)},"scored":{scored.to_json()}}}'


def unpark_data(data: str) -> tuple[ScoredTurn, str]:
    obj = json.loads(data)
    return ScoredTurn.model_validate(obj["scored"]), str(obj["reason"])
