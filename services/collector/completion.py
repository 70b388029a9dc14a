"""One chat completion, plain or streamed: template -> engine (token ids) -> OpenAI answer.

The hot path (docs/design.md#hot-paths): render the chat template; for a main-line turn
look up the turns this request follows up (one short Redis round trip, capture.py),
whose PromptCache lets the prompt be tokenized incrementally; call the engine through
the process's one pooled client with the exact ids; parse the sampled text into an
assistant message (content, reasoning, tool calls); answer; hand the turn to capture.

A prompt that does not fit the policy's context window is refused before the engine is
called, in the API's own words (context_window.py; a `max_tokens` past the window is
cut to the room left, or refused). Engine failures map to errors in the API's shape:
cannot connect / 5xx / the generation was aborted -> 502, no answer (or no next stream
chunk) within the timeout -> 504, the engine refused the request -> 400 (its prompt too
long: the same overflow refusal; a response_format schema its grammar compiler cannot
use: `param` "response_format"; its own credentials refused: 502). In a stream, a failure
after the first token is one `data: {"error": …}` event and the end of the stream (the
official SDK raises APIError); such a half-finished turn is never captured. Any other
failure once the 200 went out (a bug) ends the stream the same way, never silently.

`n > 1` (non-streamed chat completions only): n engine requests of the same prompt ids
at once, n choices in one response, captured as one group of n turns (`complete_group`).

`logprobs: true` returns the engine's log-prob of every sampled token but a matched stop
token (which is not part of the answer), with `top_logprobs` alternatives asked of the
engine as `top_logprobs_num`; in a stream each chunk carries the entries of the tokens
that arrived since the previous chunk. A `response_format` travels to the engine as
`SamplingParams.json_schema` (constrained decoding) and stays in the captured Turn's
sampling params, marking the sample as constrained.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from services.collector import metrics as M
from services.collector.builtin_tools import DROPPED_HEADER, header_value
from services.collector.capture import Capture, Lookup
from services.collector.context_window import Api, engine_refusal, fit
from services.collector.openai_shapes import (
    ApiError,
    ChunkWriter,
    TokenPieces,
    choice,
    completion,
    completion_id,
    completion_of,
    dumps,
    logprob_content,
)
from services.collector.pairing import (
    Conversation,
    analyze,
    candidates,
    offer,
    response_hash,
    stored_anchors,
)
from services.collector.pending_store import KeyValue
from services.collector.request import ChatCall
from services.collector.settings import CollectorConfig
from services.collector.text_logprobs import text_logprobs
from shared.chat import ChatTemplate, ChatTemplateError, PromptCache
from shared.engine_client import (
    ChunkJoiner,
    EngineClient,
    GenerateChunk,
    GenerateResult,
    SamplingLike,
)
from shared.engine_client.base import TopLogprobs
from shared.errors import EngineError, EngineRejected, EngineTimeout
from shared.schemas import SamplingParams, Turn
from shared.toolcalls import (
    Delta,
    SpecialText,
    StreamParser,
    delta_dicts,
    finish_reason,
    message_dict,
    output_markers,
    parse_assistant,
    prompt_opens_reasoning,
)

log = logging.getLogger(__name__)


def engine_error(exc: EngineError, api: Api = "chat") -> ApiError:
    """An engine failure as the client sees it (details of an outage go to the log, not
    the client; a refusal says why, an overflow in `api`'s words: context_window.py)."""
    log.warning("engine call failed: %s", exc)
    if isinstance(exc, EngineTimeout):
        return ApiError(504, "the model server did not answer in time; retry later",
                        code="engine_timeout", kind="server_error")  # fmt: skip
    if isinstance(exc, EngineRejected):
        return engine_refusal(api, exc)
    return ApiError(502, "the model server is unavailable; retry later",
                    code="engine_unavailable", kind="server_error")  # fmt: skip


def choice_sampling(sampling: SamplingParams, i: int) -> SamplingParams:
    """Choice i's sampling parameters: seed + i when a seed is set (the choices differ,
    each reproducible), else the call's."""
    if sampling.seed is None or i == 0:
        return sampling
    return sampling.model_copy(update={"seed": sampling.seed + i})


def with_seed(sampling: SamplingLike, seed: int | None) -> SamplingLike:
    """What goes to the engine for a choice: the prepared sampling with that choice's seed."""
    if isinstance(sampling, SamplingParams):
        return sampling if sampling.seed == seed else sampling.model_copy(update={"seed": seed})
    return sampling if sampling.get("seed") == seed else {**sampling, "seed": seed}


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
    sampling: SamplingLike  # what the engine gets: `params`, asking to keep special tokens when `drop` is set
    drop: SpecialText | None  # special tokens' text to remove from the output
    reasoning_open: bool | None
    conv: Conversation | None  # a main-line turn's messages as pairing sees them
    lookup: Lookup
    requested_at: float
    session_id: str
    conversation: str = ""  # what a retry replaces (capture.make_record): X-Session-Id, else inherited
    params: SamplingParams | None = None  # the call's, max_tokens fitted to the window (None: as sent)

    @property
    def sampling_params(self) -> SamplingParams:
        """The sampling parameters the answer is sampled with (what its turn records)."""
        return self.params or self.call.sampling


@dataclass(slots=True)
class Answer:
    """One generated answer, parsed into an assistant message (chat completions' shape):
    what every API shapes its response from and what the captured `Turn` holds."""

    prep: Prepared
    result: GenerateResult
    message: dict[str, Any]
    finish: str  # chat's finish_reason: stop | length | tool_calls
    version: str
    id: str  # the API's id for it (chatcmpl-…, resp_…, msg_…); the Turn's completion_id
    engine_s: float = 0.0
    sampling: SamplingParams | None = None  # a group member's own (its seed); None: the call's

    @property
    def prompt_tokens(self) -> int:
        return len(self.prep.ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.result.output_ids)

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the answer, if one did."""
        stop = self.result.matched_stop
        return stop if self.result.finish_reason == "stop" and isinstance(stop, str) else None


class ChatService:
    def __init__(
        self, cfg: CollectorConfig, engine: EngineClient, template: ChatTemplate,
        capture: Capture, model_name: str, weight_version: str = "unknown",
        context_length: int | None = None,
    ) -> None:  # fmt: skip
        self.cfg = cfg
        self.context_length = context_length  # None: unknown (the engine's refusal is mapped)
        self.engine = engine
        self.template = template
        self.capture = capture
        self.model_name = model_name
        self.weight_version = weight_version
        self.stop_ids = list(template.stop_token_ids)
        self._pieces: TokenPieces | None = None
        self._warned_tools = False

    # -- log-probs ---------------------------------------------------------------------------

    def _engine_kwargs(self, call: ChatCall) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"stop_token_ids": self.stop_ids}
        if call.logprobs and call.top_logprobs > 0:
            kwargs["top_logprobs_num"] = call.top_logprobs
        return kwargs

    def _engine_error(self, call: ChatCall, exc: EngineError) -> ApiError:
        err = engine_error(exc, call.api)
        if err.code == "engine_rejected" and call.sampling.json_schema is not None and (
            "json_schema" in str(exc) or "grammar" in str(exc) or "structured" in str(exc)
        ):
            err.param = "response_format"
        return err

    def _logprob_entries(
        self, call: ChatCall, ids: list[int], logprobs: list[float], top: list[TopLogprobs],
        matched_stop: int | str | None,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """OpenAI's `logprobs.content` for these sampled tokens, minus a matched stop token."""
        n = len(ids)
        if isinstance(matched_stop, int) and ids and ids[-1] == matched_stop:
            n -= 1
        if len(logprobs) < n:
            raise ApiError(502, "the model server returned no log-probs for this answer",
                           code="engine_logprobs", kind="server_error")  # fmt: skip
        if self._pieces is None:
            self._pieces = TokenPieces(self.template.tokenizer)
        return logprob_content(self._pieces, ids[:n], logprobs[:n], top[:n], call.top_logprobs)

    def text_logprobs(self, ans: Answer) -> list[dict[str, Any]]:
        """The log-prob entries of the tokens a plain answer's text came from (the Responses
        API's output_text.logprobs; text_logprobs.py): the sampled text parsed again as
        one stream chunk, so a plain and a streamed answer tie the same tokens to the text."""
        call, result = ans.prep.call, ans.result
        entries = self._logprob_entries(
            call, result.output_ids, result.output_logprobs, result.output_top_logprobs,
            result.matched_stop if result.finish_reason == "stop" else None,
        )  # fmt: skip
        parser = StreamParser(call.tools_enabled, self.cfg.tool_parser, self.cfg.reasoning,
                              ans.prep.reasoning_open, drop=ans.prep.drop)  # fmt: skip
        return text_logprobs(parser.feed(result.text) + parser.finish(), entries)

    # -- shared steps ----------------------------------------------------------------------

    def _unrendered_tools(self) -> None:
        """A request offered tools the chat template leaves out: the model never sees them."""
        M.UNRENDERED_TOOLS.inc()
        if not self._warned_tools:
            self._warned_tools = True
            log.warning("requests offer tools, but the model's chat template renders no tools: the "
                        "model never sees them and will not call them (serve a model whose template "
                        "takes tools, or set NEXTSTATE_COLLECTOR__CHAT_TEMPLATE); counted in "
                        "nextstate_collector_unrendered_tools_total", extra={"model": self.model_name})

    async def prepare(self, call: ChatCall) -> Prepared:
        requested_at = time.time()
        if call.tools and not self.template.renders_tools:
            self._unrendered_tools()
        try:
            prompt = self.template.render_prompt(call.messages, call.tools)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        conv: Conversation | None = None
        lookup = Lookup()
        if call.turn_type == "main":
            M.SESSION_IDS.labels(call.session_from or ("user" if call.user else "none")).inc()
            conv = analyze(call.messages, call.session_hint or call.user)
            cands = candidates(call.messages, conv.hashes, self.cfg.max_pairing_candidates)
            tolerant = offer(conv, self.cfg.pairing_min_anchor_chars) if self.cfg.pairing == "anchors" else None
            lookup = await self.capture.begin(call.raw_messages, cands, tolerant, scoped=bool(conv.scope))
        try:
            ids, cache = self.template.encode_rendering(prompt, lookup.cache)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        M.TOKENIZE.labels("incremental" if lookup.cache is not None else "full").inc()
        asked = call.sampling.max_tokens
        room = fit(call.api, len(ids), self.context_length, asked, self.cfg.max_tokens_over_context)
        base = call.sampling if room == asked else call.sampling.model_copy(update={"max_tokens": room})
        fresh = uuid.uuid4().hex
        session = call.session_hint or lookup.session_id or call.user or fresh
        # Only our own session id says two turns are one conversation (a retry replaces its
        # turn): an agent's or a user's can be several (sessions.py).
        explicit = call.session_from in ("x-session-id", "session_id")
        conversation = call.session_hint if explicit and call.session_hint else lookup.conversation or fresh
        opens = prompt_opens_reasoning(prompt.text) if self.cfg.reasoning else None
        # A tool-call or reasoning marker that is a special token must survive decoding.
        markers = output_markers(self.cfg.tool_parser, tools_enabled=call.tools_enabled,
                                 reasoning=self.cfg.reasoning)  # fmt: skip
        drop = self.template.output_special_text(markers)
        sampling: SamplingLike = base if drop is None else {
            **base.model_dump(exclude_none=True), "skip_special_tokens": False}  # fmt: skip
        return Prepared(call, ids, cache, sampling, drop, opens, conv, lookup, requested_at, session,
                        conversation, None if base is call.sampling else base)  # fmt: skip

    def prompt_tokens(self, call: ChatCall) -> int:
        """The length of `call`'s prompt: the ids a captured turn of it would hold (the
        template rendered and tokenized whole, as `prepare` does without a pending turn)."""
        try:
            ids, _ = self.template.encode_rendering(self.template.render_prompt(call.messages, call.tools))
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        return len(ids)

    def _version(self, reported: str | None) -> str:
        if reported:
            self.weight_version = reported
        return self.weight_version

    def headers(self, prep: Prepared | None = None, version: str | None = None) -> dict[str, str]:
        out = {"x-policy-version": version or self.weight_version}
        if prep is None:
            return out
        sid = prep.session_id
        if sid and sid.isascii() and sid.isprintable():  # headers are latin-1: echo only plain ids
            out["x-session-id"] = sid
        if prep.call.dropped_tools:
            out[DROPPED_HEADER] = header_value(prep.call.dropped_tools)
        return out

    def _turn(self, ans: Answer, group: tuple[str, int, int] | None = None) -> Turn:
        """The Turn of an answer; `group`: (id, choice index, size) of a group member."""
        prep, result, call = ans.prep, ans.result, ans.prep.call
        wv = result.weight_version or self.weight_version
        gid, index, size = group if group is not None else (None, 0, 1)
        return Turn(
            session_id=prep.session_id,
            turn_index=max(0, prep.lookup.turn_index),
            turn_type="main",
            model=self.model_name,
            messages=call.raw_messages,
            tools=call.tools,
            response=ans.message,
            prompt_ids=prep.ids,
            response_ids=result.output_ids,
            response_logprobs=result.output_logprobs,
            sampling=ans.sampling or prep.sampling_params,
            weight_version=wv,
            policy_version=int(wv) if wv.isascii() and wv.isdigit() else 0,
            finish_reason=ans.finish,
            completion_id=ans.id,
            closed_by="session_done" if call.session_done else "next_request",
            user=call.user,
            requested_at=prep.requested_at,
            responded_at=time.time(),
            group_id=gid,
            group_index=index,
            group_size=size,
        )

    # -- plain --------------------------------------------------------------------------------

    async def generate(self, call: ChatCall, answer_id: str) -> Answer:
        """Template, engine, parse: the answer, not captured yet (`keep` does that)."""
        prep = await self.prepare(call)
        t_engine = time.perf_counter()
        try:
            result = await self.engine.generate(prep.ids, prep.sampling, **self._engine_kwargs(call))
        except EngineError as exc:
            raise self._engine_error(call, exc) from None
        return self._answer(prep, result, answer_id, time.perf_counter() - t_engine)

    def _answer(self, prep: Prepared, result: GenerateResult, answer_id: str, engine_s: float,
                sampling: SamplingParams | None = None) -> Answer:  # fmt: skip
        if result.finish_reason == "abort":
            raise _aborted()
        call = prep.call
        version = self._version(result.weight_version)
        msg = parse_assistant(
            result.text, tools_enabled=call.tools_enabled, parser=self.cfg.tool_parser,
            reasoning=self.cfg.reasoning, reasoning_open=prep.reasoning_open, drop=prep.drop,
        )  # fmt: skip
        return Answer(prep, result, message_dict(msg), finish_reason(msg, result.finish_reason),
                      version, answer_id, engine_s, sampling)  # fmt: skip

    async def keep(self, ans: Answer, extra: ExtraWrite | None = None) -> None:
        """Store the answer's turn as pending (or emit it), with `extra` (e.g. a stored
        Responses object) in the same Redis round trip when there is one: both are done
        before the answer goes out."""
        written = False
        conv = ans.prep.conv
        if conv is not None:  # a main-line turn
            key = response_hash(conv.hashes, ans.message)
            written = await self.capture.finish(self._turn(ans), ans.prep.cache, key,
                                                None if extra is None else extra.item,
                                                self._anchors(conv, ans.message), ans.prep.conversation)  # fmt: skip
        if extra is not None:
            await extra.done(written)

    def _anchors(self, conv: Conversation, message: dict[str, Any]) -> list[str]:
        """The anchors a pending turn of `message` registers (none under the prefix rule)."""
        if self.cfg.pairing != "anchors":
            return []
        return stored_anchors(conv, message, self.cfg.pairing_min_anchor_chars)

    def observe(self, ans: Answer, t0: float) -> None:
        total = time.perf_counter() - t0
        M.REQUEST_SECONDS.labels("plain").observe(total)
        M.OVERHEAD_SECONDS.observe(total - ans.engine_s)

    def _logprobs(self, ans: Answer) -> dict[str, Any] | None:
        """`choices[].logprobs` of an answer when the call asked for them."""
        call, result = ans.prep.call, ans.result
        if not call.logprobs:
            return None
        entries = self._logprob_entries(
            call, result.output_ids, result.output_logprobs, result.output_top_logprobs,
            result.matched_stop if result.finish_reason == "stop" else None,
        )  # fmt: skip
        return {"content": entries, "refusal": None}

    async def complete(self, call: ChatCall) -> tuple[bytes, dict[str, str]]:
        if call.n > 1:
            return await self.complete_group(call)
        t0 = time.perf_counter()
        ans = await self.generate(call, completion_id())
        body = completion(
            ans.id, int(time.time()), self.model_name, ans.message, ans.finish,
            ans.prompt_tokens, ans.completion_tokens, f"nextstate-{ans.version}", self._logprobs(ans),
        )  # fmt: skip
        await self.keep(ans)
        out = dumps(body)
        self.observe(ans, t0)
        return out, self.headers(ans.prep, ans.version)

    # -- groups: n > 1 choices ----------------------------------------------------------------

    async def complete_group(self, call: ChatCall) -> tuple[bytes, dict[str, str]]:
        """n choices sampled from one prompt: n engine requests of the same ids at once
        (the engine's prefix cache shares the prompt: SGLang's radix cache, vLLM's prefix
        caching; ours prefills each and decodes them in one batch), so the client code is
        the one every engine speaks. With a seed, choice i samples with seed + i. Any
        failure fails the request (the others are cancelled) and nothing is captured.
        Captured as one group: n turns sharing the completion's id as `group_id`."""
        t0 = time.perf_counter()
        cid = completion_id()
        prep = await self.prepare(call)
        kwargs = self._engine_kwargs(call)
        samplings = [choice_sampling(prep.sampling_params, i) for i in range(call.n)]
        t_engine = time.perf_counter()
        tasks = [asyncio.create_task(self.engine.generate(prep.ids, with_seed(prep.sampling, sp.seed), **kwargs))
                 for sp in samplings]  # fmt: skip
        try:
            results = await asyncio.gather(*tasks)
        except BaseException as exc:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if isinstance(exc, EngineError):
                raise self._engine_error(call, exc) from None
            raise
        engine_s = time.perf_counter() - t_engine
        answers = [self._answer(prep, r, cid, engine_s, sp) for r, sp in zip(results, samplings, strict=True)]
        first = answers[0]
        choices = [choice(i, a.message, a.finish, self._logprobs(a)) for i, a in enumerate(answers)]
        body = completion_of(
            cid, int(time.time()), self.model_name, choices, first.prompt_tokens,
            sum(a.completion_tokens for a in answers), f"nextstate-{first.version}",
        )  # fmt: skip
        if prep.conv is not None:  # a main-line turn
            turns = [self._turn(a, (cid, i, call.n)) for i, a in enumerate(answers)]
            keys = [response_hash(prep.conv.hashes, a.message) for a in answers]
            anchors = [self._anchors(prep.conv, a.message) for a in answers]
            await self.capture.finish_group(turns, prep.cache, keys, anchors, prep.conversation)
        M.GROUP_CHOICES.inc(call.n)
        out = dumps(body)
        self.observe(first, t0)
        return out, self.headers(prep, first.version)

    # -- streamed -------------------------------------------------------------------------------

    async def open_stream(
        self, call: ChatCall, writer: WriterFactory | None = None
    ) -> tuple[AsyncIterator[bytes], dict[str, str]]:
        """Start the engine stream and wait for its first chunk, so that a dead or stalled
        engine is still a plain 502/504 and the headers carry the serving version. `writer`
        shapes the events (default: chat completion chunks)."""
        prep = await self.prepare(call)
        chunks = self.engine.stream(prep.ids, prep.sampling, **self._engine_kwargs(call))
        try:
            first = await anext(aiter(chunks))
        except (EngineError, StopAsyncIteration) as exc:
            await _aclose(chunks)
            if isinstance(exc, EngineError):
                raise self._engine_error(call, exc) from None
            raise _aborted() from None
        version = self._version(first.weight_version)
        make = writer or self._chat_writer
        return self._events(prep, chunks, first, version, make(prep, version)), self.headers(prep, version)

    def _chat_writer(self, prep: Prepared, version: str) -> EventWriter:
        return ChatEvents(completion_id(), self.model_name, version, prep.call.include_usage)

    async def _events(
        self, prep: Prepared, chunks: AsyncIterator[GenerateChunk], first: GenerateChunk,
        version: str, out: EventWriter,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        """The stream's events; whatever fails once the 200 went out, the stream ends with
        an error event in its API's shape, never a silent close."""
        try:
            async for event in self._stream_events(prep, chunks, first, version, out):
                yield event
        except Exception as exc:
            log.exception("a streamed answer failed after its headers")
            await _aclose(chunks)
            self._count_stream(isinstance(out, ChatEvents), 500)
            err = ApiError(500, f"internal error: {type(exc).__name__}; retry the request",
                           code="internal_error", kind="server_error")  # fmt: skip
            try:
                yield out.error(err)
            except Exception:  # the writer itself is broken: OpenAI's shape, as chat sends it
                yield ChunkWriter.error(err)

    async def _stream_events(
        self, prep: Prepared, chunks: AsyncIterator[GenerateChunk], first: GenerateChunk,
        version: str, out: EventWriter,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        t0 = time.perf_counter()
        call = prep.call
        chat = isinstance(out, ChatEvents)
        parser = StreamParser(call.tools_enabled, self.cfg.tool_parser, self.cfg.reasoning,
                              prep.reasoning_open, drop=prep.drop)  # fmt: skip
        joiner = ChunkJoiner()
        for event in out.start():
            yield event
        chunk = first
        entries: list[dict[str, Any]] = []
        try:
            while True:
                joiner.add(chunk)
                if call.logprobs:
                    entries = self._logprob_entries(
                        call, chunk.new_ids, chunk.new_logprobs, chunk.new_top_logprobs,
                        chunk.matched_stop if chunk.finish_reason == "stop" else None,
                    )  # fmt: skip
                deltas = parser.feed(chunk.new_text) if chunk.new_text else []
                if chunk.done:
                    deltas += parser.finish()
                if deltas or entries:
                    for event in out.feed(deltas, entries):
                        yield event
                if chunk.done:
                    break
                chunk = await anext(aiter(chunks))
        except (ApiError, EngineError, StopAsyncIteration) as exc:
            if isinstance(exc, ApiError):
                err = exc
            else:
                err = self._engine_error(call, exc) if isinstance(exc, EngineError) else _aborted()
            self._count_stream(chat, err.status)
            yield out.error(err)
            return
        finally:
            await _aclose(chunks)
        result = joiner.result()
        if result.finish_reason == "abort":
            self._count_stream(chat, 502)
            yield out.error(_aborted())
            return
        msg = parser.message()
        ans = Answer(prep, result, message_dict(msg), parser.finish_reason(result.finish_reason),
                     version, out.answer_id, 0.0)  # fmt: skip
        # Captured (and persisted) before the closing events: a client that follows up as
        # soon as it has them cannot outrun its pending turn.
        await self.keep(ans, out.persist(ans))
        for event in out.end(ans):
            yield event
        self._count_stream(chat, 200)
        M.REQUEST_SECONDS.labels("stream").observe(time.perf_counter() - t0)

    @staticmethod
    def _count_stream(chat: bool, status: int) -> None:
        if chat:
            M.REQUESTS.labels("stream", str(status)).inc()


class ExtraWrite(Protocol):
    """A key written with an answer's capture: in its pending turn's round trip when there
    is one (`done(True)`), else on its own by `done(False)` (response_store.StoredWrite)."""

    @property
    def item(self) -> KeyValue:
        """The key, its value and TTL in ms."""

    async def done(self, written: bool) -> None:
        """Called once the capture is done: `written` says whether `item` went with it."""


class EventWriter(Protocol):
    """The events of one streamed answer in an API's wire format (chat completion chunks,
    Responses events, Anthropic message events)."""

    answer_id: str

    def start(self) -> list[bytes]:
        """Events before the first token."""

    def feed(self, deltas: list[Delta], logprobs: list[dict[str, Any]]) -> list[bytes]:
        """Events for the parsed deltas of one engine chunk (`logprobs`: chat only)."""

    def persist(self, ans: Answer) -> ExtraWrite | None:
        """A write to finish with the capture, before the closing events, if any."""

    def end(self, ans: Answer) -> list[bytes]:
        """The closing events, once the turn is captured."""

    def error(self, err: ApiError) -> bytes:
        """A failure after the stream began: one event, then the end of the stream."""


WriterFactory = Callable[[Prepared, str], EventWriter]


class ChatEvents:
    """Chat completion chunks: `data: {chunk}`, then `data: [DONE]`."""

    def __init__(self, answer_id: str, model: str, version: str, include_usage: bool) -> None:
        self.answer_id = answer_id
        self.out = ChunkWriter(answer_id, int(time.time()), model, f"nextstate-{version}")
        self.include_usage = include_usage
        self.pending: list[dict[str, Any]] = []  # log-prob entries not sent yet

    def start(self) -> list[bytes]:
        return [self.out.delta({"role": "assistant", "content": ""})]

    def feed(self, deltas: list[Delta], logprobs: list[dict[str, Any]]) -> list[bytes]:
        self.pending += logprobs
        events = []
        for d in delta_dicts(deltas):
            lp = {"content": self.pending, "refusal": None} if self.pending else None
            self.pending = []
            events.append(self.out.delta(d, logprobs=lp))
        return events

    def persist(self, ans: Answer) -> ExtraWrite | None:
        return None

    def end(self, ans: Answer) -> list[bytes]:
        lp = {"content": self.pending, "refusal": None} if self.pending else None
        events = [self.out.delta({}, ans.finish, logprobs=lp)]
        if self.include_usage:
            events.append(self.out.usage(ans.prompt_tokens, ans.completion_tokens))
        events.append(self.out.done())
        return events

    def error(self, err: ApiError) -> bytes:
        return self.out.error(err)


async def _aclose(it: AsyncIterator[Any]) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        await close()
