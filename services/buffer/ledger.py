"""What the buffer records in Redis: session sample sets, batched-turn marks, batch publishes.

Each operation is one Lua script, so it is atomic and safe under redelivery, restarts
and several buffer replicas:

- **Session samples** (`keys.session_samples(sid)`, a set of turn ids with a TTL): the
  number of samples a session produced is its cardinality. A set rather than a counter
  makes recording idempotent: a redelivered turn adds nothing. The at-least-one
  decision for a final turn counts the *other* members, so a redelivered forced turn is
  forced again instead of seeing itself and being dropped.
- **Batched marks** (`keys.sample_batched(turn_id)`): set in the same script
  that adds the batch to `batches`. A turn already marked is refused (reported back),
  so a sample can never be in two batches — whatever redelivers it, and whichever
  replica batches it first.
- **Decisions** (`keys.session_decisions(sid)`, turn id -> outcome; `keys.session_settled(sid)`,
  the turn indexes decided): every turn the buffer decides on is written once, and the
  operator's counters (`keys.buffer_counts`, outcome -> n) move only on that first write,
  so a redelivery never counts twice and `nextstate status` shows exact per-rule counts.
- **Force candidates** (`keys.force_candidates`, turn id scored by when it is due, and
  the parked ScoredTurn at `keys.force_candidate(turn id)`): a session's final turn that
  only the at-least-one rule could keep waits here until its earlier turns are decided
  (or its deadline passes), so the rule sees the whole session. Claiming one is a
  compare-and-set on its score (one claimer wins, across replicas); the claim is a
  lease, so a buffer killed mid-decision leaves it to be claimed again.
"""

from __future__ import annotations

import json
import time
from typing import Any

from services.buffer.batcher import Outcome
from shared import keys as K
from shared.runs import RunMismatch
from shared.schemas import TrainBatch, TrainSample
from shared.settings import Settings
from shared.streams import PUBLISHED, SHED, Bus

# Marks "this turn id is in a published batch". A group name of its own keeps these
# apart from the consumer's per-message marks (keys.done(GROUP_BUFFER, message id)).

# Shared by the scripts below: write a turn's decision once, count it once, mark its
# index settled. KEYS[a] decisions, KEYS[b] settled, KEYS[c] counts.
_DECIDE_FN = """
local function decide(decisions, settled, counts, turn, index, outcome, ttl)
  if redis.call('HSETNX', decisions, turn, outcome) == 1 then
    redis.call('HINCRBY', counts, outcome, 1)
  end
  redis.call('SADD', settled, index)
  redis.call('EXPIRE', decisions, ttl)
  redis.call('EXPIRE', settled, ttl)
end
"""

# KEYS: session set, decisions, settled, counts. ARGV: turn id, eligible (1|0), minimum,
# ttl, index, outcome when not kept. Returns 1 kept, 2 kept by the at-least-one rule, 0 not kept.
_RECORD = _DECIDE_FN + """
local outcome
local result
if ARGV[2] == '1' then
  result, outcome = 1, 'kept'
else
  local others = redis.call('SCARD', KEYS[1]) - redis.call('SISMEMBER', KEYS[1], ARGV[1])
  if others < tonumber(ARGV[3]) then result, outcome = 2, 'forced' else result, outcome = 0, ARGV[6] end
end
if result > 0 then
  redis.call('SADD', KEYS[1], ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
end
decide(KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[5], outcome, ARGV[4])
return result
"""

# A turn that is not a sample. KEYS: decisions, settled, counts. ARGV: turn id, index, outcome, ttl.
_EXCLUDE = _DECIDE_FN + """
decide(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4])
return 1
"""

# Park a force candidate unless the turn is decided already. KEYS: decisions, candidates
# zset, candidate data. ARGV: turn id, due at, data, ttl. Returns 1 parked (or already
# parked: its due time and lease are kept), 0 already decided.
_PARK = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
redis.call('SET', KEYS[3], ARGV[3], 'EX', tonumber(ARGV[4]))
redis.call('ZADD', KEYS[2], 'NX', ARGV[2], ARGV[1])
return 1
"""

# Claim a candidate: compare-and-set its score from the one read to a lease's end.
# KEYS: candidates zset, candidate data. ARGV: turn id, score read, lease end.
# Returns the parked JSON, or false (someone else claimed it, or it is gone).
_CLAIM = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then return false end
local data = redis.call('GET', KEYS[2])
if not data then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return false
end
redis.call('ZADD', KEYS[1], 'XX', ARGV[3], ARGV[1])
return data
"""

# KEYS: settled set. ARGV: index k. 1 when every index 0..k-1 is settled.
_ANCESTORS_SETTLED = """
for i = 0, tonumber(ARGV[1]) - 1 do
  if redis.call('SISMEMBER', KEYS[1], tostring(i)) == 0 then return 0 end
end
return 1
"""

# KEYS[1] batches, KEYS[2] its shed counter, KEYS[3..] one batched mark per sample.
# ARGV: bound, field, data, mark ttl. Returns {'dup', i...} (0-based sample indexes
# already batched), {'shed'}, or {'ok', entry id}.
_PUBLISH = """
local dups = {}
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then dups[#dups + 1] = tostring(i - 3) end
end
if #dups > 0 then
  table.insert(dups, 1, 'dup')
  return dups
end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then
  redis.call('INCR', KEYS[2])
  return {'shed'}
end
local id = redis.call('XADD', KEYS[1], '*', ARGV[2], ARGV[3])
for i = 3, #KEYS do redis.call('SET', KEYS[i], '1', 'EX', tonumber(ARGV[4])) end
return {'ok', id}
"""

KEPT, FORCED, NOT_KEPT = 1, 2, 0


class Ledger:
    def __init__(self, bus: Bus, settings: Settings, session_ttl_s: int) -> None:
        self.bus = bus
        self.keys = bus.keys
        self.run = settings.run
        self.session_ttl_s = session_ttl_s
        self.mark_ttl_s = settings.streams.dedupe_ttl_s
        self.bound = settings.streams.maxlen
        self._record = bus.redis.register_script(_RECORD)
        self._exclude = bus.redis.register_script(_EXCLUDE)
        self._park = bus.redis.register_script(_PARK)
        self._claim = bus.redis.register_script(_CLAIM)
        self._settled = bus.redis.register_script(_ANCESTORS_SETTLED)
        self._publish = bus.redis.register_script(_PUBLISH)

    def mark_key(self, turn_id: str) -> str:
        return self.keys.sample_batched(turn_id)

    async def lookup(self, turn_id: str) -> tuple[bool, int | None]:
        """(turn already batched?, the trainer's committed version or None) in one round trip."""
        pipe = self.bus.redis.pipeline(transaction=False)
        pipe.exists(self.mark_key(turn_id))
        pipe.get(self.keys.trainer_version)
        batched, version = await pipe.execute()
        return bool(batched), parse_version(version)

    def _decision_keys(self, session_id: str) -> list[str]:
        k = self.keys
        return [k.session_decisions(session_id), k.session_settled(session_id), k.buffer_counts]

    async def record(
        self, session_id: str, turn_id: str, *, eligible: bool, minimum: int, index: int = 0,
        reason: str = "not_kept",
    ) -> int:
        """Count a sample for its session: KEPT, FORCED (at-least-one) or NOT_KEPT.

        The decision (kept, forced, or `reason` when not kept) is recorded and counted once.
        """
        result = await self._record(
            keys=[self.keys.session_samples(session_id), *self._decision_keys(session_id)],
            args=[turn_id, "1" if eligible else "0", minimum, self.session_ttl_s, index, reason],
        )
        return int(result)

    async def exclude(self, session_id: str, turn_id: str, index: int, reason: str) -> None:
        """Record that a turn is not a sample, and why (counted once)."""
        await self._exclude(keys=self._decision_keys(session_id),
                            args=[turn_id, index, reason, self.session_ttl_s])

    async def decision(self, session_id: str, turn_id: str) -> str | None:
        """What was decided for a turn (kept, forced, or why not), None if nothing yet."""
        got = await self.bus.redis.hget(self.keys.session_decisions(session_id), turn_id)
        return None if got is None else str(got)

    async def park(self, session_id: str, turn_id: str, data: str, due_at: float) -> bool:
        """Park a force candidate until `due_at`. False: the turn is decided already."""
        k = self.keys
        parked = await self._park(
            keys=[k.session_decisions(session_id), k.force_candidates, k.force_candidate(turn_id)],
            args=[turn_id, due_at, data, self.session_ttl_s],
        )
        return bool(parked)

    async def candidates(self, limit: int) -> list[tuple[str, float]]:
        """(turn id, due at or lease end) of parked candidates, soonest first."""
        rows = await self.bus.redis.zrange(self.keys.force_candidates, 0, limit - 1, withscores=True)
        return [(str(m), float(score)) for m, score in rows]

    async def claim(self, turn_id: str, score: float, lease_until: float) -> str | None:
        """The parked JSON if this caller won the candidate (held until `lease_until`)."""
        k = self.keys
        data = await self._claim(keys=[k.force_candidates, k.force_candidate(turn_id)],
                                 args=[turn_id, repr(score), lease_until])
        return None if data is None else str(data)

    async def unpark(self, turn_id: str) -> None:
        pipe = self.bus.redis.pipeline(transaction=True)
        pipe.zrem(self.keys.force_candidates, turn_id)
        pipe.delete(self.keys.force_candidate(turn_id))
        await pipe.execute()

    async def ancestors_settled(self, session_id: str, index: int) -> bool:
        """Every earlier turn (index 0..index-1) of the session is decided."""
        return bool(await self._settled(keys=[self.keys.session_settled(session_id)], args=[index]))

    async def claim_prefix(self) -> None:
        """This prefix holds one run's turns: claim it for ours, or refuse another run's."""
        mine = json.dumps({"run": self.run, "at": time.time()})
        await self.bus.redis.set(self.keys.run_owner, mine, nx=True)
        owner = json.loads(await self.bus.redis.get(self.keys.run_owner) or mine)
        if owner.get("run") != self.run:
            raise RunMismatch(
                f"Redis prefix {self.keys.prefix!r} holds the turns of run {owner.get('run')!r}, not "
                f"{self.run!r}: batching them would train one run on another's data. Give this run "
                f"its own prefix (NEXTSTATE_REDIS__PREFIX) or set NEXTSTATE_RUN={owner.get('run')}")

    async def counts(self) -> dict[str, int]:
        raw = await self.bus.redis.hgetall(self.keys.buffer_counts)
        return {str(k): int(v) for k, v in raw.items()}

    async def session_count(self, session_id: str) -> int:
        return int(await self.bus.redis.scard(self.keys.session_samples(session_id)))

    async def publish_batch(self, samples: list[TrainSample]) -> Outcome:
        """Add a TrainBatch of `samples` to `batches` and mark them batched, atomically."""
        batch = TrainBatch(run=self.run, samples=samples)
        stream = self.keys.batches
        reply: list[Any] = await self._publish(
            keys=[stream, self.keys.shed(stream), *(self.mark_key(s.id) for s in samples)],
            args=[self.bound, K.FIELD, batch.to_json(), self.mark_ttl_s],
        )
        kind = reply[0]
        if kind == "dup":
            return Outcome(already_batched=frozenset(samples[int(i)].id for i in reply[1:]))
        if kind == "shed":
            SHED.labels(K.BATCHES).inc()
            return Outcome()
        PUBLISHED.labels(K.BATCHES).inc()
        return Outcome(batch=batch)


def parse_version(raw: Any) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw)
    except (TypeError, ValueError):
        return None
