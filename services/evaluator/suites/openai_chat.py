"""One OpenAI-compatible `/v1/chat/completions` client for the suites: the evaluation
engine's OpenAI endpoint (the candidate) and the simulated user's model.

One pooled `httpx.AsyncClient` per suite run (an async context manager), a timeout on
every call, and bounded retries with jittered doubling for what may succeed on a second
try (transport errors, timeouts, 429, 5xx) — safe because the suites' calls are
idempotent (temperature 0 and a seed). Other 4xx and bodies without text are not
retried. Failures raise `ModelCallFailed` naming the endpoint and what to check.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from services.evaluator.suites.errors import SuiteError

RETRIES = 2
BACKOFF_S = 0.5


class ModelCallFailed(SuiteError):
    """A chat completion did not produce text (after the retries it was worth)."""


@dataclass(frozen=True)
class Reply:
    text: str
    finish_reason: str


def v1(url: str) -> str:
    """`url` as an OpenAI base URL: with exactly one trailing `/v1`."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class ChatClient:
    """`await chat.complete(messages, max_tokens=…)` against one OpenAI-compatible server."""

    def __init__(
        self,
        base_url: str,
        *,
        label: str,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 120.0,
        model: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.label = label
        self.timeout_s = timeout_s
        self.model = model
        self.base_url = v1(base_url)
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers={"content-type": "application/json", **(headers or {})},
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            transport=transport,
        )

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    @property
    def where(self) -> str:
        return f"{self.label} at {self.base_url}"

    async def served_model(self) -> str:
        """The model name to send: the configured one, else the server's first model."""
        if self.model is None:
            data = await self._call("GET", "/models", None)
            try:
                self.model = str(data["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise ModelCallFailed(f"{self.where}: GET /models lists no model") from None
        return self.model

    async def complete(
        self,
        messages: Sequence[Mapping[str, str]],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> Reply:
        body: dict[str, Any] = {
            "model": await self.served_model(),
            "messages": [dict(m) for m in messages],
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        if seed is not None:
            body["seed"] = seed
        data = await self._call("POST", "/chat/completions", body)
        try:
            choice = data["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise ModelCallFailed(f"{self.where}: the answer has no choices[0].message") from None
        content = message.get("content") if isinstance(message, dict) else None
        if content is None and isinstance(message, dict):
            content = message.get("reasoning_content")  # reasoning models may leave content null
        if not isinstance(content, str):
            raise ModelCallFailed(f"{self.where}: the answer's message has no text content")
        return Reply(content, str(choice.get("finish_reason") or ""))

    async def _call(self, method: str, path: str, body: Any) -> Any:
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._attempt(method, path, body)
            except _Retryable as exc:
                if attempt > RETRIES:
                    raise ModelCallFailed(f"{exc} (after {attempt} attempts)") from None
                await asyncio.sleep(BACKOFF_S * 2 ** (attempt - 1) * random.uniform(0.5, 1.0))

    async def _attempt(self, method: str, path: str, body: Any) -> Any:
        where = f"{self.label} at {self.base_url}{path}"
        content = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        try:
            async with asyncio.timeout(self.timeout_s):
                resp = await self._http.request(method, path, content=content)
        except (TimeoutError, httpx.TimeoutException):
            raise _Retryable(f"{where} did not answer within {self.timeout_s}s") from None
        except httpx.TransportError as exc:
            raise _Retryable(f"{where} is unreachable: {type(exc).__name__}: {exc}") from None
        status = resp.status_code
        if status == 429 or status >= 500:
            raise _Retryable(f"{where} answered {status}: {_snippet(resp)}")
        if status >= 300:
            hint = " (check the URL, the model name and the credential)" if status in (401, 403, 404) else ""
            raise ModelCallFailed(f"{where} answered {status}: {_snippet(resp)}{hint}")
        try:
            return resp.json()
        except ValueError:
            raise ModelCallFailed(f"{where} answered with invalid JSON") from None


class _Retryable(Exception):
    pass


def _snippet(resp: httpx.Response) -> str:
    return resp.text[:300].replace("\n", " ") or "(empty body)"
