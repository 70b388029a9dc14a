"""The Responses and Messages APIs' translation: requests into the internal conversation
(what a chat completion of the same exchange sends), answers into each API's shapes, and
streamed events that the official SDKs accumulate into the same answer."""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from services.collector.anthropic_api import (
    MessageEvents,
    content_blocks,
    error_body,
    message_body,
    stop_reason,
)
from services.collector.anthropic_request import build_messages_call, parse_messages
from services.collector.capture import Lookup
from services.collector.completion import Answer, Prepared
from services.collector.openai_shapes import ApiError
from services.collector.pairing import canonical
from services.collector.request import make_call
from services.collector.responses_api import ResponsesEvents, ResponseShape, output_items
from services.collector.responses_request import build_responses_call, parse_responses
from services.collector.settings import CollectorConfig
from shared.chat import PromptCache
from shared.engine_client import GenerateResult
from shared.toolcalls import ContentDelta, ReasoningDelta, ToolCallDelta

FN = {"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}
CHAT_TOOLS = [{"type": "function", "function": FN}]
ARGS = '{"city": "Paris"}'
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
ANSWER: dict[str, Any] = {"role": "assistant", "content": "Let me look.", "reasoning_content": "hm",
                          "tool_calls": [CALL]}  # fmt: skip


def responses(body: dict[str, Any], prior: list[dict[str, Any]] | None = None,
              headers: dict[str, str] | None = None) -> Any:  # fmt: skip
    req = parse_responses(json.dumps({"model": "m", **body}).encode())
    return build_responses_call(req, prior, headers or {}, CollectorConfig())


def messages(body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    req = parse_messages(json.dumps({"model": "m", "max_tokens": 8, **body}).encode())
    return build_messages_call(req, headers or {}, CollectorConfig())


def refused(fn: Any, body: dict[str, Any], match: str) -> ApiError:
    with pytest.raises(ApiError, match=match) as info:
        fn(body)
    assert info.value.status == 400
    return info.value


def same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Equal as pairing sees conversations."""
    return [canonical(m) for m in a] == [canonical(m) for m in b]


def answer(message: dict[str, Any], finish: str = "stop", matched: int | str | None = None) -> Answer:
    call = make_call([{"role": "user", "content": "q"}], None, tools_enabled=False, headers={},
                     cfg=CollectorConfig())  # fmt: skip
    prep = Prepared(call, [1, 2, 3], PromptCache(text="", ids=[], cuts=[]), call.sampling, None,
                    None, None, Lookup(), 0.0, "s")  # fmt: skip
    result = GenerateResult(text="", output_ids=[7, 8], output_logprobs=[-0.1, -0.2],
                            finish_reason="length" if finish == "length" else "stop",
                            prompt_tokens=3, completion_tokens=2, weight_version="3",
                            matched_stop=matched)  # fmt: skip
    return Answer(prep, result, message, finish, "3", "id-1")


# -- Responses: input -> the internal conversation ---------------------------------------------


def test_a_string_input_and_instructions() -> None:
    rc = responses({"input": "hi", "instructions": "be brief", "temperature": 0.5,
                    "max_output_tokens": 9})  # fmt: skip
    assert rc.call.raw_messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert rc.history == [{"role": "user", "content": "hi"}]  # what `store` keeps
    assert (rc.call.sampling.temperature, rc.call.sampling.max_tokens) == (0.5, 9)


def test_items_become_the_chat_conversation() -> None:
    rc = responses({"tools": [{"type": "function", **FN}], "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": ARGS},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "developer", "content": "go on"},
    ]})  # fmt: skip
    assert rc.call.raw_messages == [
        {"role": "user", "content": "a\nb"}, ANSWER,
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "developer", "content": "go on"},
    ]  # fmt: skip
    assert rc.call.tools == CHAT_TOOLS and rc.call.tools_enabled


def test_output_items_sent_back_pair_with_the_captured_message() -> None:
    for message in (ANSWER, {"role": "assistant", "content": "plain"},
                    {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2"}]}):  # fmt: skip
        items = output_items(message, "stop")
        outputs = [{"type": "function_call_output", "call_id": c["id"], "output": "x"}
                   for c in message.get("tool_calls", [])]  # fmt: skip
        rc = responses({"input": [{"role": "user", "content": "q"}, *items, *outputs]})
        assert same(rc.call.raw_messages[:2], [{"role": "user", "content": "q"}, message])
    # A streamed answer whose text came after its call: the items' order differs, not the message.
    text_after = [output_items(ANSWER, "stop")[i] for i in (2, 1)]
    rc = responses({"input": [{"role": "user", "content": "q"}, *text_after,
                              {"type": "function_call_output", "call_id": "call_1", "output": "x"}]})  # fmt: skip
    assert same(rc.call.raw_messages[1:2], [ANSWER])


def test_previous_response_continues_the_stored_conversation() -> None:
    prior = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [CALL]}]
    rc = responses({"previous_response_id": "resp_1", "instructions": "new",
                    "input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]},
                   prior)  # fmt: skip
    assert rc.call.raw_messages == [{"role": "system", "content": "new"}, *prior,
                                    {"role": "tool", "tool_call_id": "call_1", "content": "x"}]  # fmt: skip
    with pytest.raises(ApiError, match="No tool output found for function call call_1"):
        responses({"previous_response_id": "resp_1", "input": "thanks"}, prior)


@pytest.mark.parametrize(("body", "match", "param"), [
    ({"input": [{"role": "user", "content": "q"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
     "No tool output found for function call c", "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "no function_call", "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"role": "user", "content": "q"}]}, "No tool output found for function call c .before 'input.1.'", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "text only", "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item references", "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "not supported", "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "role", "input"),
    ({"input": []}, "empty", "input"),
    ({"input": "q", "tools": [{"type": "function", **FN}], "tool_choice": {"type": "function", "name": "g"}},
     "no function named 'g'", "tool_choice"),
    ({"input": "q", "tools": [{"type": "web_search_preview"}], "tool_choice": {"type": "web_search_preview"}},
     "forces the built-in tool 'web_search_preview'", "tool_choice"),
    ({"input": "q", "tools": [{"type": {"web_search": 1}}]}, "'tools.0..type': expected a string", "tools"),
    ({"input": "q", "tools": [{"name": "f"}]}, "Missing required parameter: 'tools.0..type'", "tools"),
    ({"input": "q", "tools": [{"type": "fuction", "name": "f"}]}, "'tools.0..type': 'fuction'", "tools"),
    ({"input": "q", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]},
     "a namespace holds 'function' and 'custom' tools", "tools"),
    ({"input": "q", "background": True}, "background", "background"),
    ({"input": "q", "conversation": "conv_1"}, "conversations", "conversation"),
    ({"input": "q", "top_logprobs": 3}, "top_logprobs", "top_logprobs"),
    ({"input": "q", "text": {"format": {"type": "grammar"}}}, "text.format.type", "text"),
    ({"input": "q", "temperature": "0"}, "temperature", "temperature"),
])  # fmt: skip
def test_responses_refusals(body: dict[str, Any], match: str, param: str) -> None:
    assert refused(responses, body, match).param == param


def test_function_tools_take_chat_key_order_and_text_format_constrains() -> None:
    tool = {"strict": False, "parameters": FN["parameters"], "type": "function", "name": FN["name"],
            "description": FN["description"]}  # the Agents SDK's order  # fmt: skip
    rc = responses({"input": "q", "tools": [tool], "tool_choice": "none",
                    "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}})  # fmt: skip
    assert json.dumps(rc.call.raw_messages) and rc.call.tools is None and not rc.call.tools_enabled
    assert rc.call.sampling.json_schema == '{"type":"object"}'
    rc = responses({"input": "q", "tools": [tool]})
    assert json.dumps(rc.call.tools) == json.dumps([{"type": "function", "function": {**FN, "strict": False}}])


def test_session_headers_apply() -> None:
    rc = responses({"input": "q", "user": "u1"}, headers={"x-session-id": "s1", "x-turn-type": "side",
                                                          "x-session-done": "1"})  # fmt: skip
    c = rc.call
    assert (c.session_hint, c.user, c.turn_type, c.session_done) == ("s1", "u1", "side", True)


# -- Responses: the answer ---------------------------------------------------------------------


def test_response_object() -> None:
    req = parse_responses(b'{"model": "m", "input": "q", "store": false}')
    shape = ResponseShape(req, "served", make_call([{"role": "user", "content": "q"}], None,
                          tools_enabled=False, headers={}, cfg=CollectorConfig()).sampling)  # fmt: skip
    body = shape.final(answer(ANSWER, "tool_calls"), output_items(ANSWER, "tool_calls"))
    assert [i["type"] for i in body["output"]] == ["reasoning", "message", "function_call"]
    assert body["output"][2]["call_id"] == "call_1" and body["status"] == "completed"
    assert body["usage"]["input_tokens"] == 3 and body["usage"]["output_tokens"] == 2
    assert body["store"] is False and body["model"] == "served"
    Response.model_validate(body)  # every field the SDK's type requires, strictly
    cut = shape.final(answer({"role": "assistant", "content": "x"}, "length"), [])
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def sse(events: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for e in events:
        head, data = e.decode().split("\n", 1)
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        out.append(payload)
    return out


def test_responses_events_accumulate_in_the_openai_sdk() -> None:
    req = parse_responses(b'{"model": "m", "input": "q"}')
    shape = ResponseShape(req, "m", make_call([{"role": "user", "content": "q"}], None,
                          tools_enabled=False, headers={}, cfg=CollectorConfig()).sampling)  # fmt: skip
    w = ResponsesEvents(shape, None, [])
    raw = w.start() + w.feed([ReasoningDelta("h"), ReasoningDelta("m")], [])
    raw += w.feed([ContentDelta("Let me "), ToolCallDelta(0, "call_1", "get_weather", ARGS)], [])
    raw += w.feed([ContentDelta("look.")], [])
    ans = answer(ANSWER, "tool_calls")
    assert w.persist(ans) is None  # store false
    raw += w.end(ans)
    events = sse(raw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=[], text_format=omit)
    for e in events:
        state.handle_event(EVENTS.validate_python(e))
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "hm"
    assert final["output"][1]["content"][0]["text"] == "Let me look."
    assert final["output"][2]["arguments"] == ARGS and final["output"][2]["call_id"] == "call_1"
    err = sse([w.error(ApiError(504, "late", code="engine_timeout"))])[0]
    assert err["type"] == "error" and err["code"] == "engine_timeout"


# -- Anthropic Messages: request -> the internal conversation --------------------------------------


def test_messages_become_the_chat_conversation() -> None:
    mc = messages({
        "system": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}],
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"}, "stop_sequences": ["END"], "metadata": {"user_id": "u1"},
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "sig"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": [{"type": "text", "text": "sunny"}],
                 "is_error": True},
                {"type": "text", "text": "and?"}]},
        ]})  # fmt: skip
    assert mc.call.raw_messages == [
        {"role": "system", "content": "be\nbrief"}, {"role": "user", "content": "q"}, ANSWER,
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "is_error": True},
        {"role": "user", "content": "and?"},
    ]  # fmt: skip
    assert mc.call.tools == CHAT_TOOLS and mc.call.tools_enabled
    assert (mc.call.sampling.stop, mc.call.user, mc.call.sampling.max_tokens) == (["END"], "u1", 8)


def test_content_blocks_sent_back_pair_with_the_captured_message() -> None:
    for message in (ANSWER, {"role": "assistant", "content": "plain"}):
        blocks = content_blocks(message)
        results = [{"type": "tool_result", "tool_use_id": c["id"], "content": "x"}
                   for c in message.get("tool_calls", [])]  # fmt: skip
        mc = messages({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": blocks},
                                    {"role": "user", "content": [*results, {"type": "text", "text": "ok"}]}]})  # fmt: skip
        assert same(mc.call.raw_messages[:2], [{"role": "user", "content": "q"}, message])


@pytest.mark.parametrize(("body", "match"), [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "text only"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "text only"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The"}]}, "prefill"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]},
     "unexpected tool_use_id"),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                   {"role": "user", "content": "no result"}]}, "without tool_result"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "expected 'user', 'assistant' or 'system'"),
    ({"messages": [{"role": "system", "content": [{"type": "image", "source": {}}]}]}, "text only"),
    ({"messages": [{"role": "user", "content": "q"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "tool_choice": {"type": "tool", "name": "web_search"}}, "forces the server tool 'web_search'"),
    ({"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "bash_2025", "name": "bash"}]},
     "'bash_2025' is not a tool type this server knows"),
    ({"messages": [{"role": "user", "content": "q"}], "tools": [{"name": "f", "input_schema": {}}],
      "tool_choice": {"type": "tool", "name": "g"}}, "no tool named 'g'"),
    ({"messages": [{"role": "user", "content": "q"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "q"}], "temperature": 1.5}, "temperature"),
    ({"messages": [{"role": "user", "content": "q"}], "mcp_servers": []}, "mcp_servers"),
])  # fmt: skip
def test_messages_refusals(body: dict[str, Any], match: str) -> None:
    refused(messages, body, match)


def test_max_tokens_is_required() -> None:
    with pytest.raises(ApiError, match="max_tokens"):
        parse_messages(b'{"model": "m", "messages": [{"role": "user", "content": "q"}]}')


# -- Anthropic Messages: the answer --------------------------------------------------------------


def test_stop_reasons_and_the_message() -> None:
    assert stop_reason(answer(ANSWER, "tool_calls")) == "tool_use"
    assert stop_reason(answer({"role": "assistant", "content": "x"}, "length")) == "max_tokens"
    assert stop_reason(answer({"role": "assistant", "content": "x"}, "stop", matched=2)) == "end_turn"
    ended = answer({"role": "assistant", "content": "x"}, "stop", matched="END")
    body = message_body("msg_1", "m", ended)
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")
    assert body["usage"]["input_tokens"] == 3 and body["content"] == [{"type": "text", "text": "x"}]
    Message.model_validate(message_body("msg_2", "m", answer(ANSWER, "tool_calls")))
    blocks = content_blocks(ANSWER)
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[2] == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}


STREAM: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)


def test_message_events_accumulate_in_the_anthropic_sdk() -> None:
    w = MessageEvents("msg_1", "m", 3)
    raw = w.start() + w.feed([ReasoningDelta("hm"), ContentDelta("Let me ")], [])
    raw += w.feed([ContentDelta("look."), ToolCallDelta(0, "call_1", "get_weather", ARGS)], [])
    raw += w.end(answer(ANSWER, "tool_calls"))
    snapshot = None
    bufs: dict[int, bytes] = {}
    kinds = []
    for event in raw:
        head, data = event.decode().split("\n", 1)
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        kinds.append(payload["type"])
        if payload["type"] != "ping":
            STREAM.validate_python(payload)
            snapshot = accumulate_event(event=payload, current_snapshot=snapshot, json_bufs=bufs)  # type: ignore[arg-type]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert snapshot is not None and snapshot.stop_reason == "tool_use"
    assert [b.model_dump(exclude_none=True) for b in snapshot.content] == content_blocks(ANSWER)
    assert snapshot.usage.output_tokens == 2


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (413, "request_too_large"), (502, "api_error"), (504, "api_error"),
])  # fmt: skip
def test_anthropic_error_shape(status: int, kind: str) -> None:
    body = error_body(ApiError(status, "what happened"))
    assert body["type"] == "error" and body["error"] == {"type": kind, "message": "what happened"}
