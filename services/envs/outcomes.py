"""Publish an episode's `Outcome` on `outcomes` exactly once, whatever reruns its job.

rq runs a job at least once: a worker that dies after publishing, before rq records the
job finished, leaves it to be run again. So the publish is one script: it XADDs the
outcome only if no outcome of that job id was published before, and records the session
id it published under `keys.outcome_published(job_id)` in the same step (a Redis script
runs whole or not at all). A rerun checks that marker first (`published`) and ends at once.

The stream is bounded like every consumed stream (shared/streams.py): over `maxlen` the
outcome is shed — counted, nothing recorded — and `publish_once` raises `OutcomeShed`,
so the job fails and rq runs it again later (a new attempt) rather than losing it quietly.
"""

from __future__ import annotations

from typing import Any

from shared import keys as K
from shared.errors import BusError
from shared.schemas import Outcome
from shared.streams import PUBLISHED, SHED, Bus

MARKER_TTL_S = 30 * 24 * 3600  # episode ids never repeat: the marker only has to outlive reruns

# KEYS: stream, its shed counter, the job's marker. ARGV: bound, field, data, session id, ttl.
# Returns {1, entry id} published, {0, session id} published before, {-1, ''} shed.
_PUBLISH_ONCE = """
local before = redis.call('GET', KEYS[3])
if before then return {0, before} end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then
  redis.call('INCR', KEYS[2])
  return {-1, ''}
end
local id = redis.call('XADD', KEYS[1], '*', ARGV[2], ARGV[3])
redis.call('SET', KEYS[3], ARGV[4], 'EX', tonumber(ARGV[5]))
return {1, id}
"""


class OutcomeShed(BusError):
    """`outcomes` is over its bound: the outcome was not published (the job will be retried)."""


class OutcomePublisher:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._script = bus.redis.register_script(_PUBLISH_ONCE)

    async def published(self, job_id: str) -> str | None:
        """The session id an outcome of `job_id` was published for, if one was."""
        value: Any = await self.bus.redis.get(self.bus.keys.outcome_published(job_id))
        return value.decode() if isinstance(value, bytes) else value

    async def publish_once(self, outcome: Outcome) -> tuple[bool, str]:
        """(True, entry id) when this call published `outcome`; (False, the session id
        published before) when an outcome of its id was published already."""
        keys = self.bus.keys
        stream = keys.outcomes
        status, value = await self._script(
            keys=[stream, keys.shed(stream), keys.outcome_published(outcome.id)],
            args=[self.bus.streams.maxlen, K.FIELD, outcome.to_json(), outcome.session_id, MARKER_TTL_S],
        )
        text = value.decode() if isinstance(value, bytes) else str(value)
        if int(status) < 0:
            SHED.labels(K.OUTCOMES).inc()
            raise OutcomeShed(f"{stream} holds {self.bus.streams.maxlen} entries or more: outcome {outcome.id} "
                              "not published (raise NEXTSTATE_STREAMS__MAXLEN, or check the buffer consumes it)")
        if int(status) == 1:
            PUBLISHED.labels(K.OUTCOMES).inc()
            return True, text
        return False, text
