"""A bounded load of agents talking to the collector through the official `openai` client.

Each agent runs sessions of `turns` turns: a user message, the model's reply appended,
then the user's next message — praise or a correction, so the rule judge scores ±1 —
and `X-Session-Done: 1` on the last request. A failed request (collector or engine
down, Redis gone) is retried with backoff, as an agent would: the conversation goes on
from where it was. Every response the client actually received is recorded with its
completion id, so a test can check that each one was captured, judged and trained or
excluded. `stop()` lets every agent finish the session it is in, then return.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import openai

PRAISE = "thanks, great answer"
CORRECTION = "no, that's wrong, try again"


@dataclass(frozen=True)
class Served:
    session_id: str
    index: int  # the turn's position in its session
    completion_id: str
    weight_version: str
    started: float  # when the (successful) attempt was sent
    at: float  # when its response was received


@dataclass
class Load:
    url: str  # the collector's OpenAI base url, ending in /v1
    agents: int = 4
    turns: int = 3
    max_tokens: int = 4
    api_key: str = "unused"
    timeout_s: float = 30.0
    served: list[Served] = field(default_factory=list)
    failures: int = 0
    sessions_done: int = 0
    last_ok: float = 0.0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> Load:
        self._client = openai.AsyncOpenAI(base_url=self.url, api_key=self.api_key,
                                          max_retries=0, timeout=self.timeout_s)
        self._tasks = [asyncio.create_task(self._agent(i)) for i in range(self.agents)]
        return self

    async def stop(self, timeout: float = 120.0) -> None:
        """Finish the sessions in progress (each ends with X-Session-Done), then return."""
        self._stop.set()
        try:
            await asyncio.wait_for(asyncio.gather(*self._tasks), timeout)
        finally:
            await self._client.close()

    async def served_since(self, t: float, n: int = 1) -> float:
        """Wait for `n` requests sent after time `t` to be answered; return when the first was."""
        while True:
            after = [s.at for s in self.served if s.started > t]
            if len(after) >= n:
                return min(after)
            await asyncio.sleep(0.02)

    async def _agent(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            await self._session(f"load-{i}-{n}-{uuid.uuid4().hex[:6]}")
            n += 1

    async def _session(self, sid: str) -> None:
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"hello, I am {sid}"}]
        for k in range(self.turns):
            last = k == self.turns - 1
            reply = await self._ask(sid, k, messages, done=last)
            messages.append(reply)
            messages.append({"role": "user", "content": PRAISE if (k + len(sid)) % 2 else CORRECTION})
        self.sessions_done += 1

    async def _ask(self, sid: str, k: int, messages: list[dict[str, Any]], done: bool) -> dict[str, Any]:
        headers = {"X-Session-Id": sid, **({"X-Session-Done": "1"} if done else {})}
        delay = 0.1
        while True:
            started = time.time()
            try:
                raw = await self._client.chat.completions.with_raw_response.create(
                    model="policy", messages=messages, max_tokens=self.max_tokens,  # type: ignore[arg-type]
                    temperature=1.0, extra_headers=headers,
                )
                resp = raw.parse()
            except (openai.APIError, openai.APIConnectionError):
                self.failures += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            now = time.time()
            self.last_ok = now
            self.served.append(Served(sid, k, resp.id, raw.headers.get("x-policy-version", ""), started, now))
            content = resp.choices[0].message.content or ""
            return {"role": "assistant", "content": content}
