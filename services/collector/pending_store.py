"""Pending turns in Redis: store, close at most once, and expire — safe with many replicas.

Layout (names from `shared.keys`):

    pending:<hash>        the pending record (JSON: deadline, PromptCache, Turn so far),
                          Redis TTL = pending TTL + grace, so a stopped sweeper leaks nothing
    pending-deadlines     sorted set: <hash> scored by the turn's deadline (unix seconds)
    lineage:<hash>        {"session_id", "turn_index"} of the response ending that prefix

Closing a pending turn *is* emitting it: one Lua script takes the record, deletes it
and adds the finished Turn to the `turns` stream (its next state and `closed_by`
appended to the stored JSON), so there is no moment when a turn has left `pending:`
but not reached `turns` — a collector SIGKILLed at any point loses none. Whichever
replica's request (or sweeper) runs the script first emits the turn; every other one
finds nothing. The stream's bound applies as in shared/streams.py: over it, the turn is
shed and counted. Each method is one round trip; `put`/`put_many` and `publish` carry
one more key written with them (a stored Responses object), so storing it costs no round
trip of its own.

A group (the n choices of one completion) is n pending records, each under its own
response's hash; each one's header lists the others' hashes (`siblings`), and those of
choices identical to it (`same`: they share its hash, so a twin is stored under
`<hash>.<index>`, which no request looks up). Closing a member closes its still-pending
siblings in the same script — twins with its next state, the others as `unchosen` by
the collector's GROUP_UNCHOSEN — so exactly one member of a group is ever continued.
The script reaches the siblings' keys through the pending prefix it is given (they are
in no request's candidates); they match the collector's `pending:*` grant like the
declared ones. Expiry leaves siblings alone: each expires on its own deadline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

from shared.keys import FIELD, Keys
from shared.streams import BOUNDED_XADD

SWEEP_BATCH = 256
KeyValue = tuple[str, str | bytes, int]  # key, value, TTL in ms

# KEYS: turns, its shed counter, pending-deadlines, then pending:<hash> per candidate.
# ARGV: stream bound, entry field, closed_by, the pending keys' prefix, what to do with a
# group's unchosen siblings (keep | judge | drop; '' leaves them: expiry), then per
# candidate its hash, then per candidate its next-state JSON. For each record found:
# delete it, append prompt_ids (the PromptCache's ids, verbatim), next_state and
# closed_by to its Turn JSON, XADD it (or count it shed). A group member's header lists
# its siblings (and its identical twins, `same`): those still pending are closed with
# it — twins as it is, the others as unchosen (no next state, the same one, or deleted).
# Returns the records (false where none), then the number shed, unchosen siblings
# emitted, unchosen siblings dropped, twins emitted.
_CLOSE = """
local n = #KEYS - 3
local out = {}
local shed, unchosen, dropped, twins = 0, 0, 0, 0
local hashes = {}
local function emit(rec, state, closed_by)
  local a = string.find(rec, '\\n', 1, true)
  local b = string.find(rec, '\\n', a + 1, true)
  local ids = string.match(string.sub(rec, a + 1, b - 1), '"ids":(%b[])')
  local body = string.sub(rec, b + 1)
  local turn = string.sub(body, 1, -2) .. ',"prompt_ids":' .. ids .. ',"next_state":'
               .. state .. ',"closed_by":"' .. closed_by .. '"}'
  if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then
    redis.call('INCR', KEYS[2])
    shed = shed + 1
  else
    redis.call('XADD', KEYS[1], '*', ARGV[2], turn)
  end
  return string.sub(rec, 1, a - 1)
end
local function take(h)
  local rec = redis.call('GET', ARGV[4] .. h)
  if rec then
    redis.call('DEL', ARGV[4] .. h)
    redis.call('ZREM', KEYS[3], h)
  end
  return rec
end
for i = 1, n do
  hashes[i] = ARGV[5 + i]
  local rec = redis.call('GET', KEYS[3 + i])
  if rec then
    redis.call('DEL', KEYS[3 + i])
    local state = ARGV[5 + n + i]
    local header = emit(rec, state, ARGV[3])
    if ARGV[5] ~= '' and string.find(header, '"siblings"', 1, true) then
      local group = cjson.decode(header)
      for _, h in ipairs(group['same'] or {}) do
        local r = take(h)
        if r then emit(r, state, ARGV[3]); twins = twins + 1 end
      end
      for _, h in ipairs(group['siblings']) do
        local r = take(h)
        if r and ARGV[5] == 'drop' then
          dropped = dropped + 1
        elseif r then
          emit(r, ARGV[5] == 'judge' and state or 'null', 'unchosen')
          unchosen = unchosen + 1
        end
      end
    end
    out[i] = rec
  else
    out[i] = false
  end
end
if n > 0 then redis.call('ZREM', KEYS[3], unpack(hashes)) end
out[n + 1] = shed
out[n + 2] = unchosen
out[n + 3] = dropped
out[n + 4] = twins
return out
"""


def _set(kv: KeyValue) -> tuple[Any, ...]:
    key, value, px = kv
    return ("SET", key, value, "PX", px)


def connect(url: str, timeout: float, max_connections: int = 128) -> Any:
    """A Redis client whose every operation fails within `timeout` — waiting for one of
    its `max_connections`, connecting, reading — with no retries: an outage is handled
    by spooling, not by waiting."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=timeout, decode_responses=True,
        protocol=2, socket_connect_timeout=timeout, socket_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
    )  # fmt: skip
    return aioredis.Redis.from_pool(pool)  # closing the client closes its pool


@dataclass(frozen=True, slots=True)
class Closed:
    """What one run of the close script did."""

    records: list[str | None]  # per candidate: its pending record, None when there was none
    shed: int = 0  # turns not added: `turns` was over its bound
    unchosen: int = 0  # group siblings emitted as unchosen
    dropped: int = 0  # group siblings deleted (GROUP_UNCHOSEN=drop)
    twins: int = 0  # group members identical to a closed one, emitted with it

    @classmethod
    def of(cls, reply: Sequence[Any], n: int) -> Closed:
        shed, unchosen, dropped, twins = (int(x) for x in reply[n:n + 4])
        return cls([None if not r else str(r) for r in reply[:n]], shed, unchosen, dropped, twins)


class PendingStore:
    def __init__(self, redis: Any, keys: Keys, ttl_s: float, bound: int = 100_000,
                 unchosen: str = "keep") -> None:  # fmt: skip
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self.grace_s = max(60.0, ttl_s)
        self.bound = bound
        self.unchosen = unchosen  # keep | judge | drop: a closed group member's siblings
        self._close = redis.register_script(_CLOSE)
        self._publish = redis.register_script(BOUNDED_XADD)

    def key_ttl_ms(self, deadline: float, now: float) -> int:
        return max(1000, int((deadline - now + self.grace_s) * 1000))

    def _close_args(self, hashes: Sequence[str], closed_by: str, states: Sequence[str],
                    unchosen: str) -> tuple[list[str], list[Any]]:  # fmt: skip
        k = self.keys
        keys = [k.turns, k.shed(k.turns), k.pending_deadlines, *(k.pending_turn(h) for h in hashes)]
        return keys, [self.bound, FIELD, closed_by, k.pending_turn(""), unchosen, *hashes, *states]

    async def lookup(
        self, hashes: Sequence[str], lineage_of: str | None, states: Sequence[str]
    ) -> tuple[Closed, str | None]:
        """Close and emit each candidate's pending turn (`states[i]`: its next state as
        JSON), and the siblings of a group member among them; GET the lineage of
        `lineage_of`. Returns (what was closed, lineage)."""
        keys, args = self._close_args(hashes, "next_request", states, self.unchosen)
        then = [] if lineage_of is None else [("GET", self.keys.turn_lineage(lineage_of))]
        out = await self._script_then(self._close, keys, args, then)
        lineage = None if lineage_of is None or out[-1] is None else str(out[-1])
        return Closed.of(out[0], len(hashes)), lineage

    async def put(self, h: str, record: str, deadline: float, lineage: str, now: float,
                  extra: KeyValue | None = None) -> None:  # fmt: skip
        """Store a pending turn; `extra` (key, value, TTL in ms) is one more key written in
        the same round trip (a stored Responses object)."""
        await self.put_many([(h, record, lineage)], deadline, now, extra)

    async def put_many(self, items: Sequence[tuple[str, str, str]], deadline: float, now: float,
                       extra: KeyValue | None = None) -> None:  # fmt: skip
        """Store pending turns (hash, record, lineage) of one deadline in one round trip:
        the n members of a group, or one turn (`put`)."""
        px = self.key_ttl_ms(deadline, now)
        pipe = self.redis.pipeline(transaction=False)
        for h, record, lineage in items:
            pipe.set(self.keys.pending_turn(h), record, px=px)
            pipe.set(self.keys.turn_lineage(h), lineage, px=px)
        pipe.zadd(self.keys.pending_deadlines, {h: deadline for h, _, _ in items})
        if extra is not None:
            pipe.set(extra[0], extra[1], px=extra[2])
        await pipe.execute()

    async def publish(self, turn: str, extra: KeyValue | None = None) -> bool:
        """Add a finished turn to `turns` (bounded: False when shed), with `extra` written in
        the same round trip."""
        k = self.keys
        keys, args = [k.turns, k.shed(k.turns)], [self.bound, FIELD, turn]
        if extra is None:
            return bool(await self._publish(keys=keys, args=args))
        out = await self._script_then(self._publish, keys, args, [_set(extra)])
        return bool(out[0])

    async def _script_then(self, script: Any, keys: list[str], args: list[Any],
                           then: list[tuple[Any, ...]]) -> list[Any]:  # fmt: skip
        """EVALSHA `script`, then the commands `then`, in one round trip. (redis-py's own
        pipeline asks SCRIPT EXISTS before every execute that holds a script: a second round
        trip each time. Here a server that lost the script answers NOSCRIPT, and the script is
        loaded and the whole pipeline sent again: nothing ran when EVALSHA failed, and the
        commands after it are reads or idempotent writes.)"""
        for attempt in (1, 2):
            pipe = self.redis.pipeline(transaction=False)
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            for command in then:
                pipe.execute_command(*command)
            out: list[Any] = await pipe.execute(raise_on_error=False)
            if isinstance(out[0], NoScriptError) and attempt == 1:
                script.sha = await self.redis.script_load(script.script)
                continue
            for item in out:
                if isinstance(item, Exception):
                    raise item
            return out
        raise AssertionError("unreachable")

    async def drop(self, hashes: Sequence[str]) -> None:
        """Delete pending turns that were closed elsewhere (replaying a spool)."""
        if not hashes:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(*[self.keys.pending_turn(h) for h in hashes])
        pipe.zrem(self.keys.pending_deadlines, *hashes)
        await pipe.execute()

    async def expire(self, now: float) -> tuple[int, int]:
        """Close and emit (no next state, closed_by ttl) pending turns past their deadline;
        returns (how many this caller closed, how many of those were shed). A group
        member's siblings are left alone: they expire by their own deadline."""
        members = await self.redis.zrangebyscore(
            self.keys.pending_deadlines, "-inf", now, start=0, num=SWEEP_BATCH
        )
        if not members:
            return 0, 0
        keys, args = self._close_args(members, "ttl", ["null"] * len(members), "")
        closed = Closed.of(await self._close(keys=keys, args=args), len(members))
        return sum(1 for r in closed.records if r), closed.shed
