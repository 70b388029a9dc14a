"""Pending turns in Redis: store, close at most once, and expire — safe with many replicas.

Layout (names from `shared.keys`):

    pending:<hash>        the pending record (JSON: deadline, PromptCache, Turn so far),
                          Redis TTL = pending TTL + grace, so a stopped sweeper leaks nothing
    pending-deadlines     sorted set: <hash> scored by the turn's deadline (unix seconds)
    lineage:<hash>        {"session_id", "turn_index"} of the response ending that prefix

Closing is `GETDEL`: whichever replica's request (or sweeper) gets the value emits the
turn; every other one gets nil. Each method is one round trip (a non-transactional
pipeline).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared.keys import Keys

SWEEP_BATCH = 256


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


class PendingStore:
    def __init__(self, redis: Any, keys: Keys, ttl_s: float) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self.grace_s = max(60.0, ttl_s)

    def key_ttl_ms(self, deadline: float, now: float) -> int:
        return max(1000, int((deadline - now + self.grace_s) * 1000))

    async def lookup(
        self, hashes: Sequence[str], lineage_of: str | None
    ) -> tuple[list[str | None], str | None]:
        """GETDEL each candidate's pending record (and drop it from the deadlines: closed
        now, or already); GET the lineage of `lineage_of`."""
        pipe = self.redis.pipeline(transaction=False)
        for h in hashes:
            pipe.getdel(self.keys.pending_turn(h))
        pipe.zrem(self.keys.pending_deadlines, *hashes)
        if lineage_of is not None:
            pipe.get(self.keys.turn_lineage(lineage_of))
        out = await pipe.execute()
        records = [None if r is None else str(r) for r in out[: len(hashes)]]
        lineage = None if lineage_of is None or out[-1] is None else str(out[-1])
        return records, lineage

    async def put(self, h: str, record: str, deadline: float, lineage: str, now: float) -> None:
        px = self.key_ttl_ms(deadline, now)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.pending_turn(h), record, px=px)
        pipe.zadd(self.keys.pending_deadlines, {h: deadline})
        pipe.set(self.keys.turn_lineage(h), lineage, px=px)
        await pipe.execute()

    async def drop(self, hashes: Sequence[str]) -> None:
        """Delete pending turns that were closed elsewhere (replaying a spool)."""
        if not hashes:
            return
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(*[self.keys.pending_turn(h) for h in hashes])
        pipe.zrem(self.keys.pending_deadlines, *hashes)
        await pipe.execute()

    async def due(self, now: float) -> list[tuple[str, str]]:
        """Claim pending turns past their deadline: (hash, record) for those this caller won."""
        members = await self.redis.zrangebyscore(
            self.keys.pending_deadlines, "-inf", now, start=0, num=SWEEP_BATCH
        )
        if not members:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for h in members:
            pipe.getdel(self.keys.pending_turn(h))
        pipe.zrem(self.keys.pending_deadlines, *members)
        out = await pipe.execute()
        return [(str(h), str(r)) for h, r in zip(members, out[:-1], strict=True) if r is not None]
