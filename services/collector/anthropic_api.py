"""`POST /v1/messages` (and `/v1/messages/count_tokens`): Anthropic's Messages API, answered
the Anthropic way.

The request becomes the internal conversation (anthropic_request.py) and goes down the
one answer path every API shares (completion.py), so its `Turn` is the one a chat
completion of the same conversation would give. The answer is shaped here:

- the message: `id` (msg_…), `content` blocks — `thinking` (when the model thinks and
  the collector parses reasoning; `signature` empty), one `text` block, a `tool_use`
  block per tool call (`id` is the tool call's id, as the captured turn has it;
  `input` its parsed arguments) — `stop_reason` end_turn / max_tokens / stop_sequence
  (with `stop_sequence`) / tool_use, and `usage`;
- streamed: `event: <type>` / `data: {…}` server-sent events — `message_start`, `ping`;
  per block `content_block_start`, `content_block_delta`s (`text_delta`,
  `thinking_delta`, or for a tool call one `input_json_delta` with the whole input, as
  a call is known valid only once it closes) and `content_block_stop`; then
  `message_delta` (stop reason, output tokens) and `message_stop`. A failure after the
  stream began is one `error` event. Text after a tool call is a new text block;
- errors: `{"type": "error", "error": {"type", "message"}, "request_id"}` with
  Anthropic's error types for the status (invalid_request_error, authentication_error,
  not_found_error, request_too_large, rate_limit_error, api_error, overloaded_error).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from services.collector.anthropic_request import (
    MessagesRequest,
    build_count_call,
    build_messages_call,
    parse_count_tokens,
    parse_messages,
)
from services.collector.completion import Answer, ChatService, EventWriter, ExtraWrite, Prepared
from services.collector.openai_shapes import ApiError, dumps
from shared.toolcalls import ContentDelta, Delta, ReasoningDelta

Reply = tuple[bytes | AsyncIterator[bytes], dict[str, str]]

ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
    429: "rate_limit_error", 529: "overloaded_error",
}  # fmt: skip


def error_body(err: ApiError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message},
            "request_id": "req_" + uuid.uuid4().hex}  # fmt: skip


def error_bytes(err: ApiError) -> bytes:
    return dumps(error_body(err))


def model_info(name: str, context_length: int | None) -> dict[str, Any]:
    """The served model as Anthropic's Models API describes one (`max_input_tokens`: the
    longest prompt that fits; `max_tokens`: the most it can then generate)."""
    info: dict[str, Any] = {"type": "model", "id": name, "display_name": name,
                            "created_at": "1970-01-01T00:00:00Z", "lifecycle": "active"}  # fmt: skip
    if context_length is not None:
        info["max_input_tokens"] = context_length - 1
        info["max_tokens"] = context_length - 1
    return info


def model_page(name: str, context_length: int | None) -> dict[str, Any]:
    return {"data": [model_info(name, context_length)], "has_more": False, "first_id": name,
            "last_id": name}  # fmt: skip


def stop_reason(ans: Answer) -> str:
    if ans.finish == "tool_calls":
        return "tool_use"
    if ans.finish == "length":
        return "max_tokens"
    return "stop_sequence" if ans.stop_sequence is not None else "end_turn"


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments (a JSON object's text, as the parsers give them) as `input`."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(message: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An assistant message (chat's shape) as Anthropic content blocks."""
    out: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        out.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        out.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        fn = call["function"]
        out.append({"type": "tool_use", "id": call["id"], "name": fn["name"],
                    "input": tool_input(fn["arguments"])})  # fmt: skip
    return out


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}  # fmt: skip


def message_body(mid: str, model: str, ans: Answer) -> dict[str, Any]:
    return {"id": mid, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(ans.message), "stop_reason": stop_reason(ans),
            "stop_sequence": ans.stop_sequence,
            "usage": usage(ans.prompt_tokens, ans.completion_tokens)}  # fmt: skip


class MessageEvents(EventWriter):
    """The server-sent events of one streamed message."""

    def __init__(self, mid: str, model: str, prompt_tokens: int) -> None:
        self.answer_id = mid
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.index = -1  # of the open block
        self.open: str | None = None  # its kind: thinking | text

    @staticmethod
    def _ev(kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + dumps({"type": kind, **fields}) + b"\n\n"

    def start(self) -> list[bytes]:
        message: dict[str, Any] = {"id": self.answer_id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage(self.prompt_tokens, 0)}  # fmt: skip
        return [self._ev("message_start", message=message), self._ev("ping")]

    def _block(self, block: dict[str, Any], out: list[bytes]) -> None:
        self._stop(out)
        self.index += 1
        self.open = block["type"]
        out.append(self._ev("content_block_start", index=self.index, content_block=block))

    def _stop(self, out: list[bytes]) -> None:
        if self.open is not None:
            out.append(self._ev("content_block_stop", index=self.index))
            self.open = None

    def feed(self, deltas: list[Delta], logprobs: list[dict[str, Any]]) -> list[bytes]:
        out: list[bytes] = []
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                if self.open != "thinking":
                    self._block({"type": "thinking", "thinking": "", "signature": ""}, out)
                delta: dict[str, Any] = {"type": "thinking_delta", "thinking": d.text}
            elif isinstance(d, ContentDelta):
                if self.open != "text":
                    self._block({"type": "text", "text": ""}, out)
                delta = {"type": "text_delta", "text": d.text}
            else:
                self._block({"type": "tool_use", "id": d.id, "name": d.name, "input": {}}, out)
                delta = {"type": "input_json_delta", "partial_json": d.arguments}
            out.append(self._ev("content_block_delta", index=self.index, delta=delta))
            if delta["type"] == "input_json_delta":
                self._stop(out)
        return out

    def persist(self, ans: Answer) -> ExtraWrite | None:
        return None

    def end(self, ans: Answer) -> list[bytes]:
        out: list[bytes] = []
        self._stop(out)
        out.append(self._ev("message_delta", delta={"stop_reason": stop_reason(ans),
                                                    "stop_sequence": ans.stop_sequence},
                            usage={"output_tokens": ans.completion_tokens}))  # fmt: skip
        out.append(self._ev("message_stop"))
        return out

    def error(self, err: ApiError) -> bytes:
        return b"event: error\ndata: " + error_bytes(err) + b"\n\n"


class MessagesApi:
    def __init__(self, service: ChatService) -> None:
        self.service = service

    async def count_tokens(self, raw: bytes, headers: Mapping[str, str]) -> Reply:
        """`POST /v1/messages/count_tokens`: {"input_tokens": N}, N the prompt ids a
        `/v1/messages` request of this conversation is answered from and captured with
        (its `usage.input_tokens`)."""
        call = build_count_call(parse_count_tokens(raw), self.service.cfg)
        return dumps({"input_tokens": self.service.prompt_tokens(call)}), self.service.headers()

    async def create(self, raw: bytes, headers: Mapping[str, str]) -> Reply:
        service = self.service
        req: MessagesRequest = parse_messages(raw)
        mc = build_messages_call(req, headers, service.cfg)
        mid = "msg_" + uuid.uuid4().hex
        if mc.call.stream:
            def writer(prep: Prepared, version: str) -> EventWriter:
                return MessageEvents(mid, service.model_name, len(prep.ids))

            return await service.open_stream(mc.call, writer)
        t0 = time.perf_counter()
        ans = await service.generate(mc.call, mid)
        body = message_body(mid, service.model_name, ans)
        await service.keep(ans)
        service.observe(ans, t0)
        return dumps(body), service.headers(ans.prep, ans.version)
