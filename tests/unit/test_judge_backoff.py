"""A judge that cannot keep up backs off: services/judge/backend.py's AdaptiveLimit.

A model that times out or refuses (503) gets fewer calls in flight and a pause before the
next ones; as it answers again the judge regains its concurrency. Over httpx's in-memory
transport: the point is what the judge sends, counted at the "model"."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from services.judge.backend import AdaptiveLimit, make_backend
from services.judge.settings import JudgeConfig

pytestmark = pytest.mark.asyncio


class Model:
    """Answers after `delay_s`; 503 while `overloaded`. Counts calls in flight."""

    def __init__(self) -> None:
        self.overloaded = True
        self.inflight = 0
        self.peak = 0
        self.calls = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        try:
            await asyncio.sleep(0.01)
            if self.overloaded:
                return httpx.Response(503, text="the engine queue is full")
            return httpx.Response(200, json={"choices": [{"message": {"content": "\\boxed{1}"}}]})
        finally:
            self.inflight -= 1


def cfg(**kw: Any) -> JudgeConfig:
    return JudgeConfig(**{"url": "http://judge-model:30000", "timeout_s": 2.0, "retries": 0, "backoff_s": 0.05,
                          "concurrency": 8, "votes": 2, **kw})


async def test_an_overloaded_model_gets_fewer_calls_and_a_pause_then_concurrency_comes_back() -> None:
    model = Model()
    async with make_backend(cfg(), httpx.MockTransport(model)) as backend:
        ceiling = backend.limit.ceiling
        assert backend.limit.limit == ceiling  # full concurrency while the model keeps up
        results = await asyncio.gather(*(backend.call([{"role": "user", "content": "q"}]) for _ in range(40)))
        assert all(not r.ok for r in results)
        assert backend.limit.limit <= ceiling / 2, "no back-off after a burst of 503s"
        assert backend.limit.paused_until > 0  # new calls were held back for a while
        model.peak = 0
        # The next calls go at most `limit` at a time.
        limit_now = int(backend.limit.limit)
        await asyncio.gather(*(backend.call([{"role": "user", "content": "q"}]) for _ in range(10)))
        assert model.peak <= max(limit_now, 1)

        model.overloaded = False
        low = backend.limit.limit
        ok = await asyncio.gather(*(backend.call([{"role": "user", "content": "q"}]) for _ in range(200)))
        assert all(r.ok for r in ok)
        assert backend.limit.limit > low  # additive increase as the model answers


async def test_a_burst_of_failures_halves_once_and_the_limit_never_drops_below_one() -> None:
    limit = AdaptiveLimit(16, pause_s=0.0, cooldown_s=60.0)
    for _ in range(10):
        limit.overloaded("timeout")  # calls sent together that fail together: one cut
    assert limit.limit == 8
    limit = AdaptiveLimit(16, pause_s=0.0, cooldown_s=0.0)
    for _ in range(10):
        limit.overloaded("http_5xx")
    assert limit.limit == 1
    await limit.acquire()
    blocked = asyncio.create_task(limit.acquire())
    await asyncio.sleep(0.01)
    assert not blocked.done()  # a limit of 1: the second call waits for the first
    await limit.release()
    await asyncio.wait_for(blocked, 1)
    await limit.release()
