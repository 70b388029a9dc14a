"""What the buffer keeps in Redis while episode turns wait for their Outcome (episodes.py).

The held turns, index and claims are holding.py's (`HeldTurns`), with the episode's
session as the unit and its Outcome as the ready key (shared/keys.py names the keys):

- **Held turns** (`episode_turns(sid)`) and the **session index** (`episode_sessions`):
  holding a turn adds its session with its deadline (`outcome_wait_s` after its first
  turn), or *now* when its Outcome is already there.
- **Outcomes** (`episode_outcome(sid)`, with a TTL) and **groups** (`episode_group(g)`:
  `i:<index>` -> {session, reward, error}, `first` = when its first outcome came,
  `stats` = its statistics once settled, fixed by the first to settle it). An outcome
  that comes moves its session, and every session of its group, to the front (score =
  now): their wait may be over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.buffer.holding import HELD, HELD_DUE, Group, GroupEntry, HeldTurns, read_group
from services.buffer.rewards import GroupStats
from shared.schemas import Outcome, ScoredTurn
from shared.streams import Bus

__all__ = ["HELD", "HELD_DUE", "EpisodeStore", "Group", "GroupEntry", "HeldOutcome"]

# KEYS: outcome, group hash, sessions zset. ARGV: outcome JSON, ttl, group field, group
# entry, now, session id. Stores both (a group entry once), then nudges the sessions.
_PUT_OUTCOME = """
redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
redis.call('HSETNX', KEYS[2], ARGV[3], ARGV[4])
redis.call('HSETNX', KEYS[2], 'first', ARGV[5])
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
redis.call('ZADD', KEYS[3], 'XX', 'LT', ARGV[5], ARGV[6])
local h = redis.call('HGETALL', KEYS[2])
for i = 1, #h, 2 do
  if string.sub(h[i], 1, 2) == 'i:' then
    redis.call('ZADD', KEYS[3], 'XX', 'LT', ARGV[5], cjson.decode(h[i + 1])['s'])
  end
end
return 1
"""


@dataclass(frozen=True)
class HeldOutcome:
    """What the buffer keeps of an Outcome: enough to reward its turns."""

    reward: float
    error: str | None
    group: str
    group_index: int
    group_size: int

    @classmethod
    def of(cls, o: Outcome) -> HeldOutcome:
        return cls(o.reward, o.error, o.group, o.group_index, o.group_size)


class EpisodeStore(HeldTurns):
    def __init__(self, bus: Bus, *, held_ttl_s: int, outcome_ttl_s: int) -> None:
        k = bus.keys
        super().__init__(bus, index=k.episode_sessions, turns=k.episode_turns, ready=k.episode_outcome,
                         held_ttl_s=held_ttl_s)  # fmt: skip
        self.outcome_ttl_s = outcome_ttl_s
        self._put = bus.redis.register_script(_PUT_OUTCOME)

    async def hold(self, scored: ScoredTurn, deadline: float, now: float) -> int:
        """Hold a turn until its session's outcome: HELD, HELD_DUE (its outcome is there)
        or 0 (the turn is decided already)."""
        return await self.hold_turn(scored.turn.session_id, scored, deadline, now)

    async def put_outcome(self, outcome: Outcome, now: float) -> None:
        k, sid = self.keys, outcome.session_id
        held = HeldOutcome.of(outcome)
        entry = json.dumps({"s": sid, "r": outcome.reward, "e": outcome.error is not None})
        await self._put(
            keys=[k.episode_outcome(sid), k.episode_group(outcome.group), k.episode_sessions],
            args=[json.dumps(held.__dict__), self.outcome_ttl_s, f"i:{outcome.group_index}", entry,
                  repr(now), sid],
        )

    async def outcome(self, session_id: str) -> HeldOutcome | None:
        raw = await self.bus.redis.get(self.keys.episode_outcome(session_id))
        return None if raw is None else HeldOutcome(**json.loads(raw))

    async def group(self, group: str) -> Group:
        return read_group(await self.bus.redis.hgetall(self.keys.episode_group(group)), "i:")

    async def settle(self, group: str, stats: GroupStats | None, counted: str) -> tuple[bool, GroupStats | None]:
        """Fix the group's statistics unless someone did first: (this call fixed them, the
        fixed ones). `counted`: the outcome counted in `buffer_counts` when it does."""
        return await self.settle_stats(self.keys.episode_group(group), stats, counted)

