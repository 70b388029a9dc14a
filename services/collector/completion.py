"""One chat completion, plain or streamed: template -> engine (token ids) -> OpenAI answer.

The hot path (DESIGN.md "Hot paths"): render the chat template; for a main-line turn
look up the turns this request follows up (one short Redis round trip, capture.py),
whose PromptCache lets the prompt be tokenized incrementally; call the engine through
the process's one pooled client with the exact ids; parse the sampled text into an
assistant message (content, reasoning, tool calls); answer; hand the turn to capture.

Engine failures map to OpenAI-shaped errors: cannot connect / 5xx / the generation was
aborted -> 502, no answer (or no next stream chunk) within the timeout -> 504, the
engine refused the request (e.g. prompt too long) -> 400. In a stream, a failure after
the first token is one `data: {"error": …}` event and the end of the stream (the
official SDK raises APIError); such a half-finished turn is never captured.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from services.collector import metrics as M
from services.collector.capture import Capture, Lookup
from services.collector.openai_shapes import ApiError, ChunkWriter, completion, completion_id, dumps
from services.collector.pairing import candidates, prefix_hashes, response_hash
from services.collector.request import ChatCall
from services.collector.settings import CollectorConfig
from shared.chat import ChatTemplate, ChatTemplateError, PromptCache
from shared.engine_client import ChunkJoiner, EngineClient, GenerateChunk, GenerateResult
from shared.errors import EngineError, EngineRejected, EngineTimeout
from shared.schemas import Turn
from shared.toolcalls import (
    StreamParser,
    delta_dicts,
    finish_reason,
    message_dict,
    parse_assistant,
    prompt_opens_reasoning,
)

log = logging.getLogger(__name__)


def engine_error(exc: EngineError) -> ApiError:
    """An engine failure as the client sees it (details go to the log, not the client)."""
    log.warning("engine call failed: %s", exc)
    if isinstance(exc, EngineTimeout):
        return ApiError(504, "the model server did not answer in time; retry later",
                        code="engine_timeout", kind="server_error")  # fmt: skip
    if isinstance(exc, EngineRejected):
        status = exc.status_code if 400 <= exc.status_code < 500 else 400
        return ApiError(status, f"the model server refused the request: {exc}", code="engine_rejected")
    return ApiError(502, "the model server is unavailable; retry later",
                    code="engine_unavailable", kind="server_error")  # fmt: skip


def _aborted() -> ApiError:
    log.warning("the engine aborted a generation")
    return ApiError(502, "the model server aborted the generation; retry later",
                    code="engine_aborted", kind="server_error")  # fmt: skip


@dataclass(slots=True)
class Prepared:
    """A request between templating and the engine call."""

    call: ChatCall
    ids: list[int]
    cache: PromptCache
    reasoning_open: bool | None
    hashes: list[bytes]
    lookup: Lookup
    requested_at: float
    session_id: str


class ChatService:
    def __init__(
        self, cfg: CollectorConfig, engine: EngineClient, template: ChatTemplate,
        capture: Capture, model_name: str, weight_version: str = "unknown",
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.engine = engine
        self.template = template
        self.capture = capture
        self.model_name = model_name
        self.weight_version = weight_version
        self.stop_ids = list(template.stop_token_ids)

    # -- shared steps ----------------------------------------------------------------------

    async def prepare(self, call: ChatCall) -> Prepared:
        requested_at = time.time()
        try:
            text = self.template.render(call.messages, call.tools)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        hashes: list[bytes] = []
        lookup = Lookup()
        if call.turn_type == "main":
            hashes = prefix_hashes(call.messages)
            cands = candidates(call.messages, hashes, self.cfg.max_pairing_candidates)
            lookup = await self.capture.begin(call.raw_messages, cands)
        ids, cache = self.template.encode_text_incremental(text, lookup.cache)
        M.TOKENIZE.labels("incremental" if lookup.cache is not None else "full").inc()
        session = call.session_hint or lookup.session_id or call.user or uuid.uuid4().hex
        opens = prompt_opens_reasoning(text) if self.cfg.reasoning else None
        return Prepared(call, ids, cache, opens, hashes, lookup, requested_at, session)

    def _version(self, reported: str | None) -> str:
        if reported:
            self.weight_version = reported
        return self.weight_version

    def headers(self, prep: Prepared | None = None, version: str | None = None) -> dict[str, str]:
        out = {"x-policy-version": version or self.weight_version}
        sid = prep.session_id if prep is not None else ""
        if sid and sid.isascii() and sid.isprintable():  # headers are latin-1: echo only plain ids
            out["x-session-id"] = sid
        return out

    async def _capture(
        self, prep: Prepared, message: dict[str, Any], result: GenerateResult, finish: str,
        cid: str,
    ) -> None:
        call = prep.call
        if call.turn_type != "main":
            return
        wv = result.weight_version or self.weight_version
        turn = Turn(
            session_id=prep.session_id,
            turn_index=max(0, prep.lookup.turn_index),
            turn_type="main",
            model=self.model_name,
            messages=call.raw_messages,
            tools=call.tools,
            response=message,
            prompt_ids=prep.ids,
            response_ids=result.output_ids,
            response_logprobs=result.output_logprobs,
            sampling=call.sampling,
            weight_version=wv,
            policy_version=int(wv) if wv.isdigit() else 0,
            finish_reason=finish,
            completion_id=cid,
            closed_by="session_done" if call.session_done else "next_request",
            requested_at=prep.requested_at,
            responded_at=time.time(),
        )
        await self.capture.finish(turn, prep.cache, response_hash(prep.hashes, message))

    # -- plain --------------------------------------------------------------------------------

    async def complete(self, call: ChatCall) -> tuple[bytes, dict[str, str]]:
        t0 = time.perf_counter()
        prep = await self.prepare(call)
        t_engine = time.perf_counter()
        try:
            result = await self.engine.generate(prep.ids, call.sampling, stop_token_ids=self.stop_ids)
        except EngineError as exc:
            raise engine_error(exc) from None
        engine_s = time.perf_counter() - t_engine
        if result.finish_reason == "abort":
            raise _aborted()
        version = self._version(result.weight_version)
        msg = parse_assistant(
            result.text, tools_enabled=call.tools_enabled, parser=self.cfg.tool_parser,
            reasoning=self.cfg.reasoning, reasoning_open=prep.reasoning_open,
        )  # fmt: skip
        message = message_dict(msg)
        finish = finish_reason(msg, result.finish_reason)
        cid = completion_id()
        body = completion(
            cid, int(time.time()), self.model_name, message, finish,
            len(prep.ids), len(result.output_ids), f"nextstate-{version}",
        )  # fmt: skip
        await self._capture(prep, message, result, finish, cid)
        out = dumps(body)
        total = time.perf_counter() - t0
        M.REQUEST_SECONDS.labels("plain").observe(total)
        M.OVERHEAD_SECONDS.observe(total - engine_s)
        return out, self.headers(prep, version)

    # -- streamed -------------------------------------------------------------------------------

    async def open_stream(self, call: ChatCall) -> tuple[AsyncIterator[bytes], dict[str, str]]:
        """Start the engine stream and wait for its first chunk, so that a dead or stalled
        engine is still a plain 502/504 and the headers carry the serving version."""
        prep = await self.prepare(call)
        chunks = self.engine.stream(prep.ids, call.sampling, stop_token_ids=self.stop_ids)
        try:
            first = await anext(aiter(chunks))
        except (EngineError, StopAsyncIteration) as exc:
            await _aclose(chunks)
            if isinstance(exc, EngineError):
                raise engine_error(exc) from None
            raise _aborted() from None
        version = self._version(first.weight_version)
        return self._events(prep, chunks, first, version), self.headers(prep, version)

    async def _events(
        self, prep: Prepared, chunks: AsyncIterator[GenerateChunk], first: GenerateChunk,
        version: str,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        t0 = time.perf_counter()
        call = prep.call
        out = ChunkWriter(completion_id(), int(time.time()), self.model_name, f"nextstate-{version}")
        parser = StreamParser(call.tools_enabled, self.cfg.tool_parser, self.cfg.reasoning,
                              prep.reasoning_open)  # fmt: skip
        joiner = ChunkJoiner()
        yield out.delta({"role": "assistant", "content": ""})
        chunk = first
        try:
            while True:
                joiner.add(chunk)
                deltas = parser.feed(chunk.new_text) if chunk.new_text else []
                if chunk.done:
                    deltas += parser.finish()
                for d in delta_dicts(deltas):
                    yield out.delta(d)
                if chunk.done:
                    break
                chunk = await anext(aiter(chunks))
        except (EngineError, StopAsyncIteration) as exc:
            err = engine_error(exc) if isinstance(exc, EngineError) else _aborted()
            M.REQUESTS.labels("stream", str(err.status)).inc()
            yield out.error(err)
            return
        finally:
            await _aclose(chunks)
        result = joiner.result()
        if result.finish_reason == "abort":
            M.REQUESTS.labels("stream", "502").inc()
            yield out.error(_aborted())
            return
        message = message_dict(parser.message())
        finish = parser.finish_reason(result.finish_reason)
        yield out.delta({}, finish)
        await self._capture(prep, message, result, finish, out.id)
        if call.include_usage:
            yield out.usage(len(prep.ids), len(result.output_ids))
        yield out.done()
        M.REQUESTS.labels("stream", "200").inc()
        M.REQUEST_SECONDS.labels("stream").observe(time.perf_counter() - t0)


async def _aclose(it: AsyncIterator[Any]) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        await close()
