"""Wait on a condition in async tests: poll until it holds, never a bare sleep."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any


async def eventually(
    cond: Callable[[], Awaitable[Any] | Any], timeout: float = 10.0, what: str = "",
    interval: float = 0.02,
) -> Any:
    """Poll `cond` (sync or async) until it returns something truthy; return that."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got = cond()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")
        await asyncio.sleep(interval)


async def until(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """`eventually` for a blocking condition (sync Redis, HTTP): each poll runs in a thread,
    so the event loop (and the load it drives) keeps running."""
    return await eventually(lambda: asyncio.to_thread(cond), timeout, what, interval)
