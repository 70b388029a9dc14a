"""Where `nextstate up`'s supervisor publishes its processes' states: one Redis hash.

`nextstate status` reads it (`keys.services`): field = process name, value = the JSON
state record (`Proc.record` in supervisor.py). The supervisor must never wait on it, so
writes have short timeouts and no retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError


class RedisStates:
    """The records in one Redis hash (field = process name, value = JSON).

    Short timeouts and no retries: a Redis that does not answer costs one failed write,
    and the next write tries again. The first write replaces what an earlier stack left.
    """

    def __init__(self, url: str, key: str, timeout_s: float = 1.0) -> None:
        self.key = key
        self.error: str | None = None
        self._timeout_s = timeout_s
        self._fresh = True
        self._client = aioredis.Redis.from_url(
            url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
        )

    async def write(self, records: dict[str, dict[str, Any]]) -> bool:
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                if self._fresh:
                    pipe.delete(self.key)
                if records:
                    pipe.hset(self.key, mapping={name: json.dumps(r) for name, r in records.items()})
                await asyncio.wait_for(pipe.execute(), 2 * self._timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            self.error = str(exc) or type(exc).__name__
            return False
        self._fresh, self.error = False, None
        return True

    async def aclose(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._client.aclose()
