"""Pending turns in Redis: store, close at most once, and expire — safe with many replicas.

Layout (names from `shared.keys`):

    pending:<hash>        the pending record (JSON: deadline, PromptCache, Turn so far),
                          Redis TTL = pending TTL + grace, so a stopped sweeper leaks nothing
    pending-deadlines     sorted set: <hash> scored by the turn's deadline (unix seconds)
    lineage:<hash>        {"session_id", "turn_index"[, "conversation"]} of the response
                          ending that prefix (`conversation`: when it is not the session id)
    anchor:<key>          the <hash> of the one turn that registered this pairing anchor, or
                          "*" once several did (pairing.py); the lineage's TTL

Closing a pending turn *is* emitting it: one Lua script takes the record, deletes it
and adds the finished Turn to the `turns` stream (its next state and `closed_by`
appended to the stored JSON), so there is no moment when a turn has left `pending:`
but not reached `turns` — a collector SIGKILLed at any point loses none. Whichever
replica's request (or sweeper) runs the script first emits the turn; every other one
finds nothing. The same script pairs by anchor when the prefix rule knows nothing of
the request's last response (pairing.py); `put` is a second script that stores a turn
with its lineage and registers its anchors (marking an anchor two turns hold ambiguous).
Two conversations can be the very same messages and get the very same answer (the same
system prompt and first message, an answer from a greedy policy): their turns share a
hash, and nothing in a follow-up's messages tells whose it is. The second such turn
neither overwrites the first nor pairs by prefix: both stay pending (the hash's lineage
is "*") and expire with no next state, unless a follow-up's anchors scoped to its
session id name one (the close script). A retry within one conversation replaces its
turn, as before; a conversation is one `X-Session-Id` (or `session_id`), or what a first
turn without one began: a first request retried without one is two conversations here,
whatever else (an agent's session id, a `user`) it carries. The stream's bound applies as in shared/streams.py: over it, the turn is shed
and counted. Each method is one round trip; `put`/`put_many` and `publish` carry one more
key written with them (a stored Responses object), so storing it costs no round trip of
its own.

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

# KEYS: turns, its shed counter, pending-deadlines, then pending:<hash> per candidate, then
# anchor:<key> per anchor of the last candidate's response (pairing.py), strongest first.
# ARGV: stream bound, entry field, closed_by, the pending keys' prefix, what to do with a
# group's unchosen siblings (keep | judge | drop; '' leaves them: expiry), the number of
# candidates n, the lineage keys' prefix ('' when expiring), then per candidate its hash,
# then per candidate its next-state JSON, then '1' when the anchors are scoped to a
# session id ('0' else). For each record found: delete it, append
# prompt_ids (the PromptCache's ids, verbatim), next_state and closed_by to its Turn JSON,
# XADD it (or count it shed). A group member's header lists its siblings (and its
# identical twins, `same`): those still pending are closed with it — twins as it is, the
# others as unchosen (no next state, the same one, or deleted). A candidate whose lineage
# is "*" (two sessions' turns of that very conversation: see _STORE) is left pending for
# expiry. When the last candidate has neither a pending record nor a lineage, the first
# anchor that exists decides: a hash, that turn is closed with the last candidate's next
# state; "*" (several turns), none. Scoped anchors decide also where the last candidate's
# lineage is "*", and may name a hash whose lineage is: only turns of this request's
# session registered them, so the very conversation of two sessions is told apart by
# whose follow-up it is. Returns the records (false where none), then the
# number shed, unchosen siblings emitted, unchosen siblings dropped, twins emitted; then
# the anchor that decided (its 1-based index, negative when ambiguous, 0 for none), the
# record it closed, the hash it named and that hash's lineage; then 1 if the last
# candidate was left pending for a "*" lineage, else 0.
_CLOSE = """
local n = tonumber(ARGV[6])
local m = #KEYS - 3 - n
local scoped = ARGV[8 + 2 * n] == '1'
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
local function close(rec, state)
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
end
local clashes = 0
for i = 1, n do
  local rec = redis.call('GET', KEYS[3 + i])
  if rec and ARGV[7] ~= '' and redis.call('GET', ARGV[7] .. ARGV[7 + i]) == '*' then
    rec = false  -- two sessions' turns of this very conversation: neither is continued
    if i == n then clashes = 1 end
  else
    hashes[#hashes + 1] = ARGV[7 + i]
  end
  if rec then
    redis.call('DEL', KEYS[3 + i])
    close(rec, ARGV[7 + n + i])
    out[i] = rec
  else
    out[i] = false
  end
end
if #hashes > 0 then redis.call('ZREM', KEYS[3], unpack(hashes)) end
local via, via_rec, via_h, via_lineage = 0, false, false, false
local function unknown(h)  -- no lineage (or, scoped, the "*" of two sessions' very conversation)
  local v = redis.call('GET', ARGV[7] .. h)
  return not v or (scoped and v == '*')
end
if m > 0 and not out[n] and unknown(ARGV[7 + n]) then
  for i = 1, m do
    local v = redis.call('GET', KEYS[3 + n + i])
    if v == '*' then
      via = -i
      break
    elseif v then
      via, via_h = i, v
      break
    end
  end
  if via > 0 then
    via_lineage = redis.call('GET', ARGV[7] .. via_h)
    if via_lineage == '*' and not scoped then
      via, via_h, via_lineage = -via, false, false
    else
      if via_lineage == '*' then via_lineage = false end
      via_rec = take(via_h)
      if via_rec then close(via_rec, ARGV[7 + 2 * n]) end
    end
  end
end
out[n + 1] = shed
out[n + 2] = unchosen
out[n + 3] = dropped
out[n + 4] = twins
out[n + 5] = via
out[n + 6] = via_rec
out[n + 7] = via_h
out[n + 8] = via_lineage
out[n + 9] = clashes
return out
"""

# KEYS: pending-deadlines, then anchor:<key> per anchor, item by item. ARGV: the keys' TTL
# in ms, the pending keys' prefix, the lineage keys' prefix, the number of items, then per
# item its hash, record, lineage, deadline and number of anchors. Each record is stored
# under its hash, with its lineage, its deadline and its anchors (an anchor nobody holds,
# or this hash holds, names this hash; one another hash holds becomes "*" for the rest of
# its lifetime, which every write renews) — unless a live turn of *another conversation*
# holds the hash (the same messages and answer, word for word; a lineage's `conversation`,
# else its `session_id`, says which): then the hash's lineage becomes "*", so that no
# request closes or inherits either turn by prefix, and the record is stored under
# <hash>#<its sha1>, where only the sweeper and its own scoped anchors find it. Returns
# how many collided.
_STORE = """
local px = ARGV[1]
local n = tonumber(ARGV[4])
local a = 1
local collided = 0
local function whose(info)
  local d = cjson.decode(info)
  return d['conversation'] or d['session_id']
end
for i = 0, n - 1 do
  local at = 5 + i * 5
  local h, rec, lineage, deadline = ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3]
  local target = h
  local seen = redis.call('GET', ARGV[3] .. h)
  local cur = redis.call('GET', ARGV[2] .. h)
  local clash = seen == '*'
  if cur and not clash then
    local header = string.sub(cur, 1, string.find(cur, '\\n', 1, true) - 1)
    clash = whose(header) ~= whose(lineage)
  end
  if clash then
    collided = collided + 1
    target = h .. '#' .. redis.sha1hex(rec)
    redis.call('SET', ARGV[3] .. h, '*', 'PX', px)
  else
    redis.call('SET', ARGV[3] .. h, lineage, 'PX', px)
  end
  redis.call('SET', ARGV[2] .. target, rec, 'PX', px)
  redis.call('ZADD', KEYS[1], deadline, target)
  for _ = 1, tonumber(ARGV[at + 4]) do
    local v = redis.call('GET', KEYS[1 + a])
    if v and v ~= target then
      redis.call('SET', KEYS[1 + a], '*', 'PX', px)
    else
      redis.call('SET', KEYS[1 + a], target, 'PX', px)
    end
    a = a + 1
  end
end
return collided
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
    via: int = 0  # the anchor that decided: its 1-based index, -index when ambiguous, 0: none
    via_record: str | None = None  # the pending record it closed
    via_hash: str | None = None  # the pending hash it named
    via_lineage: str | None = None  # that hash's lineage
    clashes: int = 0  # 1: the last candidate is two sessions' very conversation, left pending

    @classmethod
    def of(cls, reply: Sequence[Any], n: int) -> Closed:
        shed, unchosen, dropped, twins, via = (int(x) for x in reply[n:n + 5])
        rec, h, lineage = (None if not x else str(x) for x in reply[n + 5:n + 8])
        return cls([None if not r else str(r) for r in reply[:n]], shed, unchosen, dropped, twins,
                   via, rec, h, lineage, int(reply[n + 8]))  # fmt: skip


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
        self._store = redis.register_script(_STORE)
        self._publish = redis.register_script(BOUNDED_XADD)

    def key_ttl_ms(self, deadline: float, now: float) -> int:
        return max(1000, int((deadline - now + self.grace_s) * 1000))

    def _close_args(self, hashes: Sequence[str], closed_by: str, states: Sequence[str],
                    unchosen: str, anchors: Sequence[str] = (), scoped: bool = False,
                    ) -> tuple[list[str], list[Any]]:  # fmt: skip
        k = self.keys
        keys = [k.turns, k.shed(k.turns), k.pending_deadlines, *(k.pending_turn(h) for h in hashes),
                *(k.pairing_anchor(a) for a in anchors)]  # fmt: skip
        lineage = "" if closed_by == "ttl" else k.turn_lineage("")  # expiry pairs nothing
        args = [self.bound, FIELD, closed_by, k.pending_turn(""), unchosen, len(hashes), lineage,
                *hashes, *states, "1" if scoped else "0"]  # fmt: skip
        return keys, args

    async def lookup(
        self, hashes: Sequence[str], lineage_of: str | None, states: Sequence[str],
        anchors: Sequence[str] = (), scoped: bool = False,
    ) -> tuple[Closed, str | None]:  # fmt: skip
        """Close and emit each candidate's pending turn (`states[i]`: its next state as
        JSON), and the siblings of a group member among them; when the last candidate has
        no pending turn and no lineage, the turn the first registered of `anchors` names
        (its response's, strongest first: pairing.py), with the last candidate's next
        state (`scoped` anchors: also where that lineage is two sessions', see _CLOSE);
        GET the lineage of `lineage_of`. Returns (what was closed, lineage)."""
        keys, args = self._close_args(hashes, "next_request", states, self.unchosen, anchors, scoped)
        then = [] if lineage_of is None else [("GET", self.keys.turn_lineage(lineage_of))]
        out = await self._script_then(self._close, keys, args, then)
        lineage = None if lineage_of is None or out[-1] in (None, "*") else str(out[-1])
        return Closed.of(out[0], len(hashes)), lineage

    async def put(self, h: str, record: str, deadline: float, lineage: str, now: float,
                  extra: KeyValue | None = None, anchors: Sequence[str] = ()) -> int:  # fmt: skip
        """Store a pending turn and register its `anchors`; `extra` (key, value, TTL in ms)
        is one more key written in the same round trip (a stored Responses object)."""
        return await self.put_many([(h, record, lineage, anchors)], deadline, now, extra)

    async def put_many(self, items: Sequence[tuple[str, str, str, Sequence[str]]], deadline: float,
                       now: float, extra: KeyValue | None = None) -> int:  # fmt: skip
        """Store pending turns (hash, record, lineage, anchors) of one deadline in one round
        trip — the n members of a group, or one turn (`put`) — with the lineage's TTL, each
        turn's anchors registered as naming it (the store script: an anchor another turn
        holds becomes ambiguous). A turn whose hash a live turn of another session holds
        makes both unpairable (see _STORE). Returns how many did."""
        k = self.keys
        px = self.key_ttl_ms(deadline, now)
        keys = [k.pending_deadlines, *(k.pairing_anchor(a) for _, _, _, anchors in items for a in anchors)]
        args: list[Any] = [px, k.pending_turn(""), k.turn_lineage(""), len(items)]
        for h, record, lineage, anchors in items:
            args += [h, record, lineage, deadline, len(anchors)]
        then = [] if extra is None else [_set(extra)]
        out = await self._script_then(self._store, keys, args, then)
        return int(out[0])

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
