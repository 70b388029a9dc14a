"""Capture: pair each main-line response with its next state and emit it as a `Turn`.

Per request (docs/design.md#pairing-a-turn-with-its-next-state):

1. `begin` — before the engine call, one Redis round trip: close the pending turn of
   every prefix of the request that ends on an assistant message, or when that rule
   knows nothing of the last one, the turn its anchors name (see pairing.py), and GET
   the lineage of the last one. Closing a turn emits it in the same atomic script
   (pending_store.py): its next state is what follows it in this request. The latest
   one's PromptCache makes tokenization incremental; its session id and turn index
   carry over to the new turn (the lineage does so for a branch whose parent was closed).
2. `finish` — after the response is built and before it is returned, the new turn is
   stored as pending (bounded by the Redis timeout, so the client's follow-up cannot
   outrun it), or emitted with no next state when the request said `X-Session-Done: 1`.
3. A sweeper closes and emits pending turns past their deadline with no next state
   (closed_by ttl), with the same script, so it is safe on every replica.

A group — the n choices of one completion (`n > 1`) — is stored by `finish_group` as n
pending turns in one round trip (`group_records`): closing the one a follow-up continues
closes its siblings in the same script, as GROUP_UNCHOSEN says (pending_store.py).

No turn a client received is ever only in this process's memory: it is in Redis
(pending, or on `turns`) or in the spool file before the response goes out, so a
SIGKILL at any moment loses none (tests/faults).

Two Redis clients: the request path's (lookup, pending write) fails within
`redis_timeout_s`; background work (publishing turns, sweeping, replaying the spool)
allows `redis_background_timeout_s`, so a briefly slow Redis does not disturb it.

Redis unreachable. Nothing on the request path waits longer than `redis_timeout_s`. A
refused or dropped connection, or `SLOW_STRIKES` request-path timeouts in a row, switch
capture to *spooling* (DOWN): turns and pending-turn writes go to the local spool file
(spool.py), and pending turns are also kept in a bounded in-memory map, so a
conversation that continues on this replica still pairs during the outage (one that
moves to another replica does not: its turn later expires). Closing one of those also
spools a `closed` marker, so its pending write is not replayed. A background probe
pings Redis every `redis_retry_s`; once it answers, the spool is replayed (RECOVERING:
lookups use Redis and the map, writes still spool) and capture returns to Redis (UP).
A single timeout only degrades its own operation: a lookup pairs nothing, a pending
write is spooled and replayed (if it had landed after all, the replay rewrites it; a
turn emitted twice has the same id, and consumers deduplicate by id). Branch lineage
is not kept through an outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.collector import metrics as M
from services.collector.pairing import AnchorIndex, Candidate, Offer, next_state
from services.collector.pending_store import SWEEP_BATCH, Closed, KeyValue, PendingStore
from services.collector.settings import CollectorConfig
from services.collector.spool import Op, Spool
from shared import keys as K
from shared.chat import PromptCache
from shared.errors import BusError
from shared.schemas import Turn
from shared.streams import Bus

log = logging.getLogger(__name__)

FAILURES = (RedisError, BusError, OSError, asyncio.TimeoutError)
SLOW_STRIKES = 3  # request-path timeouts in a row that count as Redis being down


def _is_timeout(exc: BaseException) -> bool:
    cause = exc.__cause__ if isinstance(exc, BusError) else exc
    return isinstance(cause, (asyncio.TimeoutError, RedisTimeoutError))


class State(enum.Enum):
    UP = "up"
    DOWN = "down"
    RECOVERING = "recovering"


@dataclass(frozen=True, slots=True)
class Lookup:
    """What a request learned from the turns it follows up."""

    cache: PromptCache | None = None
    session_id: str | None = None
    conversation: str | None = None  # of the turn it continues: a retry of one replaces it
    turn_index: int = 0  # of the new turn
    closed: int = 0
    paired_by: str | None = None  # the anchor kind that closed the last response's turn
    refused: bool = False  # a turn it continues could be several sessions': paired with none


@dataclass(frozen=True, slots=True)
class Held:
    record: str
    deadline: float
    lineage: str
    anchors: Sequence[str] = ()


def make_record(
    turn: Turn, cache: PromptCache, deadline: float, siblings: Sequence[str] | None = None,
    same: Sequence[str] = (), conversation: str | None = None,
) -> tuple[str, str]:  # fmt: skip
    """(record, lineage): three JSON lines — header, PromptCache, Turn without prompt_ids
    (they are the cache's ids) — so a request parses only the first two. A group member's
    header also lists the pending hashes of its `siblings` and of its twins (`same`). The
    lineage names the turn's `conversation` when it is not its session id (pending_store.py:
    two conversations' very same turn is neither's)."""
    info: dict[str, Any] = {"deadline": deadline, "session_id": turn.session_id,
                            "turn_index": turn.turn_index}  # fmt: skip
    if conversation is not None and conversation != turn.session_id:
        info["conversation"] = conversation
    lineage = json.dumps(info, separators=(",", ":"))
    header = lineage
    if siblings is not None:
        header = json.dumps({**info, "siblings": list(siblings), "same": list(same)},
                            separators=(",", ":"))  # fmt: skip
    # Closing appends these three (pending_store.py); the ids are the cache's.
    body = turn.model_dump_json(exclude={"prompt_ids", "next_state", "closed_by"})
    return f"{header}\n{cache.to_json()}\n{body}", lineage


def group_records(
    turns: Sequence[Turn], cache: PromptCache, keys: Sequence[str], deadline: float,
    anchors: Sequence[Sequence[str]] = (), conversation: str | None = None,
) -> list[tuple[str, Held]]:  # fmt: skip
    """The pending (hash, record) of each member of a group. `keys[i]` is choice i's
    response hash (`anchors[i]`: its anchors); a choice identical to an earlier one (same
    hash) is its twin, stored under `<hash>.<index>` where no request looks, and closed
    with it (it registers no anchors: they are its holder's)."""
    stored = [key if key not in keys[:i] else f"{key}.{i}" for i, key in enumerate(keys)]
    out = []
    for i, (turn, key) in enumerate(zip(turns, keys, strict=True)):
        if stored[i] == key:  # it holds its hash: a request continuing it finds it
            siblings = [s for s, k in zip(stored, keys, strict=True) if k != key]
            same = [s for j, (s, k) in enumerate(zip(stored, keys, strict=True)) if k == key and j != i]
            record, lineage = make_record(turn, cache, deadline, siblings, same, conversation)
            mine = anchors[i] if anchors else ()
        else:  # a twin: closed by the one holding its hash, or expired
            record, lineage = make_record(turn, cache, deadline, conversation=conversation)
            mine = ()
        out.append((stored[i], Held(record, deadline, lineage, mine)))
    return out


def group_of(record: str) -> tuple[list[str], list[str]]:
    """(siblings, twins) named in a pending record's header; empty for a lone turn."""
    header = json.loads(record.split("\n", 1)[0])
    return list(header.get("siblings", ())), list(header.get("same", ()))


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def closed_turn(
    record: str, closed_by: str, state: list[dict[str, Any]] | None, ids: list[int] | None = None
) -> str:
    """The Turn JSON a pending record becomes once closed."""
    _, cache_json, body = record.split("\n", 2)
    d = orjson.loads(body)
    d["prompt_ids"] = ids if ids is not None else orjson.loads(cache_json)["ids"]
    d["next_state"] = state
    d["closed_by"] = closed_by
    return orjson.dumps(d).decode()


class Capture:
    """`bus` (its client: background timeouts) publishes turns; `fast` serves the request path."""

    def __init__(self, cfg: CollectorConfig, bus: Bus, spool: Spool, fast: Any) -> None:
        self.cfg = cfg
        self.bus = bus
        self.spool = spool
        bound = bus.streams.maxlen
        self.fast = PendingStore(fast, bus.keys, cfg.pending_ttl_s, bound, cfg.group_unchosen)
        self.store = PendingStore(bus.redis, bus.keys, cfg.pending_ttl_s, bound, cfg.group_unchosen)
        self.timeout = cfg.redis_timeout_s
        self.slow_timeout = cfg.redis_background_timeout_s
        self._strikes = 0
        self.state = State.RECOVERING if spool.has_data() else State.UP
        self._local: OrderedDict[str, Held] = OrderedDict()
        self._local_anchors = AnchorIndex(8 * max(1, cfg.fallback_max_pending))  # of the held turns
        self._closed_here: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self.sweeps = 0  # sweeps completed (nextstate_collector_sweeps_total, per instance)
        M.REDIS_UP.set(1 if self.state is State.UP else 0)

    # -- the request path ------------------------------------------------------------

    async def begin(self, messages: list[dict[str, Any]], cands: Sequence[Candidate],
                    offer: Offer | None = None, scoped: bool = False) -> Lookup:  # fmt: skip
        """Close the pending turns this request follows up; what the new turn inherits.
        `offer`: the anchors of its last assistant message (`cands[-1]`'s), tried when
        the prefix rule knows nothing of it (`scoped` to a session id: also when the prefix
        rule saw that very conversation in two sessions)."""
        if not cands:
            return Lookup()
        keys = [c.key for c in cands]
        states = [next_state(messages, c.end) for c in cands]
        anchors = [a.key for a in offer.anchors] if offer is not None else []
        records: list[str | None] = [None] * len(keys)
        lineage: str | None = None
        closed: Closed | None = None
        if self.state is not State.DOWN:
            try:
                async with asyncio.timeout(self.timeout):
                    closed, lineage = await self.fast.lookup(
                        keys, keys[-1], [_dumps(st) for st in states], anchors, scoped)
                self._strikes = 0
                records = closed.records
                emitted = sum(1 for r in records if r is not None) + (closed.via_record is not None)
                M.TURNS.labels("next_request").inc(emitted + closed.twins)
                M.TURNS.labels("unchosen").inc(closed.unchosen)
                M.PENDING.labels("unchosen_dropped").inc(closed.dropped)
                if closed.shed:
                    M.SHED.labels("stream_bound").inc(closed.shed)
                if closed.clashes and closed.via_record is None:
                    M.PAIRING_REFUSED.labels("same_conversation").inc(closed.clashes)
            except FAILURES as exc:
                self._failed(exc)
        via = closed.via if closed is not None else 0
        via_record = closed.via_record if closed is not None else None
        via_lineage = closed.via_lineage if closed is not None else None
        if self._local:
            for i, k in enumerate(keys):
                held = self._local.pop(k, None) if records[i] is None else None
                if held is not None:
                    records[i] = held.record
                    self._close_local(k, held, states[i])
                    if i == len(keys) - 1 and lineage is None:
                        lineage = held.lineage
            if via == 0 and records[-1] is None and lineage is None:
                via, via_record, via_lineage = self._anchor_local(anchors, states[-1])
            M.FALLBACK_PENDING.set(len(self._local))
        found = [r for r in records if r is not None]
        M.PAIRED.labels("prefix").inc(len(found))
        paired_by = offer.anchors[via - 1].kind if offer is not None and via > 0 and via_record else None
        if paired_by is not None:
            M.PAIRED.labels(paired_by).inc()
        elif via < 0:
            M.PAIRING_REFUSED.labels("ambiguous").inc()
        if via_record is not None:
            found.append(via_record)  # the last response's: the latest
        refused = via < 0 or (closed is not None and closed.clashes > 0 and via_record is None)
        if not found and lineage is None and via_lineage is None:
            return Lookup(refused=refused)
        cache: PromptCache | None = None
        header = "{}"
        if found:
            header, cache_json, _ = found[-1].split("\n", 2)
            cache = PromptCache.from_json(cache_json)
            M.PENDING.labels("closed").inc(len(found))
        info = json.loads(lineage or via_lineage or header)
        return Lookup(
            cache=cache,
            session_id=info.get("session_id"),
            conversation=info.get("conversation") or info.get("session_id"),
            turn_index=int(info.get("turn_index", -1)) + 1,
            closed=len(found),
            paired_by=paired_by,
            refused=refused,
        )

    def _anchor_local(
        self, anchors: Sequence[str], state: list[dict[str, Any]]
    ) -> tuple[int, str | None, str | None]:
        """The anchor rule over the turns held in memory (an outage): (via, record, lineage)
        as the close script answers them."""
        via, h = self._local_anchors.decide(anchors)
        held = self._local.pop(h, None) if h is not None else None
        if h is None or held is None:
            return via, None, None
        self._close_local(h, held, state)
        return via, held.record, held.lineage

    async def finish(self, turn: Turn, cache: PromptCache, key: str, extra: KeyValue | None = None,
                     anchors: Sequence[str] = (), conversation: str | None = None) -> bool:  # fmt: skip
        """Store the new turn as pending under `key` with its `anchors` (`conversation`: the
        one it belongs to, when not its session id: make_record), or emit it now if it ends
        its session. `extra` rides along with the pending write (one round trip); True when
        it was written."""
        if turn.closed_by == "session_done":  # emitted before the response goes out
            return await self._emit_now(turn.to_json(), extra)
        now = time.time()
        deadline = now + self.cfg.pending_ttl_s
        record, lineage = make_record(turn, cache, deadline, conversation=conversation)
        return await self._store([(key, Held(record, deadline, lineage, anchors))], deadline, now, extra)

    async def finish_group(self, turns: Sequence[Turn], cache: PromptCache, keys: Sequence[str],
                           anchors: Sequence[Sequence[str]] = (), conversation: str | None = None,
                           ) -> None:  # fmt: skip
        """The n members of a group (`keys[i]`: choice i's response hash, `anchors[i]` its
        anchors) as pending turns that close together (group_records), in one round trip;
        or emitted now if the request ended its session."""
        if turns[0].closed_by == "session_done":
            await asyncio.gather(*(self._emit_now(t.to_json(), None) for t in turns))
            return
        now = time.time()
        deadline = now + self.cfg.pending_ttl_s
        await self._store(group_records(turns, cache, keys, deadline, anchors, conversation), deadline, now, None)

    async def _store(self, entries: list[tuple[str, Held]], deadline: float, now: float,
                     extra: KeyValue | None) -> bool:  # fmt: skip
        M.PENDING.labels("stored").inc(len(entries))
        if self.state is State.UP:
            try:
                async with asyncio.timeout(self.timeout):
                    items = [(key, held.record, held.lineage, held.anchors) for key, held in entries]
                    collided = await self.fast.put_many(items, deadline, now, extra)
                if collided:
                    M.PENDING.labels("same_conversation").inc(collided)
                self._strikes = 0
                return True
            except FAILURES as exc:
                self._failed(exc)
            if self.state is State.UP:  # slow, not down: replay the write later
                for key, held in entries:
                    self._spool_pending(key, held)
                return False
        for key, held in entries:
            self._hold(key, held)
        return False

    # -- emitting ------------------------------------------------------------------------

    async def _emit_now(self, data: str, extra: KeyValue | None) -> bool:
        """Publish a turn that ends its session, with `extra` in the same round trip (True
        when both went), or spool it (a timeout too: the replay's duplicate, if the first
        one landed after all, has the same id and is dropped downstream)."""
        if self.state is State.UP:
            try:
                async with asyncio.timeout(self.timeout):
                    added = await self.fast.publish(data, extra)
                self._strikes = 0
                M.TURNS.labels("session_done").inc()
                if not added:
                    M.SHED.labels("stream_bound").inc()
                return extra is not None
            except FAILURES as exc:
                self._failed(exc)
        self._spool_turn(data, "session_done")
        return False

    def _spool_turn(self, data: str, closed_by: str) -> None:
        M.TURNS.labels(closed_by).inc()
        self._spool({"op": "turn", "data": data})

    # -- outage: spool and in-memory fallback --------------------------------------------

    def _failed(self, exc: BaseException) -> None:
        """A request-path failure: down at once if Redis refused or dropped us, else only
        after SLOW_STRIKES timeouts in a row."""
        if _is_timeout(exc):
            self._strikes += 1
            if self._strikes < SLOW_STRIKES:
                M.REDIS_ERRORS.inc()
                log.debug("Redis slow on the request path (%s in a row)", self._strikes)
                return
        self._down(exc)

    def _down(self, exc: BaseException) -> None:
        M.REDIS_ERRORS.inc()
        self._strikes = 0
        if self.state is not State.DOWN:
            log.warning(
                "Redis unreachable: capture spools to %s until it answers (%s)",
                self.spool.path, type(exc).__name__ + (f": {exc}" if str(exc) else ""),
            )
            self.state = State.DOWN
            M.REDIS_UP.set(0)

    def _spool(self, op: Op) -> None:
        if self.spool.append(op):
            M.SPOOLED.labels(op["op"]).inc()
        else:
            M.SHED.labels("spool_full").inc()
            log.warning("spool full, capture operation shed", extra={"op": op["op"],
                        "max_bytes": self.spool.max_bytes})  # fmt: skip

    def _hold(self, key: str, held: Held) -> None:
        if self.cfg.fallback_max_pending:
            self._local[key] = held
            while len(self._local) > self.cfg.fallback_max_pending:
                self._local.popitem(last=False)  # still in the spool: it reaches Redis later
            self._local_anchors.register(key, held.anchors)
            M.FALLBACK_PENDING.set(len(self._local))
        self._spool_pending(key, held)

    def _spool_pending(self, key: str, held: Held) -> None:
        op: Op = {"op": "pending", "h": key, "record": held.record, "deadline": held.deadline,
                  "lineage": held.lineage}  # fmt: skip
        if held.anchors:
            op["anchors"] = list(held.anchors)
        self._spool(op)

    def _close_local(self, key: str, held: Held, state: list[dict[str, Any]]) -> None:
        """Close a turn held in memory (an outage) and, as the close script does, its group
        siblings held here too. Siblings already in Redis are left to expire there."""
        self._closed_locally(key)
        self._spool_turn(closed_turn(held.record, "next_request", state), "next_request")
        siblings, twins = group_of(held.record)
        mode = self.cfg.group_unchosen
        for other, twin in [*((t, True) for t in twins), *((s, False) for s in siblings)]:
            sib = self._local.pop(other, None)
            if sib is None:
                continue
            self._closed_locally(other)
            if twin:
                self._spool_turn(closed_turn(sib.record, "next_request", state), "next_request")
            elif mode == "drop":
                M.PENDING.labels("unchosen_dropped").inc()
            else:
                self._spool_turn(closed_turn(sib.record, "unchosen", state if mode == "judge" else None),
                                 "unchosen")  # fmt: skip

    def _closed_locally(self, key: str) -> None:
        self._closed_here.add(key)
        self._spool({"op": "closed", "h": key})

    # -- background: sweeping, probing, flushing -------------------------------------------

    async def run(self) -> None:
        """Until `stop()`: sweep expired turns; while Redis is away, probe it and flush."""
        while not self._stop.is_set():
            try:
                if self.state is State.UP:
                    await self._sweep()
                    if self.spool.has_data():  # writes that timed out while Redis was up
                        await self._recover()
                else:
                    await self._recover()
                self._sweep_local()
            except Exception:
                log.exception("capture background step failed")
            wait = self.cfg.sweep_interval_s if self.state is State.UP else self.cfg.redis_retry_s
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), wait)

    def stop(self) -> None:
        self._stop.set()

    async def _sweep(self) -> None:
        for _ in range(16):
            try:
                won, shed = await asyncio.wait_for(self.store.expire(time.time()), self.slow_timeout)
            except FAILURES as exc:
                self._down(exc)
                return
            M.PENDING.labels("expired").inc(won)
            M.TURNS.labels("ttl").inc(won)
            if shed:
                M.SHED.labels("stream_bound").inc(shed)
            if won < SWEEP_BATCH:
                break
        self.sweeps += 1
        M.SWEEPS.inc()

    def _sweep_local(self) -> None:
        now = time.time()
        while self._local:
            key, held = next(iter(self._local.items()))
            if held.deadline > now:
                break
            self._local.popitem(last=False)
            self._closed_locally(key)
            M.PENDING.labels("expired").inc()
            self._spool_turn(closed_turn(held.record, "ttl", None), "ttl")
        M.FALLBACK_PENDING.set(len(self._local))

    async def _recover(self) -> None:
        try:
            await asyncio.wait_for(self.bus.ping(), self.slow_timeout)
        except FAILURES:
            return
        if self.state is State.DOWN:
            self.state = State.RECOVERING
        if await self._flush() and not self.spool.has_data() and self.state is State.RECOVERING:
            self.state = State.UP
            self._closed_here.clear()
            self._local_anchors.clear()  # replayed with their turns: Redis holds them now
            M.REDIS_UP.set(1)
            log.info("Redis answers again: spool replayed, capture back on Redis")

    async def _flush(self) -> bool:
        """Replay the spool into Redis, oldest first; False if Redis failed again."""
        while ops := self.spool.take():
            closed = {op["h"] for op in ops if op["op"] == "closed"}
            for i, op in enumerate(ops):
                kind = op["op"]
                try:
                    await self._replay(op, closed)
                except FAILURES as exc:
                    self.spool.settle(ops[i:])
                    self._down(exc)
                    return False
                M.FLUSHED.labels(kind).inc()
            self.spool.settle([])
        return True

    async def _replay(self, op: Op, closed: set[str]) -> None:
        kind = op["op"]
        if kind == "turn":
            entry = await asyncio.wait_for(self.bus.publish_raw(K.TURNS, op["data"]), self.slow_timeout)
            if entry is None:
                M.SHED.labels("stream_bound").inc()
        elif kind == "pending":
            key = op["h"]
            if key in closed or key in self._closed_here:
                return
            # Claimed before the write: a request can no longer close it from memory,
            # so it is closed at most once (from Redis, once written).
            held = self._local.pop(key, None)
            try:
                await asyncio.wait_for(self.store.put(
                    key, op["record"], float(op["deadline"]), op["lineage"], time.time(),
                    anchors=op.get("anchors", ()),
                ), self.slow_timeout)  # fmt: skip
            except FAILURES:
                if held is not None:
                    self._local[key] = held
                raise
        elif kind == "closed":
            await asyncio.wait_for(self.store.drop([op["h"]]), self.slow_timeout)

    # -- tasks ------------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("capture task failed", exc_info=task.exception())

    async def drain(self, timeout: float) -> None:
        """At shutdown: let in-flight emissions finish; one last flush if Redis answers."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        if self.state is not State.UP and self.spool.has_data():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._recover(), timeout)
        self.spool.close()
