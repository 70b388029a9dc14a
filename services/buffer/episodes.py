"""Environment episodes (track 2): hold each episode's scored turns until its Outcome.

An episode session (session id `env:...`, `shared.schemas.EPISODE_SESSION_PREFIX`) is
rewarded by how the episode ended, which the env worker publishes on `outcomes` once,
after the episode's last turn. Its turns and its Outcome reach the buffer in either
order, so both wait in Redis (episode_store.py), never in this process:

1. **A turn** (intake.py, after the side/no-tokens rules and the batched check) is held
   in its session's hash; the session enters the index with a deadline
   (`outcome_wait_s` after its first held turn), or due now if its Outcome is there.
   The `scored` entry is acknowledged once the turn is held.
2. **An Outcome** (the `outcomes` consumer, group `buffer`) is stored with a TTL
   (`outcome_ttl_s`), entered in its group, and makes its session and its group's
   sessions due now; then it is acknowledged.
3. **The sweep** claims each due session (a lease; a buffer killed mid-decision leaves it
   to be claimed again) and plans it:
   - no Outcome (the deadline passed) → every held turn dropped, `outcome_missing`;
   - an Outcome with `error` → dropped, `episode_failed`;
   - `raw` → rewarded now; `group_mean`/`group_norm` → once all `group_size` outcomes of
     its group came, or, when the group's wait (`outcome_wait_s` from its first outcome)
     ran out, with those that came (the group counted once as `group_partial`). The
     first to settle a group fixes its statistics for every later turn. Fewer than 2
     successful outcomes → dropped, `group_too_small`. Otherwise the session waits (its
     score = the group's deadline; a new outcome of its group makes it due again).
4. **Each turn** then gets its sample's `reward` (rewards.py), with R the Outcome's
   reward, mean and std (Bessel) over its group's successful outcome rewards, and s
   the judge's score of the turn (-1/0/1). A turn without a next state (the worker's closing
   request, `X-Session-Done`, or an expired turn) is dropped, `no_next_state`:

       A = R  (raw)  |  R - mean  (group_mean)  |  (R - mean) / (std + group_eps)  (group_norm)
       reward = A  (outcome: the judge ignored)  |  A + prm_weight * s  (outcome+prm)

   Then staleness, as for any turn but measured when the turn is decided (`stale`, no
   anchor), and the mode's rule (rl: a reward of exactly 0 teaches nothing,
   `zero_reward`); kept → the ledger's `record` and the batcher. The at-least-one rule
   does not apply: an episode's reward is its outcome, not a guess. Turns leave Redis
   only once decided (and kept ones batched); a turn decided before a crash is not
   decided again (ledger `decision`), and the batched marks keep a sample out of a
   second batch.

Every turn's decision is counted once in `keys.buffer_counts` (`nextstate status`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from redis.exceptions import RedisError

from services.buffer import metrics as M
from services.buffer.batcher import Batcher
from services.buffer.episode_store import HELD_DUE, EpisodeStore, Group, HeldOutcome
from services.buffer.intake import STALE
from services.buffer.ledger import Ledger
from services.buffer.rewards import GroupStats, advantage, settle, turn_reward
from services.buffer.rules import build_sample, signal_missing, staleness
from services.buffer.settings import BufferConfig, GroupAdvantage
from shared.consumer import Delivery
from shared.errors import MalformedMessage
from shared.schemas import Outcome, ScoredTurn

log = logging.getLogger(__name__)

OUTCOME_MISSING = "outcome_missing"
EPISODE_FAILED = "episode_failed"
GROUP_TOO_SMALL = "group_too_small"
GROUP_PARTIAL = "group_partial"  # counted once per group, not per turn


@dataclass(frozen=True)
class Plan:
    """How a session's held turns are decided: dropped (`drop`, why) or with `term`,
    the outcome term A of their reward."""

    drop: str | None = None
    term: float = 0.0


@dataclass(frozen=True)
class Wait:
    """Not yet: the group's outcomes are still coming, until `until` at the latest."""

    until: float


def outcome_plan(outcome: HeldOutcome | None, how: GroupAdvantage) -> Plan | None:
    """The Plan the outcome alone decides, or None: it needs its group's statistics."""
    if outcome is None:
        return Plan(drop=OUTCOME_MISSING)
    if outcome.error is not None:
        return Plan(drop=EPISODE_FAILED)
    if how == "raw":
        return Plan(term=outcome.reward)
    return None


def group_settlement(group: Group, size: int, now: float, wait_s: float) -> GroupStats | Wait | None:
    """What to fix for a group not settled yet: its statistics once all `size` outcomes
    came (or partial ones once its wait ran out), None with fewer than 2 successful
    outcomes, or Wait while it may still fill."""
    complete = len(group.entries) >= size
    deadline = (group.first if group.first is not None else now) + wait_s
    if not complete and now < deadline:
        return Wait(deadline)
    return settle([e.reward for e in group.entries.values() if not e.failed], partial=not complete)


def group_plan(reward: float, stats: GroupStats | None, how: GroupAdvantage, eps: float) -> Plan:
    if stats is None:
        return Plan(drop=GROUP_TOO_SMALL)
    return Plan(term=advantage(reward, how, stats, eps))


class Episodes:
    def __init__(self, ledger: Ledger, batcher: Batcher, cfg: BufferConfig) -> None:
        self.ledger = ledger
        self.batcher = batcher
        self.cfg = cfg
        self.store = EpisodeStore(ledger.bus, held_ttl_s=max(cfg.session_ttl_s, cfg.outcome_ttl_s),
                                  outcome_ttl_s=cfg.outcome_ttl_s)
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()

    # -- the two ways in ------------------------------------------------------------------
    async def hold(self, scored: ScoredTurn) -> None:
        """Hold an episode's turn until its outcome (intake.py)."""
        now = time.time()
        held = await self.store.hold(scored, now + self.cfg.outcome_wait_s, now)
        if held:
            M.EPISODE_TURNS_HELD.inc()
        if held == HELD_DUE:
            self._wake.set()

    async def handle_outcome(self, outcome: Outcome, delivery: Delivery) -> None:
        """The `outcomes` handler: keep the Outcome; its sessions may be due now."""
        await self.store.put_outcome(outcome, time.time())
        M.OUTCOMES.labels("failed" if outcome.error is not None else "ok").inc()
        self._wake.set()

    # -- the sweep ---------------------------------------------------------------------------
    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    async def run(self) -> None:
        """Sweep until `stop()`, then let in-flight decisions finish (their batches publish)."""
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                await self.sweep()
            except RedisError as exc:
                log.warning("episode sweep failed, retrying", extra={"error": str(exc)})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.cfg.outcome_sweep_s)
        if self._inflight:
            await asyncio.gather(*self._inflight.values(), return_exceptions=True)

    async def sweep(self) -> int:
        """Claim every due session and start deciding it. Returns how many started."""
        now = time.time()
        started = 0
        for session_id, score in await self.store.due(now, self.cfg.force_scan):
            if session_id in self._inflight:
                continue
            lease_until = now + self.cfg.force_lease_s
            if not await self.store.move(session_id, score, lease_until):
                continue  # another buffer took it, or it moved
            self._inflight[session_id] = asyncio.create_task(self._decide(session_id, lease_until))
            started += 1
        return started

    async def _decide(self, session_id: str, lease_until: float) -> None:
        try:
            await self._decide_session(session_id, lease_until)
        except RedisError as exc:  # left under its lease: decided again once it ends
            log.warning("episode decision interrupted, will retry",
                        extra={"session_id": session_id, "error": str(exc)})
        finally:
            self._inflight.pop(session_id, None)

    async def _decide_session(self, session_id: str, lease_until: float) -> None:
        plan = await self.plan(session_id, time.time())
        if isinstance(plan, Wait):  # its group is still coming: back until the group's deadline
            await self.store.move(session_id, lease_until, plan.until)
            return
        held = await self.store.held(session_id)
        results = await asyncio.gather(
            *(self._decide_turn(session_id, turn_id, data, plan) for turn_id, data in held.items()),
            return_exceptions=True)
        decided = [t for t, r in zip(held, results, strict=True) if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            log.warning("episode turns not decided, will retry",
                        extra={"session_id": session_id, "turns": len(errors), "error": str(errors[0])})
            await self.store.release(session_id, decided, lease_until, lease_until)
        else:
            now = time.time()
            await self.store.release(session_id, decided, now + self.cfg.outcome_wait_s, now)
        if plan.drop is not None:
            log.info("episode turns dropped", extra={"session_id": session_id, "reason": plan.drop,
                                                      "turns": len(decided)})

    async def plan(self, session_id: str, now: float) -> Plan | Wait:
        """The session's Plan, or when to look again (its group's deadline)."""
        cfg = self.cfg
        outcome = await self.store.outcome(session_id)
        plan = outcome_plan(outcome, cfg.group_advantage)
        if plan is not None or outcome is None:
            return plan or Plan(drop=OUTCOME_MISSING)
        group = await self.store.group(outcome.group)
        stats = group.stats
        if not group.settled:
            settled = group_settlement(group, outcome.group_size, now, cfg.outcome_wait_s)
            if isinstance(settled, Wait):
                return settled
            counted = GROUP_PARTIAL if settled is not None and settled.partial else ""
            fixed, stats = await self.store.settle(outcome.group, settled, counted)
            if fixed:
                M.GROUPS.labels("too_small" if stats is None else "partial" if stats.partial else "complete").inc()
        return group_plan(outcome.reward, stats, cfg.group_advantage, cfg.group_eps)

    async def _decide_turn(self, session_id: str, turn_id: str, data: str, plan: Plan) -> None:
        cfg = self.cfg
        try:
            scored = ScoredTurn.from_json(data)
        except MalformedMessage as exc:
            log.error("unreadable held turn dropped", extra={"turn_id": turn_id, "error": str(exc)})
            return
        turn = scored.turn
        batched, trainer_version = await self.ledger.lookup(turn.id)
        if batched:
            return
        reward = turn_reward(plan.term, scored.reward, cfg.outcome_mode, cfg.prm_weight)
        prior = await self.ledger.decision(session_id, turn.id)
        if prior is None:
            behind = staleness(scored, trainer_version)
            if behind is not None:
                M.STALENESS.observe(behind)
            reason = plan.drop
            if reason is None and turn.next_state is None:
                # The env worker gives every step a next state (the tool results, or the
                # verdict after a final answer); a turn without one is its closing request
                # (X-Session-Done) or expired: nothing the policy did in the episode.
                reason = "no_next_state"
            if reason is None and behind is not None and behind > cfg.max_staleness:
                reason = STALE
            if reason is None:
                reason = signal_missing(reward, scored.teacher_logprobs is not None, cfg.mode)
            if reason is not None:
                await self.ledger.exclude(session_id, turn.id, turn.turn_index, reason)
                if reason == STALE:
                    M.STALE.inc()
                else:
                    M.EXCLUDED.labels(reason).inc()
                return
            await self.ledger.record(session_id, turn.id, eligible=True, minimum=0, index=turn.turn_index)
            M.SAMPLES.labels("episode").inc()
        elif prior != "kept":
            return  # decided (not kept) before a restart
        await self.batcher.add(build_sample(scored, cfg.mode, reward=reward))
