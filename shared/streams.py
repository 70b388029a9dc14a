"""The Redis-streams data plane: connect, publish with a bound, dead-letter, trim, inspect.

Services talk only through these streams (docs/design.md#stream-contracts). A message is one pydantic model
serialized as JSON in the entry's single `data` field. Publishing is bounded: when a
stream already holds `maxlen` entries the new one is *shed* — refused and counted (a
Prometheus counter and a Redis counter that `nextstate status` shows) — so a producer
on a user's request path never blocks on a backlog. Informational streams
(`checkpoints`, `policy`) are trimmed to their bound instead, and `dead` is never shed
or trimmed: a dead letter waits for an operator.

Consumers (shared/consumer.py) ack after their side effect; `trim_consumed` then drops
what every group has acknowledged, keeping the newest `retain` entries for `tail`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import Counter
from redis.exceptions import RedisError, ResponseError

from shared import keys as K
from shared.errors import BusError
from shared.keys import Keys
from shared.schemas import DeadLetter, Message
from shared.settings import Settings, StreamSettings

log = logging.getLogger(__name__)

PUBLISHED = Counter("nextstate_stream_published_total", "Messages added to a stream", ["stream"])
SHED = Counter(
    "nextstate_stream_shed_total", "Messages refused because the stream was over its bound",
    ["stream"],
)

# Streams nobody consumes in a group: trimmed to the bound (oldest first) rather than shed.
TRIMMED = frozenset({K.CHECKPOINTS, K.POLICY, K.EVALS, K.PROMOTIONS})
# Never shed, never trimmed: every dead letter waits for an operator.
UNBOUNDED = frozenset({K.DEAD})

# Atomic "add unless over the bound": one round trip, no race between XLEN and XADD.
BOUNDED_XADD = """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then
  redis.call('INCR', KEYS[2])
  return false
end
return redis.call('XADD', KEYS[1], '*', ARGV[2], ARGV[3])
"""

# Trim below min(safe id, oldest of the newest `retain`), all server-side. Runs only once
# the stream holds `slack` entries more than `retain`, so the scan is amortized.
_TRIM_CONSUMED = """
local retain = tonumber(ARGV[1])
if redis.call('XLEN', KEYS[1]) <= retain + tonumber(ARGV[4]) then return 0 end
local newest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', retain)
local oldest = newest[#newest][1]
local dash = string.find(oldest, '-')
local oms, oseq = tonumber(string.sub(oldest, 1, dash - 1)), tonumber(string.sub(oldest, dash + 1))
local sms, sseq = tonumber(ARGV[2]), tonumber(ARGV[3])
if oms < sms or (oms == sms and oseq < sseq) then sms, sseq = oms, oseq end
return redis.call('XTRIM', KEYS[1], 'MINID', sms .. '-' .. sseq)
"""


def connect(settings: Settings) -> aioredis.Redis:
    """An asyncio Redis client with the configured timeouts (text responses).

    The pool is blocking: past `max_connections` a command waits for a free connection
    (at most `socket_timeout`) instead of failing, so bursts of in-flight work queue up.
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis.url,
        max_connections=settings.redis.max_connections,
        timeout=settings.redis.socket_timeout,
        decode_responses=True,
        socket_connect_timeout=settings.redis.connect_timeout,
        socket_timeout=settings.redis.socket_timeout,
        health_check_interval=30,
        protocol=2,
    )
    return aioredis.Redis.from_pool(pool)  # closing the client closes its pool


class Bus:
    """One service's handle on the streams: a Redis client, the key names, the bounds."""

    def __init__(self, settings: Settings, client: aioredis.Redis | None = None) -> None:
        self.settings = settings
        self.streams: StreamSettings = settings.streams
        self.keys = Keys(settings.redis.prefix)
        # redis-py's annotations do not model decode_responses=True: replies are typed Any.
        self.redis: Any = client if client is not None else connect(settings)
        self._bounded_xadd = self.redis.register_script(BOUNDED_XADD)
        self._trim_script = self.redis.register_script(_TRIM_CONSUMED)

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def ping(self) -> None:
        await self.redis.ping()

    # -- publish ---------------------------------------------------------------------
    async def publish(self, stream: str, msg: Message, *, maxlen: int | None = None) -> str | None:
        """Add `msg` to `stream` (short name). Returns the entry id, or None if shed."""
        return await self.publish_raw(stream, msg.to_json(), maxlen=maxlen)

    async def publish_raw(self, stream: str, data: str, *, maxlen: int | None = None) -> str | None:
        key = self.keys.stream(stream)
        bound = maxlen if maxlen is not None else self.streams.maxlen
        try:
            if stream in UNBOUNDED:
                entry_id = await self.redis.xadd(key, {K.FIELD: data})
            elif stream in TRIMMED:
                entry_id = await self.redis.xadd(
                    key, {K.FIELD: data}, maxlen=bound, approximate=True
                )
            else:
                entry_id = await self._bounded_xadd(
                    keys=[key, self.keys.shed(key)], args=[bound, K.FIELD, data]
                )
        except RedisError as exc:
            raise BusError(f"could not publish to {key}: {exc}") from exc
        if entry_id is None:
            SHED.labels(stream).inc()
            log.warning("stream over its bound, message shed", extra={"stream": stream, "bound": bound})
            return None
        PUBLISHED.labels(stream).inc()
        return str(entry_id)

    # -- groups and dead letters -------------------------------------------------------
    async def ensure_group(self, stream: str, group: str) -> None:
        """Create `group` on `stream` (and the stream) if missing; reads start at the beginning."""
        try:
            await self.redis.xgroup_create(self.keys.stream(stream), group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def dead_letter(
        self, stream: str, group: str, entry_id: str, data: str, error: str,
        deliveries: int, consumer: str,
    ) -> None:
        """Move one entry to `dead` with its error, and ack it, atomically."""
        letter = DeadLetter(
            stream=stream, group=group, entry_id=entry_id, data=data, error=error[:2000],
            deliveries=deliveries, consumer=consumer,
        )
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(self.keys.dead, {K.FIELD: letter.to_json()})
        pipe.xack(self.keys.stream(stream), group, entry_id)
        await pipe.execute()

    # -- retention ------------------------------------------------------------------------
    async def trim_consumed(self, stream: str, retain: int = 10_000, slack: int | None = None) -> int:
        """Drop entries every group has acknowledged, keeping the newest `retain` anyway.

        Does nothing until the stream holds `slack` (default `retain`) more entries than
        `retain`. A stream without groups is left alone (nobody has consumed anything
        yet). Returns how many entries were removed.
        """
        key = self.keys.stream(stream)
        slack = retain if slack is None else slack
        if await self.redis.xlen(key) <= retain + slack:
            return 0
        groups = await self.redis.xinfo_groups(key)
        if not groups:
            return 0
        keep_from: list[tuple[int, int]] = []
        for g in groups:
            if int(g["pending"]) > 0:
                summary = await self.redis.xpending(key, g["name"])
                keep_from.append(_parse_id(summary["min"]))
            else:
                ms, seq = _parse_id(g["last-delivered-id"])
                keep_from.append((ms, seq + 1))
        safe = min(keep_from)
        removed = await self._trim_script(keys=[key], args=[retain, safe[0], safe[1], slack])
        return int(removed)

    # -- inspection (used by `nextstate status` and health checks) -------------------------
    async def stream_info(self, stream: str) -> dict[str, Any]:
        """Length, shed count and per-group pending / lag / consumers of one stream."""
        key = self.keys.stream(stream)
        length = await self.redis.xlen(key)
        shed = int(await self.redis.get(self.keys.shed(key)) or 0)
        groups_out = []
        groups = await self.redis.xinfo_groups(key) if length or await self.redis.exists(key) else []
        for g in groups:
            consumers = await self.redis.xinfo_consumers(key, g["name"])
            groups_out.append({
                "name": g["name"],
                "pending": int(g["pending"]),
                "lag": None if g.get("lag") is None else int(g["lag"]),
                "last_delivered_id": g["last-delivered-id"],
                "entries_read": g.get("entries-read"),
                "consumers": [
                    {"name": c["name"], "pending": int(c["pending"]), "idle_ms": int(c["idle"]),
                     "inactive_ms": None if c.get("inactive") is None else int(c["inactive"])}
                    for c in consumers
                ],
            })
        return {"stream": stream, "key": key, "length": length, "shed": shed, "groups": groups_out}


def _parse_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@asynccontextmanager
async def open_bus(settings: Settings) -> AsyncIterator[Bus]:
    bus = Bus(settings)
    try:
        yield bus
    finally:
        await bus.aclose()
