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
"""

from __future__ import annotations

from typing import Any

from services.buffer.batcher import Outcome
from shared import keys as K
from shared.schemas import TrainBatch, TrainSample
from shared.settings import Settings
from shared.streams import PUBLISHED, SHED, Bus

# Marks "this turn id is in a published batch". A group name of its own keeps these
# apart from the consumer's per-message marks (keys.done(GROUP_BUFFER, message id)).

# KEYS[1] session set. ARGV: turn id, eligible (1|0), minimum, ttl.
# Returns 1 kept, 2 kept by the at-least-one rule, 0 not kept.
_RECORD = """
if ARGV[2] == '1' then
  redis.call('SADD', KEYS[1], ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  return 1
end
local others = redis.call('SCARD', KEYS[1]) - redis.call('SISMEMBER', KEYS[1], ARGV[1])
if others < tonumber(ARGV[3]) then
  redis.call('SADD', KEYS[1], ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  return 2
end
return 0
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

    async def record(self, session_id: str, turn_id: str, *, eligible: bool, minimum: int) -> int:
        """Count a sample for its session: KEPT, FORCED (at-least-one) or NOT_KEPT."""
        result = await self._record(
            keys=[self.keys.session_samples(session_id)],
            args=[turn_id, "1" if eligible else "0", minimum, self.session_ttl_s],
        )
        return int(result)

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
