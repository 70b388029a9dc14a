"""Judge model backends: one chat call with a timeout, bounded retries, one pooled client.

- `OpenAIBackend`: any OpenAI-compatible `/v1/chat/completions` (SGLang, vLLM, our
  engine, a hosted API with a bearer key). `url` may end in `/v1` or not.
- `SGLangTextBackend`: SGLang's native `/generate` with text in; the judge messages are
  rendered with the judge model's chat template (`judge_tokenizer`) when given, else
  as plain "System:/User:/Assistant:" text (base models). With `verdict_grammar`, each
  PRM vote is decoded under an EBNF grammar (SGLang's and our engine's `ebnf`) that
  allows only `\\boxed{1}`, `\\boxed{0}` or `\\boxed{-1}`.

`call(messages)` never raises for a failed call: it returns a `CallResult` whose
`error` says what happened, so the vote is kept for audit and the caller applies the
quorum rule. Retried (with doubling, jittered backoff): transport errors, per-attempt
timeouts, 429 and 5xx. Not retried: other 4xx (the request or the key is wrong),
and 2xx bodies without an answer.

A judge that cannot keep up backs off instead of piling more on its model (which may be
an engine that also serves users): `AdaptiveLimit` caps the calls in flight, halving the
cap and pausing new calls when an attempt times out or is refused (429, 5xx, transport),
and raising it by one per cap's worth of answers (additive increase, multiplicative
decrease). Turns then wait in the judge — their entries stay pending in `turns`, nothing
is lost — rather than time out at the model. The HTTP client is sharded (services/judge/http.py):
httpx's single pool gets quadratically slower with hundreds of connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from services.judge import metrics
from services.judge.http import ShardedClient
from services.judge.settings import JudgeConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CallResult:
    text: str | None  # None: no answer (see error)
    latency_s: float  # first attempt to last, backoff included
    error: str | None = None
    attempts: int = 1

    @property
    def ok(self) -> bool:
        return self.text is not None


class CallFailed(Exception):
    """One attempt failed; `retryable` says whether another attempt may succeed."""

    def __init__(self, message: str, retryable: bool, reason: str) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.reason = reason


OVERLOAD = ("timeout", "transport", "http_429", "http_5xx")


class AdaptiveLimit:
    """How many calls may be in flight: AIMD between `floor` and `ceiling`.

    `overloaded()` halves the limit (at most once per `cooldown_s`, so a burst of
    failures of calls sent together counts once) and pauses new calls for a backoff that
    doubles on each consecutive overload, up to `max_pause_s`; `answered()` adds 1/limit.
    """

    def __init__(self, ceiling: int, *, floor: int = 1, pause_s: float = 0.5, max_pause_s: float = 30.0,
                 cooldown_s: float = 1.0) -> None:  # fmt: skip
        self.ceiling = max(ceiling, floor)
        self.floor = floor
        self.limit = float(self.ceiling)
        self.pause_s = pause_s
        self.max_pause_s = max_pause_s
        self.cooldown_s = cooldown_s
        self.inflight = 0
        self.paused_until = 0.0
        self._last_cut = -float("inf")
        self._streak = 0
        self._cond = asyncio.Condition()
        metrics.CALL_LIMIT.set(self.limit)

    async def acquire(self) -> None:
        async with self._cond:
            while True:
                wait = self.paused_until - time.monotonic()
                if wait <= 0 and self.inflight < int(self.limit):
                    self.inflight += 1
                    return
                if wait > 0:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait):
                            await self._cond.wait()
                else:
                    await self._cond.wait()

    async def release(self) -> None:
        async with self._cond:
            self.inflight -= 1
            self._cond.notify_all()

    def answered(self) -> None:
        self._streak = 0
        self.limit = min(float(self.ceiling), self.limit + 1.0 / self.limit)
        metrics.CALL_LIMIT.set(self.limit)

    def overloaded(self, reason: str) -> None:
        now = time.monotonic()
        if now - self._last_cut < self.cooldown_s:
            return
        self._last_cut = now
        self._streak += 1
        self.limit = max(float(self.floor), self.limit / 2)
        pause = min(self.max_pause_s, self.pause_s * 2 ** (self._streak - 1))
        self.paused_until = max(self.paused_until, now + pause)
        metrics.CALL_LIMIT.set(self.limit)
        metrics.BACKOFFS.labels(reason).inc()
        log.warning("the judge model is overloaded: backing off",
                    extra={"reason": reason, "call_limit": int(self.limit), "pause_s": round(pause, 2)})


class JudgeBackend:
    """Shared plumbing: the pooled client, retries, timeouts. Subclasses build requests."""

    path = ""

    def __init__(self, cfg: JudgeConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.cfg = cfg
        pool = min(cfg.concurrency * cfg.votes + 8, 4096)
        headers = {"content-type": "application/json"}
        if cfg.api_key is not None:
            headers["authorization"] = f"Bearer {cfg.api_key.get_secret_value()}"
        self.http = ShardedClient(
            self.base_url(cfg.url),
            connections=pool,
            headers=headers,
            timeout=httpx.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s),
            transport=transport,
        )
        self.limit = AdaptiveLimit(pool, pause_s=max(cfg.backoff_s, 0.05))

    @staticmethod
    def base_url(url: str) -> str:
        return url

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> JudgeBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- to implement ---------------------------------------------------------------
    def body(self, messages: Sequence[dict[str, str]], kind: str = "prm") -> dict[str, Any]:
        raise NotImplementedError

    def answer(self, data: Any) -> str:
        """The generated text from a 2xx body; raise CallFailed when it has none."""
        raise NotImplementedError

    async def health(self) -> None:
        """Raise unless the judge model answers (for /readyz)."""
        raise NotImplementedError

    # -- one call -------------------------------------------------------------------------
    async def call(self, messages: Sequence[dict[str, str]], kind: str = "prm") -> CallResult:
        payload = json.dumps(self.body(messages, kind), separators=(",", ":")).encode()
        started = time.perf_counter()
        attempts = 0
        while True:
            attempts += 1
            await self.limit.acquire()
            t0 = time.perf_counter()
            failure: CallFailed | None = None
            try:
                text = await self._attempt(payload)
            except CallFailed as exc:
                failure = exc
            finally:
                await self.limit.release()  # never held through a retry's backoff
            if failure is None:
                self.limit.answered()
                metrics.CALL_SECONDS.labels(kind, "ok").observe(time.perf_counter() - t0)
                return CallResult(text, time.perf_counter() - started, None, attempts)
            metrics.CALL_SECONDS.labels(kind, failure.reason).observe(time.perf_counter() - t0)
            if failure.reason in OVERLOAD:
                self.limit.overloaded(failure.reason)
            if not failure.retryable or attempts > self.cfg.retries:
                log.debug("judge call failed", extra={"error": str(failure), "attempts": attempts})
                return CallResult(None, time.perf_counter() - started, str(failure), attempts)
            metrics.RETRIES.labels(failure.reason).inc()
            delay = self.cfg.backoff_s * 2 ** (attempts - 1) * random.uniform(0.5, 1.0)
            await asyncio.sleep(delay)

    async def _attempt(self, payload: bytes) -> str:
        where = f"{self.http.base_url}{self.path}"
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                resp = await self.http.post(self.path, content=payload)
        except TimeoutError:
            raise CallFailed(f"no answer from {where} within {self.cfg.timeout_s}s", True, "timeout") from None
        except httpx.TimeoutException as exc:
            raise CallFailed(f"no answer from {where} ({type(exc).__name__})", True, "timeout") from None
        except httpx.TransportError as exc:
            raise CallFailed(f"{where} unreachable: {type(exc).__name__}: {exc}", True, "transport") from None
        status = resp.status_code
        if status == 429 or status >= 500:
            raise CallFailed(f"{where} answered {status}: {_snippet(resp)}", True, f"http_{status // 100}xx" if status != 429 else "http_429")
        if status >= 300:
            raise CallFailed(
                f"{where} answered {status}: {_snippet(resp)} (check the model name, URL and API key)",
                False, "http_4xx",
            )  # fmt: skip
        try:
            data = resp.json()
        except ValueError:
            raise CallFailed(f"{where} answered with invalid JSON", False, "bad_body") from None
        return self.answer(data)


# NEXTSTATE_JUDGE__VERDICT_GRAMMAR: a vote is one of the three boxed labels and nothing else.
VERDICT_EBNF = 'root ::= "\\\\boxed{" ("1" | "0" | "-1") "}"'


def _snippet(resp: httpx.Response) -> str:
    return resp.text[:300].replace("\n", " ") or "(empty body)"


class OpenAIBackend(JudgeBackend):
    path = "/chat/completions"

    @staticmethod
    def base_url(url: str) -> str:
        return url if url.endswith("/v1") else url + "/v1"

    def body(self, messages: Sequence[dict[str, str]], kind: str = "prm") -> dict[str, Any]:
        return {
            "model": self.cfg.model,
            "messages": list(messages),
            "temperature": self.cfg.temperature,
            "max_tokens": self.cfg.max_tokens,
        }

    def answer(self, data: Any) -> str:
        try:
            message = data["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            raise CallFailed("the answer has no choices[0].message", False, "bad_body") from None
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, str):
            # Reasoning models may put everything in reasoning_content and leave content null.
            content = message.get("reasoning_content") if isinstance(message, dict) else None
        if not isinstance(content, str):
            raise CallFailed("the answer's message has no text content", False, "bad_body")
        return content

    async def health(self) -> None:
        resp = await self.http.get("/models", timeout=5.0)
        resp.raise_for_status()


class SGLangTextBackend(JudgeBackend):
    path = "/generate"

    def __init__(self, cfg: JudgeConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(cfg, transport)
        self._template: Any = None
        if cfg.judge_tokenizer:
            from shared.chat import ChatTemplate  # transformers: only when asked for

            self._template = ChatTemplate.from_pretrained(cfg.judge_tokenizer)

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        if self._template is not None:
            return str(self._template.render(list(messages)))
        parts = [f"{m['role'].capitalize()}:\n{m['content']}" for m in messages]
        return "\n\n".join(parts) + "\n\nAssistant:\n"

    def body(self, messages: Sequence[dict[str, str]], kind: str = "prm") -> dict[str, Any]:
        sampling: dict[str, Any] = {"temperature": self.cfg.temperature, "max_new_tokens": self.cfg.max_tokens}
        if self.cfg.verdict_grammar and kind == "prm":  # the reward's votes only: hints stay free text
            sampling["ebnf"] = VERDICT_EBNF
        return {"text": self.render(messages), "sampling_params": sampling}

    def answer(self, data: Any) -> str:
        text = data.get("text") if isinstance(data, dict) else None
        if not isinstance(text, str):
            raise CallFailed("the /generate answer has no text", False, "bad_body")
        return text

    async def health(self) -> None:
        resp = await self.http.get("/health", timeout=5.0)
        resp.raise_for_status()


def make_backend(cfg: JudgeConfig, transport: httpx.AsyncBaseTransport | None = None) -> JudgeBackend:
    if cfg.backend == "sglang":
        return SGLangTextBackend(cfg, transport)
    return OpenAIBackend(cfg, transport)
