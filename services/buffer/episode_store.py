"""What the buffer keeps in Redis while episode turns wait for their Outcome (episodes.py).

Each write is one Lua script, so it is atomic and safe under redelivery, restarts and
several buffer replicas (shared/keys.py names the keys):

- **Held turns** (`episode_turns(sid)`, turn id -> ScoredTurn JSON) and the **session
  index** (`episode_sessions`, session id scored by when to look at it next). The
  invariant: a session with held turns is in the index. Holding a turn adds the session
  with its deadline (`outcome_wait_s` after its first turn), or *now* when its Outcome
  is already there; releasing decided turns removes the session only once none is left.
- **Claims**: a sweep takes a due session by a compare-and-set of its score to a lease's
  end (one claimer wins); a buffer killed mid-decision leaves the session to be claimed
  again when the lease ends. Turns leave the hash only after their decision (and batch)
  is written, so a crash loses none, and the ledger makes a repeated decision a no-op.
- **Outcomes** (`episode_outcome(sid)`, with a TTL) and **groups** (`episode_group(g)`:
  `i:<index>` -> {session, reward, error}, `first` = when its first outcome came,
  `stats` = its statistics once settled, fixed by the first to settle it). An outcome
  that comes moves its session, and every session of its group, to the front (score =
  now): their wait may be over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.buffer.rewards import GroupStats
from shared.schemas import Outcome, ScoredTurn
from shared.streams import Bus

# KEYS: decisions, turns hash, sessions zset, outcome. ARGV: turn id, data, deadline, now,
# ttl, session id. Returns 2 held and its outcome is there, 1 held, 0 decided already.
_HOLD = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[5]))
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('ZADD', KEYS[3], 'NX', ARGV[4], ARGV[6])
  return 2
end
redis.call('ZADD', KEYS[3], 'NX', ARGV[3], ARGV[6])
return 1
"""

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

# KEYS: sessions zset. ARGV: session id, score read, new score. Compare-and-set.
_CAS = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], 'XX', ARGV[3], ARGV[1])
return 1
"""

# KEYS: turns hash, sessions zset, outcome. ARGV: session id, score if turns are left
# (ignored when the outcome is there: then now), now, turn ids decided...
_RELEASE = """
for i = 4, #ARGV do redis.call('HDEL', KEYS[1], ARGV[i]) end
if redis.call('HLEN', KEYS[1]) == 0 then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 0
end
local score = ARGV[2]
if redis.call('EXISTS', KEYS[3]) == 1 then score = ARGV[3] end
redis.call('ZADD', KEYS[2], score, ARGV[1])
return 1
"""

# KEYS: group hash, counts. ARGV: stats JSON, counted outcome ('' for none). The first
# to settle a group fixes its statistics (and counts it). Returns {1 if this call fixed
# them else 0, what is fixed}.
_SETTLE = """
local fixed = redis.call('HSETNX', KEYS[1], 'stats', ARGV[1])
if fixed == 1 and ARGV[2] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[2], 1) end
return {fixed, redis.call('HGET', KEYS[1], 'stats')}
"""


HELD, HELD_DUE = 1, 2


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


@dataclass(frozen=True)
class GroupEntry:
    session_id: str
    reward: float
    failed: bool


@dataclass(frozen=True)
class Group:
    """A group's outcomes so far, when its wait began, and its statistics if settled
    (`stats` None with `settled`: too few successful outcomes to take any)."""

    entries: dict[int, GroupEntry]
    first: float | None
    settled: bool
    stats: GroupStats | None


class EpisodeStore:
    def __init__(self, bus: Bus, *, held_ttl_s: int, outcome_ttl_s: int) -> None:
        self.bus = bus
        self.keys = bus.keys
        self.held_ttl_s = held_ttl_s
        self.outcome_ttl_s = outcome_ttl_s
        r = bus.redis
        self._hold = r.register_script(_HOLD)
        self._put = r.register_script(_PUT_OUTCOME)
        self._cas = r.register_script(_CAS)
        self._release = r.register_script(_RELEASE)
        self._settle = r.register_script(_SETTLE)

    async def hold(self, scored: ScoredTurn, deadline: float, now: float) -> int:
        """Hold a turn until its session's outcome: HELD, HELD_DUE (its outcome is there)
        or 0 (the turn is decided already)."""
        k, sid = self.keys, scored.turn.session_id
        held = await self._hold(
            keys=[k.session_decisions(sid), k.episode_turns(sid), k.episode_sessions, k.episode_outcome(sid)],
            args=[scored.turn.id, scored.to_json(), repr(deadline), repr(now), self.held_ttl_s, sid],
        )
        return int(held)

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

    async def due(self, now: float, limit: int) -> list[tuple[str, float]]:
        """(session id, score) of sessions to look at now, soonest first."""
        rows = await self.bus.redis.zrangebyscore(
            self.keys.episode_sessions, "-inf", now, start=0, num=limit, withscores=True)
        return [(str(m), float(s)) for m, s in rows]

    async def move(self, session_id: str, score: float, to: float) -> bool:
        """Compare-and-set a session's score (a claim, or a claimer handing it back)."""
        return bool(await self._cas(keys=[self.keys.episode_sessions], args=[session_id, repr(score), repr(to)]))

    async def held(self, session_id: str) -> dict[str, str]:
        raw = await self.bus.redis.hgetall(self.keys.episode_turns(session_id))
        return {str(t): str(d) for t, d in raw.items()}

    async def release(self, session_id: str, decided: list[str], left_at: float, now: float) -> None:
        """Forget decided turns; a session with turns left is looked at again at `left_at`
        (now, if its outcome is there)."""
        k = self.keys
        await self._release(
            keys=[k.episode_turns(session_id), k.episode_sessions, k.episode_outcome(session_id)],
            args=[session_id, repr(left_at), repr(now), *decided])

    async def group(self, group: str) -> Group:
        raw: dict[str, str] = await self.bus.redis.hgetall(self.keys.episode_group(group))
        entries = {}
        for field, value in raw.items():
            if field.startswith("i:"):
                e = json.loads(value)
                entries[int(field[2:])] = GroupEntry(str(e["s"]), float(e["r"]), bool(e["e"]))
        first = float(raw["first"]) if "first" in raw else None
        stats = raw.get("stats")
        if stats is None:
            return Group(entries, first, False, None)
        return Group(entries, first, True, _stats(stats))

    async def settle(self, group: str, stats: GroupStats | None, counted: str) -> tuple[bool, GroupStats | None]:
        """Fix the group's statistics unless someone did first: (this call fixed them, the
        fixed ones). `counted`: the outcome counted in `buffer_counts` when it does."""
        data = json.dumps(None if stats is None else stats.__dict__)
        fixed, got = await self._settle(keys=[self.keys.episode_group(group), self.keys.buffer_counts],
                                        args=[data, counted])
        return bool(fixed), _stats(str(got))


def _stats(raw: str) -> GroupStats | None:
    data: dict[str, Any] | None = json.loads(raw)
    return None if data is None else GroupStats(**data)
