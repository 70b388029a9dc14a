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

   Then (holding.py's sweep, shared with chat groups) staleness, as for any turn but measured when the turn is decided (`stale`, no
   anchor), and the mode's rule (rl: a reward of exactly 0 teaches nothing,
   `zero_reward`); kept → the ledger's `record` and the batcher. The at-least-one rule
   does not apply: an episode's reward is its outcome, not a guess. Turns leave Redis
   only once decided (and kept ones batched); a turn decided before a crash is not
   decided again (ledger `decision`), and the batched marks keep a sample out of a
   second batch.

Every turn's decision is counted once in `keys.buffer_counts` (`nextstate status`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from services.buffer import metrics as M
from services.buffer.batcher import Batcher
from services.buffer.episode_store import EpisodeStore, HeldOutcome
from services.buffer.holding import GROUP_TOO_SMALL, HeldSweep, Wait, group_kind, group_settlement
from services.buffer.ledger import Ledger
from services.buffer.rewards import GroupStats, advantage, turn_reward
from services.buffer.settings import BufferConfig, GroupAdvantage
from shared.consumer import Delivery
from shared.schemas import Outcome, ScoredTurn

log = logging.getLogger(__name__)

__all__ = ["EPISODE_FAILED", "GROUP_PARTIAL", "GROUP_TOO_SMALL", "OUTCOME_MISSING", "Episodes",
           "Plan", "Wait", "group_plan", "group_settlement", "outcome_plan"]  # fmt: skip

OUTCOME_MISSING = "outcome_missing"
EPISODE_FAILED = "episode_failed"
GROUP_PARTIAL = "group_partial"  # counted once per group, not per turn


@dataclass(frozen=True)
class Plan:
    """How a session's held turns are decided: dropped (`drop`, why) or with `term`,
    the outcome term A of their reward."""

    drop: str | None = None
    term: float = 0.0


def outcome_plan(outcome: HeldOutcome | None, how: GroupAdvantage) -> Plan | None:
    """The Plan the outcome alone decides, or None: it needs its group's statistics."""
    if outcome is None:
        return Plan(drop=OUTCOME_MISSING)
    if outcome.error is not None:
        return Plan(drop=EPISODE_FAILED)
    if how == "raw":
        return Plan(term=outcome.reward)
    return None


def group_plan(reward: float, stats: GroupStats | None, how: GroupAdvantage, eps: float) -> Plan:
    if stats is None:
        return Plan(drop=GROUP_TOO_SMALL)
    return Plan(term=advantage(reward, how, stats, eps))


class Episodes(HeldSweep[Plan]):
    kind = "episode"

    def __init__(self, ledger: Ledger, batcher: Batcher, cfg: BufferConfig) -> None:
        store = EpisodeStore(ledger.bus, held_ttl_s=max(cfg.session_ttl_s, cfg.outcome_ttl_s),
                             outcome_ttl_s=cfg.outcome_ttl_s)  # fmt: skip
        super().__init__(ledger, batcher, cfg, store, M.EPISODE_TURNS_HELD)
        self.episodes = store

    # -- the two ways in ------------------------------------------------------------------
    async def hold(self, scored: ScoredTurn) -> None:
        """Hold an episode's turn until its outcome (intake.py)."""
        await self.hold_in(scored.turn.session_id, scored)

    async def handle_outcome(self, outcome: Outcome, delivery: Delivery) -> None:
        """The `outcomes` handler: keep the Outcome; its sessions may be due now."""
        await self.episodes.put_outcome(outcome, time.time())
        M.OUTCOMES.labels("failed" if outcome.error is not None else "ok").inc()
        self.wake()

    # -- the plan -------------------------------------------------------------------------------
    async def plan(self, unit: str, now: float) -> Plan | Wait:
        """The session's Plan, or when to look again (its group's deadline)."""
        cfg = self.cfg
        outcome = await self.episodes.outcome(unit)
        plan = outcome_plan(outcome, cfg.group_advantage)
        if plan is not None or outcome is None:
            return plan or Plan(drop=OUTCOME_MISSING)
        group = await self.episodes.group(outcome.group)
        stats = group.stats
        if not group.settled:
            settled = group_settlement(group, outcome.group_size, now, cfg.outcome_wait_s)
            if isinstance(settled, Wait):
                return settled
            counted = GROUP_PARTIAL if settled is not None and settled.partial else ""
            fixed, stats = await self.episodes.settle(outcome.group, settled, counted)
            if fixed:
                M.GROUPS.labels(group_kind(stats)).inc()
        return group_plan(outcome.reward, stats, cfg.group_advantage, cfg.group_eps)

    def drop_reason(self, plan: Plan) -> str | None:
        return plan.drop

    def reward(self, plan: Plan, scored: ScoredTurn) -> float:
        return turn_reward(plan.term, scored.reward, self.cfg.outcome_mode, self.cfg.prm_weight)
