"""Chat groups: the n choices of one completion, rewarded against each other.

A chat completion with `n > 1` is captured as n turns sharing a `group_id` (the
completion's id), each with its `group_index` and the `group_size` n (the collector's
completion.py). The follow-up continues one choice; what its siblings get is the
collector's NEXTSTATE_COLLECTOR__GROUP_UNCHOSEN (no next state, the chosen one's, or
nothing at all).

NEXTSTATE_BUFFER__GROUP_ADVANTAGE decides how a member's reward becomes its sample's:

- `raw` (the default, as the original: GRPO with a group of one): each member is an
  ordinary turn, A = r, decided at once by the intake's rules.
- `group_mean` / `group_norm` (in rl and combine modes; in opd the reward is not the
  advantage): the group's judged members are held in Redis (holding.py) until every
  member came — judged or not — or `outcome_wait_s` after its first one; then, with mean
  and std (Bessel) over the judged members' rewards,

      group_mean  A_i = r_i - mean
      group_norm  A_i = (r_i - mean) / (std + group_eps)

  the same functions as episode groups (rewards.py). Fewer than 2 judged members → every
  held one dropped, `group_too_small` (under GROUP_UNCHOSEN=keep only the chosen member
  is judged: a group advantage then needs GROUP_UNCHOSEN=judge, and the buffer says so
  once in its log). A partial group (its wait ran out) is counted once as
  `chat_group_partial`. Then staleness and the mode's rule on A_i, as for every held turn.

A member without a next state (unchosen under `keep`, expired, or the end of its
session) is not held: it counts as arrived in its group, then goes the intake's usual
way (excluded as `no_next_state`, or the at-least-one rule for a session's final turn).

Redis (shared/keys.py): `chat_group(g)` (`m:<index>` -> {session, reward, not judged}
per member that came, `size`, `first`, `stats`), `chat_group_turns(g)` (the held judged
members), `chat_group_ready(g)` (every member came, or the statistics are fixed: held
members are due at once), and the index `chat_groups`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from services.buffer import metrics as M
from services.buffer.batcher import Batcher
from services.buffer.holding import (
    GROUP_TOO_SMALL,
    Group,
    HeldSweep,
    HeldTurns,
    Wait,
    group_kind,
    group_settlement,
    read_group,
)
from services.buffer.ledger import Ledger
from services.buffer.rewards import GroupStats, advantage
from services.buffer.settings import BufferConfig
from shared.schemas import EPISODE_SESSION_PREFIX, ScoredTurn
from shared.streams import Bus

log = logging.getLogger(__name__)

CHAT_GROUP_PARTIAL = "chat_group_partial"  # counted once per group, not per turn
MEMBER = "m:"

# KEYS: group hash, ready key, index zset. ARGV: member field, member JSON, size, now, ttl,
# group id. Records a member once; when every member came, sets the ready key and makes
# the group due now. Returns 1 when the group is complete.
_ARRIVE = """
redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSETNX', KEYS[1], 'first', ARGV[4])
redis.call('HSETNX', KEYS[1], 'size', ARGV[3])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5]))
local members = 0
for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
  if string.sub(field, 1, 2) == 'm:' then members = members + 1 end
end
if members < tonumber(ARGV[3]) then return 0 end
redis.call('SET', KEYS[2], '1', 'EX', tonumber(ARGV[5]))
redis.call('ZADD', KEYS[3], 'XX', 'LT', ARGV[4], ARGV[6])
return 1
"""


@dataclass(frozen=True)
class GroupPlan:
    """A settled group: its statistics, or None (too small: its members are dropped)."""

    stats: GroupStats | None


class ChatGroupStore(HeldTurns):
    def __init__(self, bus: Bus, *, ttl_s: int) -> None:
        k = bus.keys
        super().__init__(bus, index=k.chat_groups, turns=k.chat_group_turns, ready=k.chat_group_ready,
                         held_ttl_s=ttl_s)  # fmt: skip
        self._arrive = bus.redis.register_script(_ARRIVE)

    async def arrive(self, scored: ScoredTurn, now: float) -> bool:
        """Record that a member came (judged or not). True when its group is complete."""
        turn = scored.turn
        assert turn.group_id is not None
        k = self.keys
        member = json.dumps({"s": turn.session_id, "r": scored.reward, "e": not scored.judged})
        done = await self._arrive(
            keys=[k.chat_group(turn.group_id), k.chat_group_ready(turn.group_id), k.chat_groups],
            args=[f"{MEMBER}{turn.group_index}", member, turn.group_size, repr(now), self.held_ttl_s,
                  turn.group_id],
        )  # fmt: skip
        return bool(done)

    async def group(self, group_id: str) -> tuple[Group, int]:
        """The group's members so far, and its size."""
        raw: dict[str, str] = await self.bus.redis.hgetall(self.keys.chat_group(group_id))
        return read_group(raw, MEMBER), int(raw.get("size", 1))

    async def settle(self, group_id: str, stats: GroupStats | None, counted: str) -> tuple[bool, GroupStats | None]:
        """Fix the group's statistics unless someone did first; its members that come
        later are due at once."""
        k = self.keys
        return await self.settle_stats(k.chat_group(group_id), stats, counted,
                                       ready=k.chat_group_ready(group_id), ttl=self.held_ttl_s)  # fmt: skip


class ChatGroups(HeldSweep[GroupPlan]):
    kind = "group"

    def __init__(self, ledger: Ledger, batcher: Batcher, cfg: BufferConfig) -> None:
        store = ChatGroupStore(ledger.bus, ttl_s=max(cfg.session_ttl_s, cfg.outcome_ttl_s))
        super().__init__(ledger, batcher, cfg, store, M.CHAT_GROUP_TURNS_HELD)
        self.groups = store
        self._said_judge = False

    def applies(self, scored: ScoredTurn) -> bool:
        """A member of a chat group whose advantage is taken over the group."""
        turn = scored.turn
        return (self.cfg.group_advantage != "raw" and self.cfg.mode != "opd" and turn.grouped
                and not turn.session_id.startswith(EPISODE_SESSION_PREFIX))  # fmt: skip

    async def take(self, scored: ScoredTurn) -> bool:
        """The intake's hook for a member (`applies`): count it as arrived, and hold it when
        it was judged (True: the intake is done with it); False: decide it as usual (not
        a member, or not judged)."""
        if not self.applies(scored):
            return False
        complete = await self.groups.arrive(scored, time.time())
        if complete:
            self.wake()
        if not scored.judged:
            return False
        assert scored.turn.group_id is not None
        await self.hold_in(scored.turn.group_id, scored)
        return True

    async def plan(self, unit: str, now: float) -> GroupPlan | Wait:
        group, size = await self.groups.group(unit)
        stats = group.stats
        if not group.settled:
            settled = group_settlement(group, size, now, self.cfg.outcome_wait_s)
            if isinstance(settled, Wait):
                return settled
            counted = CHAT_GROUP_PARTIAL if settled is not None and settled.partial else ""
            fixed, stats = await self.groups.settle(unit, settled, counted)
            if fixed:
                M.CHAT_GROUPS.labels(group_kind(stats)).inc()
                if stats is None and any(e.failed for e in group.entries.values()):
                    self._say_judge()
        return GroupPlan(stats)

    def _say_judge(self) -> None:
        if not self._said_judge:
            self._said_judge = True
            log.warning(
                "a chat group had fewer than 2 judged choices, so its judged one is dropped "
                "(group_too_small): NEXTSTATE_BUFFER__GROUP_ADVANTAGE=%s compares the choices of "
                "a group, which needs every choice judged — set NEXTSTATE_COLLECTOR__GROUP_UNCHOSEN=judge "
                "on the collector, or GROUP_ADVANTAGE=raw", self.cfg.group_advantage)

    def drop_reason(self, plan: GroupPlan) -> str | None:
        return GROUP_TOO_SMALL if plan.stats is None else None

    def reward(self, plan: GroupPlan, scored: ScoredTurn) -> float:
        return advantage(scored.reward, self.cfg.group_advantage, plan.stats, self.cfg.group_eps)
