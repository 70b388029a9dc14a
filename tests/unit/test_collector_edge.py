"""Bad input at the edge gets a 400 in its API's shape, never a 5xx: integers beyond 64
bits anywhere in a body, non-string tool types, query numbers int() refuses; and a
stream that fails once its 200 went out still ends with an error event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.collector.anthropic_request import parse_count_tokens, parse_messages
from services.collector.capture import Lookup
from services.collector.completion import ChatService, Prepared
from services.collector.input_items import page_params
from services.collector.openai_shapes import ApiError
from services.collector.request import INT64_MAX, INT64_MIN, make_call, parse_body
from services.collector.responses_api import ResponsesEvents, ResponseShape
from services.collector.responses_request import parse_responses
from services.collector.settings import CollectorConfig
from shared.chat import PromptCache
from shared.engine_client import GenerateChunk

CHAT = {"model": "m", "messages": [{"role": "user", "content": "q"}]}


@pytest.mark.parametrize(("body", "where", "param"), [
    ({**CHAT, "seed": 1 << 64}, "seed", "seed"),
    ({**CHAT, "max_tokens": 10**30}, "max_tokens", "max_tokens"),
    ({**CHAT, "top_k": -(10**25)}, "top_k", "top_k"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "maximum": 10**20}}}}}]},
     "tools[0].function.parameters.properties.n.maximum", "tools"),
    ({**CHAT, "metadata": {"k": "v"}, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": [1, 2**70]}}}}, "response_format.json_schema.schema.enum[1]",
     "response_format"),
])  # fmt: skip
def test_chat_integers_beyond_64_bits_are_a_400_naming_the_place(body: dict[str, Any], where: str,
                                                                 param: str) -> None:  # fmt: skip
    with pytest.raises(ApiError) as bad:
        parse_body(json.dumps(body).encode())
    assert (bad.value.status, bad.value.param) == (400, param)
    assert bad.value.message.startswith(f"Invalid '{where}': integer ")
    assert bad.value.code in ("integer_above_max_value", "integer_below_min_value")


def test_integers_at_the_bounds_and_long_digit_strings_pass() -> None:
    assert parse_body(json.dumps({**CHAT, "seed": INT64_MAX}).encode()).seed == INT64_MAX
    assert parse_body(json.dumps({**CHAT, "seed": INT64_MIN}).encode()).seed == INT64_MIN
    text = {**CHAT, "messages": [{"role": "user", "content": "9" * 400}]}
    assert parse_body(json.dumps(text).encode()).messages[0]["content"] == "9" * 400


def test_responses_and_messages_bound_their_integers_too() -> None:
    with pytest.raises(ApiError, match=r"'max_output_tokens': integer above") as bad:
        parse_responses(json.dumps({"model": "m", "input": "q", "max_output_tokens": 1 << 70}).encode())
    assert bad.value.param == "max_output_tokens"
    with pytest.raises(ApiError, match=r"'tools\[0\].parameters.x': integer above"):
        parse_responses(json.dumps({"model": "m", "input": "q", "tools": [
            {"type": "function", "name": "f", "parameters": {"x": 1 << 64}}]}).encode())  # fmt: skip
    # Anthropic's paths are dotted (messages.0.content).
    with pytest.raises(ApiError, match=r"'tools.0.input_schema.maximum': integer above"):
        parse_messages(json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "q"}],
                                   "tools": [{"name": "f", "input_schema": {"maximum": 1 << 64}}]}).encode())  # fmt: skip
    with pytest.raises(ApiError, match=r"'max_tokens': integer above"):
        parse_messages(json.dumps({"model": "m", "max_tokens": 1 << 64, "messages": [{"role": "user", "content": "q"}]}).encode())
    with pytest.raises(ApiError, match="integer above"):
        parse_count_tokens(json.dumps({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "q", "n": 1 << 64}]}]}).encode())  # fmt: skip


@pytest.mark.parametrize("limit", ["²", "١٢", "1e3", "-1", "0", "101", "", " ", "9" * 40])
def test_input_items_limit_must_be_plain_digits(limit: str) -> None:
    with pytest.raises(ApiError, match="Invalid 'limit'") as bad:
        page_params({"limit": limit}, [])
    assert (bad.value.status, bad.value.param) == (400, "limit")


def test_input_items_limit_in_range() -> None:
    assert page_params({"limit": "7"}, []) == (7, "desc", None)


# -- a stream that fails after its headers ----------------------------------------------------------


class BrokenEvents(ResponsesEvents):
    """A writer whose second event cannot be serialized (what a 2**64 echoed in `tools` did)."""

    def feed(self, deltas: Any, logprobs: Any) -> list[bytes]:
        raise TypeError("Integer exceeds 64-bit range")


async def _chunks() -> AsyncIterator[GenerateChunk]:
    yield GenerateChunk(new_ids=[2], new_logprobs=[-0.1], new_text="b", text="ab", finish_reason="stop")


async def test_a_stream_that_fails_after_its_headers_ends_with_an_error_event() -> None:
    cfg = CollectorConfig()
    call = make_call([{"role": "user", "content": "q"}], None, tools_enabled=False, headers={}, cfg=cfg,
                     stream=True, api="responses")  # fmt: skip
    prep = Prepared(call, [1, 2, 3], PromptCache(text="", ids=[], cuts=[]), call.sampling, None, None, None,
                    Lookup(), 0.0, "s")  # fmt: skip
    req = parse_responses(b'{"model": "m", "input": "q", "stream": true}')
    writer = BrokenEvents(ResponseShape(req, "m", call.sampling), None, [])
    service = ChatService.__new__(ChatService)  # what _events uses of it: cfg
    service.cfg = cfg
    first = GenerateChunk(new_ids=[1], new_logprobs=[-0.1], new_text="a", text="a")
    events = [e async for e in service._events(prep, _chunks(), first, "3", writer)]
    kinds = [e.split(b"\n", 1)[0] for e in events]
    assert kinds == [b"event: response.created", b"event: response.in_progress", b"event: error"]
    error = json.loads(events[-1].split(b"data: ", 1)[1])
    assert error["type"] == "error" and error["code"] == "internal_error"
    assert error["message"].startswith("internal error: TypeError")
