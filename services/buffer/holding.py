"""Scored turns held in Redis until their unit can be decided, and the sweep that decides them.

Two kinds of unit wait for something before their turns' rewards are known:

- an environment episode's session, for its Outcome (episodes.py);
- a chat group — the n choices of one completion (`n > 1`) — for its members' judged
  rewards, when the advantage is taken over the group (chat_groups.py).

Both keep the same things in Redis (each write one Lua script, so it is atomic and safe
under redelivery, restarts and several buffer replicas):

- **Held turns** (`turns(unit)`, turn id -> ScoredTurn JSON) and the **index** (a sorted
  set, unit -> when to look at it next). The invariant: a unit with held turns is in the
  index. Holding a turn adds the unit with its deadline, or *now* when the unit's ready
  key exists (the Outcome came; every member of the group came); releasing decided turns
  removes the unit only once none is left.
- **Claims**: a sweep takes a due unit by a compare-and-set of its score to a lease's end
  (one claimer wins); a buffer killed mid-decision leaves the unit to be claimed again
  when the lease ends. Turns leave the hash only after their decision (and batch) is
  written, so a crash loses none, and the ledger makes a repeated decision a no-op.
- **Group statistics**, fixed by the first to settle a group (`settle_stats`): every
  turn of the group is rewarded against the same numbers.

The sweep (`HeldSweep`) claims each due unit, asks the kind for its `plan` (drop them
all, with a reason; or reward each turn; or wait until a later time), and decides each
held turn: staleness measured now, the mode's rule on the planned reward, then the
ledger's `record` and the batcher. The at-least-one rule does not apply to held turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from prometheus_client import Counter
from redis.exceptions import RedisError

from services.buffer import metrics as M
from services.buffer.batcher import Batcher
from services.buffer.intake import STALE
from services.buffer.ledger import Ledger
from services.buffer.rewards import GroupStats, settle
from services.buffer.rules import build_sample, signal_missing, staleness
from services.buffer.settings import BufferConfig
from shared.errors import MalformedMessage
from shared.schemas import ScoredTurn
from shared.streams import Bus

log = logging.getLogger(__name__)

# KEYS: decisions, turns hash, index zset, ready key. ARGV: turn id, data, deadline, now,
# ttl, unit. Returns 2 held and its unit is ready, 1 held, 0 decided already.
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

# KEYS: index zset. ARGV: unit, score read, new score. Compare-and-set.
_CAS = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], 'XX', ARGV[3], ARGV[1])
return 1
"""

# KEYS: turns hash, index zset, ready key. ARGV: unit, score if turns are left (ignored
# when the unit is ready: then now), now, turn ids decided...
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

# KEYS: group hash, counts, then optionally a ready key to set. ARGV: stats JSON, counted
# outcome ('' for none), ttl of the ready key. The first to settle a group fixes its
# statistics (and counts it). Returns {1 if this call fixed them else 0, what is fixed}.
_SETTLE = """
local fixed = redis.call('HSETNX', KEYS[1], 'stats', ARGV[1])
if fixed == 1 and ARGV[2] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[2], 1) end
if KEYS[3] then redis.call('SET', KEYS[3], '1', 'EX', tonumber(ARGV[3])) end
return {fixed, redis.call('HGET', KEYS[1], 'stats')}
"""

HELD, HELD_DUE = 1, 2
GROUP_TOO_SMALL = "group_too_small"  # fewer than 2 members of a group have a reward


@dataclass(frozen=True)
class GroupEntry:
    """One member of a group: an episode's outcome, or a chat group's choice (`failed`:
    it has no reward to compare, an episode that errored or a choice nobody judged)."""

    session_id: str
    reward: float
    failed: bool


@dataclass(frozen=True)
class Group:
    """A group's members so far, when its wait began, and its statistics if settled
    (`stats` None with `settled`: too few members with a reward to take any)."""

    entries: dict[int, GroupEntry]
    first: float | None
    settled: bool
    stats: GroupStats | None


@dataclass(frozen=True)
class Wait:
    """Not yet: the unit's group is still coming, until `until` at the latest."""

    until: float


def group_settlement(group: Group, size: int, now: float, wait_s: float) -> GroupStats | Wait | None:
    """What to fix for a group not settled yet: its statistics once all `size` members
    came (or partial ones once its wait ran out), None with fewer than 2 members with a
    reward (not failed), or Wait while it may still fill."""
    complete = len(group.entries) >= size
    deadline = (group.first if group.first is not None else now) + wait_s
    if not complete and now < deadline:
        return Wait(deadline)
    return settle([e.reward for e in group.entries.values() if not e.failed], partial=not complete)


def group_kind(stats: GroupStats | None) -> str:
    """A settled group's label in the groups metrics."""
    return "too_small" if stats is None else "partial" if stats.partial else "complete"


class HeldTurns:
    """The held turns of one kind of unit: `index` its sorted set, `turns(unit)` its hash,
    `ready(unit)` the key whose existence makes the unit due at once."""

    def __init__(self, bus: Bus, *, index: str, turns: Callable[[str], str],
                 ready: Callable[[str], str], held_ttl_s: int) -> None:  # fmt: skip
        self.bus = bus
        self.keys = bus.keys
        self.index = index
        self.turns = turns
        self.ready = ready
        self.held_ttl_s = held_ttl_s
        r = bus.redis
        self._hold = r.register_script(_HOLD)
        self._cas = r.register_script(_CAS)
        self._release = r.register_script(_RELEASE)
        self._settle = r.register_script(_SETTLE)

    async def hold_turn(self, unit: str, scored: ScoredTurn, deadline: float, now: float) -> int:
        """Hold a turn until its unit is decided: HELD, HELD_DUE (the unit is ready) or 0
        (the turn is decided already)."""
        sid = scored.turn.session_id
        held = await self._hold(
            keys=[self.keys.session_decisions(sid), self.turns(unit), self.index, self.ready(unit)],
            args=[scored.turn.id, scored.to_json(), repr(deadline), repr(now), self.held_ttl_s, unit],
        )
        return int(held)

    async def due(self, now: float, limit: int) -> list[tuple[str, float]]:
        """(unit, score) of units to look at now, soonest first."""
        rows = await self.bus.redis.zrangebyscore(self.index, "-inf", now, start=0, num=limit, withscores=True)
        return [(str(m), float(s)) for m, s in rows]

    async def move(self, unit: str, score: float, to: float) -> bool:
        """Compare-and-set a unit's score (a claim, or a claimer handing it back)."""
        return bool(await self._cas(keys=[self.index], args=[unit, repr(score), repr(to)]))

    async def held(self, unit: str) -> dict[str, str]:
        raw = await self.bus.redis.hgetall(self.turns(unit))
        return {str(t): str(d) for t, d in raw.items()}

    async def release(self, unit: str, decided: list[str], left_at: float, now: float) -> None:
        """Forget decided turns; a unit with turns left is looked at again at `left_at`
        (now, if it is ready)."""
        await self._release(keys=[self.turns(unit), self.index, self.ready(unit)],
                            args=[unit, repr(left_at), repr(now), *decided])  # fmt: skip

    async def settle_stats(self, group_key: str, stats: GroupStats | None, counted: str,
                           ready: str | None = None, ttl: int = 0) -> tuple[bool, GroupStats | None]:  # fmt: skip
        """Fix a group's statistics (in `group_key`'s `stats` field) unless someone did
        first: (this call fixed them, the fixed ones). `counted`: the outcome counted in
        `buffer_counts` when it does. `ready`: a key set with them (for `ttl` seconds)."""
        data = json.dumps(None if stats is None else stats.__dict__)
        keys = [group_key, self.keys.buffer_counts, *([ready] if ready is not None else [])]
        fixed, got = await self._settle(keys=keys, args=[data, counted, ttl])
        return bool(fixed), parse_stats(str(got))


def parse_stats(raw: str) -> GroupStats | None:
    data: dict[str, Any] | None = json.loads(raw)
    return None if data is None else GroupStats(**data)


def read_group(raw: dict[str, str], prefix: str) -> Group:
    """A group hash: members `<prefix><index>` -> JSON {s: session, r: reward, e: failed},
    `first` (when its first member came), and `stats` once settled."""
    entries = {}
    for field, value in raw.items():
        if field.startswith(prefix):
            e = json.loads(value)
            entries[int(field[len(prefix):])] = GroupEntry(str(e["s"]), float(e["r"]), bool(e["e"]))
    first = float(raw["first"]) if "first" in raw else None
    stats = raw.get("stats")
    if stats is None:
        return Group(entries, first, False, None)
    return Group(entries, first, True, parse_stats(stats))


P = TypeVar("P")


class HeldSweep(ABC, Generic[P]):
    """Claims due units and decides their held turns by the kind's plan `P`."""

    kind = "held"  # the samples metric's label, and the logs' name for a unit

    def __init__(self, ledger: Ledger, batcher: Batcher, cfg: BufferConfig, store: HeldTurns,
                 held_metric: Counter) -> None:  # fmt: skip
        self.ledger = ledger
        self.batcher = batcher
        self.cfg = cfg
        self.store = store
        self.held_metric = held_metric
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()

    # -- what a kind says ---------------------------------------------------------------------
    @abstractmethod
    async def plan(self, unit: str, now: float) -> P | Wait:
        """How the unit's held turns are decided now, or when to look again."""

    @abstractmethod
    def drop_reason(self, plan: P) -> str | None:
        """Why every turn of the unit is dropped, or None."""

    @abstractmethod
    def reward(self, plan: P, scored: ScoredTurn) -> float:
        """The sample reward of one held turn."""

    # -- holding ----------------------------------------------------------------------------------
    async def hold_in(self, unit: str, scored: ScoredTurn) -> None:
        now = time.time()
        held = await self.store.hold_turn(unit, scored, now + self.cfg.outcome_wait_s, now)
        if held:
            self.held_metric.inc()
        if held == HELD_DUE:
            self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    # -- the sweep ---------------------------------------------------------------------------------
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
                log.warning("%s sweep failed, retrying", self.kind, extra={"error": str(exc)})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.cfg.outcome_sweep_s)
        if self._inflight:
            await asyncio.gather(*self._inflight.values(), return_exceptions=True)

    async def sweep(self) -> int:
        """Claim every due unit and start deciding it. Returns how many started."""
        now = time.time()
        started = 0
        for unit, score in await self.store.due(now, self.cfg.force_scan):
            if unit in self._inflight:
                continue
            lease_until = now + self.cfg.force_lease_s
            if not await self.store.move(unit, score, lease_until):
                continue  # another buffer took it, or it moved
            self._inflight[unit] = asyncio.create_task(self._decide(unit, lease_until))
            started += 1
        M.SWEEPS.labels(self.kind).inc()
        return started

    async def _decide(self, unit: str, lease_until: float) -> None:
        try:
            await self._decide_unit(unit, lease_until)
        except RedisError as exc:  # left under its lease: decided again once it ends
            log.warning("%s decision interrupted, will retry", self.kind,
                        extra={"unit": unit, "error": str(exc)})  # fmt: skip
        finally:
            self._inflight.pop(unit, None)

    async def _decide_unit(self, unit: str, lease_until: float) -> None:
        plan = await self.plan(unit, time.time())
        if isinstance(plan, Wait):  # its group is still coming: back until the group's deadline
            await self.store.move(unit, lease_until, plan.until)
            return
        held = await self.store.held(unit)
        results = await asyncio.gather(
            *(self._decide_turn(turn_id, data, plan) for turn_id, data in held.items()),
            return_exceptions=True)
        decided = [t for t, r in zip(held, results, strict=True) if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            log.warning("%s turns not decided, will retry", self.kind,
                        extra={"unit": unit, "turns": len(errors), "error": str(errors[0])})  # fmt: skip
            await self.store.release(unit, decided, lease_until, lease_until)
        else:
            now = time.time()
            await self.store.release(unit, decided, now + self.cfg.outcome_wait_s, now)
        drop = self.drop_reason(plan)
        if drop is not None:
            log.info("%s turns dropped", self.kind, extra={"unit": unit, "reason": drop, "turns": len(decided)})

    async def _decide_turn(self, turn_id: str, data: str, plan: P) -> None:
        cfg = self.cfg
        try:
            scored = ScoredTurn.from_json(data)
        except MalformedMessage as exc:
            log.error("unreadable held turn dropped", extra={"turn_id": turn_id, "error": str(exc)})
            return
        turn = scored.turn
        session_id = turn.session_id
        batched, trainer_version = await self.ledger.lookup(turn.id)
        if batched:
            return
        reason = self.drop_reason(plan)
        reward = 0.0 if reason is not None else self.reward(plan, scored)
        prior = await self.ledger.decision(session_id, turn.id)
        if prior is None:
            behind = staleness(scored, trainer_version)
            if behind is not None:
                M.STALENESS.observe(behind)
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
            M.SAMPLES.labels(self.kind).inc()
        elif prior != "kept":
            return  # decided (not kept) before a restart
        await self.batcher.add(build_sample(scored, cfg.mode, reward=reward))
