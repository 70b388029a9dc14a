"""The engine interface every service uses, its result types, and the shared HTTP plumbing.

`EngineClient` is what the collector (token-in/token-out generation, streaming), the
judge (teacher log-probs via `score`) and the watcher (`update_weights`, `model_info`)
call. Implementations: `SGLangClient` (SGLang, and our CPU engine) and `VLLMClient`.

Every implementation keeps ONE pooled `httpx.AsyncClient` for its whole life, sends
`api_key` (the stack's internal token: our engine's, SGLang's and vLLM's `--api-key`)
as `Authorization: Bearer` on every request, and maps failures onto shared.errors:

    cannot connect, connection dropped, 5xx   -> EngineUnavailable
    no answer (or no next chunk) in time      -> EngineTimeout
    4xx: the request itself is wrong          -> EngineRejected (with .status_code)
    the engine lacks the feature              -> EngineNotSupported

LoRA versions: `load_adapter` / `unload_adapter` put an adapter into the engine by name and
make it the weight version; a client made with `adapters=True` names that adapter in every
request (asking the engine which it is at most once a second, and once more when a request
is refused because the adapter it named was unloaded meanwhile), and reports it as the
result's weight version.

`generate` / `stream` with `top_logprobs_num=k` also return, per output token, the k most
likely (token id, log-prob) pairs of the distribution the log-probs come from;
`score_topk` does the same for teacher-forced tokens (SGLang; vLLM: EngineNotSupported). A
`SamplingParams.json_schema` / `.regex` asks for constrained decoding with the engine's
own option (SGLang: the sampling params of the same name; vLLM: `structured_outputs`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

import httpx
import orjson

from shared.auth import bearer
from shared.errors import (
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
)
from shared.schemas import SamplingParams

SamplingLike = SamplingParams | Mapping[str, Any]
ADAPTER_TTL_S = 1.0  # how stale a client's idea of the served LoRA adapter may be
BASE_VERSION = "0"  # the weight version of the base model, before any trained version
TopLogprobs = list[tuple[int, float]]  # one position's most likely (token id, log-prob), best first
_SCHEMA_KEYS = frozenset(SamplingParams.model_fields)


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """One finished generation, exactly as the engine sampled it."""

    text: str
    output_ids: list[int]
    output_logprobs: list[float]  # one per output id; empty when log-probs were not asked
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    weight_version: str
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it
    rid: str | None = None
    e2e_latency: float | None = None
    # one list per output id when `top_logprobs_num` > 0 was asked; empty otherwise
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class GenerateChunk:
    """What a stream added since the previous chunk; the last one has `finish_reason`."""

    new_ids: list[int]
    new_logprobs: list[float]
    new_text: str
    text: str  # cumulative text so far
    finish_reason: str | None = None
    weight_version: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # cumulative
    rid: str | None = None
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ChunkJoiner:
    """Accumulates a stream's chunks into the `GenerateResult` the same request would give."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    last: GenerateChunk | None = None

    def add(self, chunk: GenerateChunk) -> None:
        self.ids += chunk.new_ids
        self.logprobs += chunk.new_logprobs
        self.top_logprobs += chunk.new_top_logprobs
        self.last = chunk

    def result(self) -> GenerateResult:
        last = self.last
        if last is None or last.finish_reason is None:
            raise EngineUnavailable("the stream ended before its final chunk")
        return GenerateResult(
            text=last.text,
            output_ids=list(self.ids),
            output_logprobs=list(self.logprobs),
            finish_reason=last.finish_reason,
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
            weight_version=last.weight_version or "",
            matched_stop=last.matched_stop,
            rid=last.rid,
            output_top_logprobs=list(self.top_logprobs),
        )


@dataclass(frozen=True, slots=True)
class AdapterAnswer:
    """The engine's answer to loading or unloading a LoRA adapter."""

    ok: bool
    message: str
    loaded: tuple[str, ...] | None = None  # the adapters it holds afterwards (None: it did not say)


async def join_stream(chunks: AsyncIterator[GenerateChunk]) -> GenerateResult:
    joiner = ChunkJoiner()
    async for chunk in chunks:
        joiner.add(chunk)
    return joiner.result()


@runtime_checkable
class EngineClient(Protocol):
    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingLike,
        *,
        return_logprob: bool = True,
        stop_token_ids: Iterable[int] | None = None,
        rid: str | None = None,
        top_logprobs_num: int = 0,
    ) -> GenerateResult: ...

    def stream(
        self,
        input_ids: Sequence[int],
        sampling: SamplingLike,
        *,
        return_logprob: bool = True,
        stop_token_ids: Iterable[int] | None = None,
        rid: str | None = None,
        top_logprobs_num: int = 0,
    ) -> AsyncIterator[GenerateChunk]: ...

    async def score(
        self, input_ids: Sequence[int], start: int, *, temperature: float = 1.0
    ) -> list[float]: ...

    async def score_topk(
        self, input_ids: Sequence[int], start: int, k: int, *, temperature: float = 1.0
    ) -> tuple[list[float], list[TopLogprobs]]: ...

    async def update_weights(
        self, model_path: str, weight_version: str, *, abort_all_requests: bool = False
    ) -> tuple[bool, str]: ...

    async def load_adapter(self, name: str, path: str) -> AdapterAnswer: ...

    async def unload_adapter(self, name: str) -> AdapterAnswer: ...

    async def model_info(self) -> dict[str, Any]: ...

    async def weight_version(self) -> str: ...

    async def health(self) -> bool: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> EngineClient: ...

    async def __aexit__(self, *exc: object) -> None: ...


@runtime_checkable
class DirectTransport(Protocol):
    """A transport that also sends a raw request and returns (status, whole body), without
    httpx's request and response models (services/collector/engine_transport.py)."""

    async def exchange(
        self, host: str, port: int, head: bytes, body: bytes, connect_timeout: float | None,
        read_timeout: float | None,
    ) -> tuple[int, bytes]: ...


def split_sampling(sampling: SamplingLike) -> tuple[SamplingParams, dict[str, Any]]:
    """Our schema's fields, and the engine-specific extras (e.g. ignore_eos) passed through."""
    if isinstance(sampling, SamplingParams):
        return sampling, {}
    known = {k: v for k, v in sampling.items() if k in _SCHEMA_KEYS}
    extra = {k: v for k, v in sampling.items() if k not in _SCHEMA_KEYS}
    return SamplingParams(**known), extra


def check_score_range(n: int, start: int) -> None:
    if not 1 <= start <= n:
        raise ValueError(f"start must be in [1, {n}] (token 0 has no context), got {start}")


class HTTPEngine:
    """One pooled HTTP client for the life of an engine client, with error mapping."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 120.0,
        connect_timeout: float = 5.0,
        max_connections: int = 256,
        update_timeout: float = 900.0,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
        adapters: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # LoRA versions: name the adapter the engine's weight version points at in every
        # request (SGLang and vLLM serve the base model to requests that name none).
        self.name_adapters = adapters
        self._named: str | None = None
        self._named_at = -ADAPTER_TTL_S
        self._naming = asyncio.Lock()
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.update_timeout = update_timeout
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
            transport=transport,
            headers=bearer(api_key),
        )
        # JSON calls over a DirectTransport skip httpx's models (the collector's hot path).
        self._direct: DirectTransport | None = None
        self._host, self._port, self._prefix, self._head = "", 80, b"", b""
        url = urlsplit(self.base_url)
        if isinstance(transport, DirectTransport) and url.scheme == "http" and url.hostname:
            self._direct = transport
            self._host, self._port = url.hostname, url.port or 80
            self._prefix = url.path.encode()
            fixed = {"Host": url.netloc, "Accept": "application/json",
                     "Content-Type": "application/json", **bearer(api_key)}  # fmt: skip
            self._head = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Any:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- generation, naming the served LoRA adapter ---------------------------------------

    async def weight_version(self) -> str:
        raise NotImplementedError

    async def adapter(self) -> str | None:
        """The LoRA adapter to name in a request: with `adapters` on, the engine's weight
        version (asked at most every ADAPTER_TTL_S), None while that is the base ("0")."""
        if not self.name_adapters:
            return None
        async with self._naming:
            if time.monotonic() - self._named_at >= ADAPTER_TTL_S:
                version = await self.weight_version()
                self._named = None if version in ("", BASE_VERSION) else version
                self._named_at = time.monotonic()
            return self._named

    def forget_adapter(self) -> None:
        """Ask the engine again before the next request (after a load, or a refusal)."""
        self._named_at = -ADAPTER_TTL_S

    async def _renamed(self, used: str | None, exc: EngineRejected) -> str | None:
        """After `exc` for a request naming `used`: the adapter to retry with, when the engine
        now serves another (the one named was unloaded meanwhile); else `exc` stands."""
        if used is None:
            raise exc
        self.forget_adapter()
        now = await self.adapter()
        if now == used:
            raise exc
        return now

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingLike,
        *,
        return_logprob: bool = True,
        stop_token_ids: Iterable[int] | None = None,
        rid: str | None = None,
        top_logprobs_num: int = 0,
    ) -> GenerateResult:
        """One generation (with `adapters` on, on the adapter the engine serves: the result
        reports it as its weight version)."""
        kw: dict[str, Any] = {"return_logprob": return_logprob, "stop_token_ids": stop_token_ids, "rid": rid,
                              "top_logprobs_num": top_logprobs_num}
        adapter = await self.adapter()
        try:
            result = await self._generate(input_ids, sampling, adapter=adapter, **kw)
        except EngineRejected as exc:
            adapter = await self._renamed(adapter, exc)
            result = await self._generate(input_ids, sampling, adapter=adapter, **kw)
        return result if adapter is None else dataclasses.replace(result, weight_version=adapter)

    async def stream(
        self,
        input_ids: Sequence[int],
        sampling: SamplingLike,
        *,
        return_logprob: bool = True,
        stop_token_ids: Iterable[int] | None = None,
        rid: str | None = None,
        top_logprobs_num: int = 0,
    ) -> AsyncIterator[GenerateChunk]:
        """`generate`, chunk by chunk (a refused adapter is retried before the first chunk only)."""
        kw: dict[str, Any] = {"return_logprob": return_logprob, "stop_token_ids": stop_token_ids, "rid": rid,
                              "top_logprobs_num": top_logprobs_num}
        adapter = await self.adapter()
        started = False
        for attempt in range(2):
            try:
                async for chunk in self._stream(input_ids, sampling, adapter=adapter, **kw):
                    started = True
                    if adapter is not None and chunk.weight_version is not None:
                        chunk = dataclasses.replace(chunk, weight_version=adapter)
                    yield chunk
                return
            except EngineRejected as exc:
                if started or attempt:
                    raise
                adapter = await self._renamed(adapter, exc)

    async def _generate(
        self, input_ids: Sequence[int], sampling: SamplingLike, *, return_logprob: bool,
        stop_token_ids: Iterable[int] | None, rid: str | None, top_logprobs_num: int, adapter: str | None,
    ) -> GenerateResult:  # fmt: skip
        raise NotImplementedError

    def _stream(
        self, input_ids: Sequence[int], sampling: SamplingLike, *, return_logprob: bool,
        stop_token_ids: Iterable[int] | None, rid: str | None, top_logprobs_num: int, adapter: str | None,
    ) -> AsyncIterator[GenerateChunk]:  # fmt: skip
        raise NotImplementedError

    # -- errors -----------------------------------------------------------------------

    def transport_error(self, exc: httpx.HTTPError, what: str) -> EngineError:
        where = f"{self.base_url}{what}"
        if isinstance(exc, httpx.ConnectTimeout):
            return EngineUnavailable(f"cannot connect to the engine at {where} within {self.connect_timeout}s")
        if isinstance(exc, httpx.TimeoutException):
            return EngineTimeout(f"the engine at {where} did not answer within {self.timeout}s ({type(exc).__name__})")
        return EngineUnavailable(f"the engine at {where} is unreachable: {type(exc).__name__}: {exc}")

    @staticmethod
    def error_message(body: bytes) -> str:
        try:
            data = json.loads(body)
        except ValueError:
            return body.decode(errors="replace")[:500] or "(empty body)"
        if isinstance(data, dict):
            err = data.get("error")
            if isinstance(err, dict) and "message" in err:
                return str(err["message"])
            for key in ("message", "detail", "error"):
                if key in data:
                    return str(data[key])
        return str(data)[:500]

    def status_error(self, status: int, body: bytes, what: str) -> EngineError:
        msg = f"{what}: engine answered {status}: {self.error_message(body)}"
        if status == 401:
            msg += " (set NEXTSTATE_INTERNAL__TOKEN to the token the engine was started with)"
        if status >= 500:
            return EngineUnavailable(msg)
        return EngineRejected(msg, status_code=status)

    # -- requests ---------------------------------------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        ok: Iterable[int] = (),
    ) -> httpx.Response:
        """Send and return the response; non-2xx statuses not in `ok` raise mapped errors."""
        kwargs: dict[str, Any] = {}
        if json_body is not None:
            kwargs["content"] = json.dumps(json_body, separators=(",", ":")).encode()
            kwargs["headers"] = {"content-type": "application/json"}
        if params:
            kwargs["params"] = params
        if timeout is not None:
            kwargs["timeout"] = httpx.Timeout(timeout, connect=self.connect_timeout)
        try:
            resp = await self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise self.transport_error(exc, path) from exc
        if resp.status_code >= 300 and resp.status_code not in set(ok):
            raise self.status_error(resp.status_code, resp.content, path)
        return resp

    async def json(self, method: str, path: str, **kwargs: Any) -> Any:
        if self._direct is not None and kwargs.keys() <= {"json_body", "timeout"}:
            return await self._direct_json(method, path, kwargs.get("json_body"), kwargs.get("timeout"))
        resp = await self.request(method, path, **kwargs)
        try:
            return resp.json()
        except ValueError as exc:
            raise EngineUnavailable(f"{path}: the engine answered with invalid JSON") from exc

    async def _direct_json(self, method: str, path: str, json_body: Any, timeout: float | None) -> Any:
        """`json` over the DirectTransport: the same errors, no httpx models."""
        assert self._direct is not None
        body = b"" if json_body is None else orjson.dumps(json_body)
        head = b"".join([method.encode(), b" ", self._prefix, path.encode(), b" HTTP/1.1\r\n", self._head])
        try:
            status, content = await self._direct.exchange(
                self._host, self._port, head, body, self.connect_timeout,
                self.timeout if timeout is None else timeout,
            )  # fmt: skip
        except httpx.HTTPError as exc:
            raise self.transport_error(exc, path) from exc
        if status >= 300:
            raise self.status_error(status, content, path)
        try:
            return orjson.loads(content)
        except orjson.JSONDecodeError as exc:
            raise EngineUnavailable(f"{path}: the engine answered with invalid JSON") from exc

    async def sse(self, path: str, payload: Any) -> AsyncIterator[Any]:
        """POST and yield each `data:` event's JSON until `[DONE]` or the end of the body.

        The response is closed in `finally` rather than by `async with client.stream()`:
        a consumer that abandons the iteration leaves it to the event loop's finalizer,
        and nested context-manager generators then fail to close ("already running").
        """
        body = json.dumps(payload, separators=(",", ":")).encode()
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        try:
            resp = await self._http.send(
                self._http.build_request("POST", path, content=body, headers=headers), stream=True
            )
        except httpx.HTTPError as exc:
            raise self.transport_error(exc, path) from exc
        try:
            if resp.status_code >= 300:
                raise self.status_error(resp.status_code, await resp.aread(), path)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    yield json.loads(data)
                except ValueError as exc:
                    raise EngineUnavailable(f"{path}: malformed stream event {data[:200]!r}") from exc
        except httpx.HTTPError as exc:
            raise self.transport_error(exc, path) from exc
        finally:
            await resp.aclose()
