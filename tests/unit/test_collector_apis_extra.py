"""The Responses API's input items and output_text log-probs, the stored record, and
Anthropic's count_tokens call: each checked against the official SDKs' types."""

from __future__ import annotations

import json
import random
from typing import Any, cast

import pytest
from openai.types.responses import Response, ResponseItem
from pydantic import TypeAdapter

from services.collector.anthropic_request import (
    build_count_call,
    build_messages_call,
    parse_count_tokens,
    parse_messages,
)
from services.collector.input_items import conversation_items, page, page_params
from services.collector.openai_shapes import ApiError
from services.collector.response_store import ResponseStore
from services.collector.responses_api import ResponsesApi, ResponsesEvents, ResponseShape
from services.collector.responses_request import build_responses_call, parse_responses
from services.collector.settings import CollectorConfig
from services.collector.text_logprobs import TextLogprobs, text_logprobs
from shared.keys import Keys
from shared.toolcalls import ContentDelta, StreamParser, ToolCallDelta
from tests.unit.test_collector_apis import ANSWER, CALL, FN, answer, sse

ITEMS: TypeAdapter[Any] = TypeAdapter(ResponseItem)
CONVERSATION: list[dict[str, Any]] = [
    {"role": "developer", "content": "be brief"},
    {"role": "user", "content": "weather?"},
    ANSWER,  # reasoning, text and a tool call
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "thanks"},
]


# -- input items -----------------------------------------------------------------------------


def test_the_conversation_as_input_items() -> None:
    items = conversation_items(CONVERSATION)
    assert [(i["type"], i.get("role")) for i in items] == [
        ("message", "developer"), ("message", "user"), ("reasoning", None),
        ("message", "assistant"), ("function_call", None), ("function_call_output", None),
        ("message", "assistant"), ("message", "user"),
    ]  # fmt: skip
    for item in items:
        ITEMS.validate_python(item)  # each one the SDK's type, strictly
    assert items[1]["content"] == [{"type": "input_text", "text": "weather?"}]
    assert items[3]["content"][0]["text"] == "Let me look." and items[2]["content"][0]["text"] == "hm"
    assert (items[4]["call_id"], items[4]["name"], items[4]["arguments"]) == ("call_1", "get_weather",
                                                                               CALL["function"]["arguments"])  # fmt: skip
    assert (items[5]["call_id"], items[5]["output"]) == ("call_1", "sunny")
    ids = [i["id"] for i in items]
    assert len(set(ids)) == len(ids)
    # The same item has the same id in every response of a chain (the prefix is the same).
    assert [i["id"] for i in conversation_items(CONVERSATION[:4])] == ids[:6]
    assert conversation_items([{"role": "user", "content": "other"}])[0]["id"] != ids[1]


def test_input_items_pages() -> None:
    items = conversation_items(CONVERSATION)
    ids = [i["id"] for i in items]
    first = page(items, 3, "desc", None)
    assert [i["id"] for i in first["data"]] == ids[::-1][:3]
    assert (first["object"], first["first_id"], first["last_id"], first["has_more"]) == (
        "list", ids[-1], ids[-3], True)  # fmt: skip
    seen = []
    after = None
    while True:  # as the SDK pages: `after` the last id until has_more is false
        p = page(items, 3, "asc", after)
        seen += [i["id"] for i in p["data"]]
        if not p["has_more"]:
            break
        after = p["last_id"]
    assert seen == ids
    assert page(items, 100, "asc", ids[-1]) == {"object": "list", "data": [], "first_id": None,
                                                "last_id": None, "has_more": False}  # fmt: skip
    with pytest.raises(ApiError, match="no input item with id 'msg_nope'") as bad:
        page(items, 3, "asc", "msg_nope")
    assert bad.value.param == "after"


@pytest.mark.parametrize(("query", "includes", "param"), [
    ({"limit": "0"}, [], "limit"), ({"limit": "101"}, [], "limit"), ({"limit": "x"}, [], "limit"),
    ({"order": "up"}, [], "order"), ({}, ["message.output_text.logprob"], "include"),
])  # fmt: skip
def test_input_items_parameters_are_checked(query: dict[str, str], includes: list[str], param: str) -> None:
    with pytest.raises(ApiError) as bad:
        page_params(query, includes)
    assert bad.value.status == 400 and bad.value.param == param


def test_input_items_defaults() -> None:
    assert page_params({}, []) == (20, "desc", None)
    assert page_params({"limit": "100", "order": "asc", "after": "msg_1"},
                       ["message.output_text.logprobs"]) == (100, "asc", "msg_1")  # fmt: skip


# -- the stored record ----------------------------------------------------------------------------


def test_the_stored_record_reuses_the_serialized_response() -> None:
    store = ResponseStore(None, Keys("p"), ttl_s=60, timeout_s=1)
    response = {"id": "resp_1", "output": [{"text": "é \u2028"}]}
    body = json.dumps(response, ensure_ascii=False, separators=(",", ":")).encode()
    a, b = store.prepare(response, CONVERSATION, body), store.prepare(response, CONVERSATION)
    assert a.item == b.item and a.item[0] == "p:response:resp_1" and a.item[2] == 60_000
    assert json.loads(a.item[1]) == {"response": response, "messages": CONVERSATION}


# -- output_text log-probs --------------------------------------------------------------------------

# A hermes answer that thinks, says something and calls a tool, token by token.
TOKENS = ["<think>", "h", "m", "</think>", "\n\n", "Let", " me", " lo", "ok", ".\n", "<tool_call>",
          '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "</tool_call>"]  # fmt: skip


def entries(tokens: list[str]) -> list[dict[str, Any]]:
    return [{"token": t, "logprob": -i / 10, "bytes": list(t.encode()), "top_logprobs": []}
            for i, t in enumerate(tokens)]  # fmt: skip


def streamed(chunks: list[list[int]]) -> tuple[list[Any], list[dict[str, Any]]]:
    """Deltas and routed entries when the engine's chunks hold these token indices."""
    parser = StreamParser(True, "hermes", reasoning=True)
    lp = TextLogprobs()
    deltas: list[Any] = []
    routed: list[dict[str, Any]] = []
    all_entries = entries(TOKENS)
    for k, chunk in enumerate(chunks):
        lp.add([all_entries[i] for i in chunk])
        got = parser.feed("".join(TOKENS[i] for i in chunk))
        if k == len(chunks) - 1:
            got += parser.finish()
        deltas += got
        routed += [e for d in got for e in lp.route(d)]
    return deltas, routed


def test_text_logprobs_are_those_of_the_texts_tokens_however_it_streams() -> None:
    whole = list(range(len(TOKENS)))
    deltas, once = streamed([whole])
    assert "".join(d.text for d in deltas if isinstance(d, ContentDelta)) == "Let me look."
    assert any(isinstance(d, ToolCallDelta) for d in deltas)
    assert [e["token"] for e in once] == ["Let", " me", " lo", "ok", ".\n"]
    assert once == text_logprobs(deltas, entries(TOKENS))
    rng = random.Random(7)
    for _ in range(50):  # every way of cutting the stream into chunks ties the same tokens
        cuts = sorted(rng.sample(range(1, len(TOKENS)), rng.randint(1, len(TOKENS) - 1)))
        chunks = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(TOKENS)], strict=True)]
        assert streamed(chunks)[1] == once, chunks


def test_text_the_parser_rewrote_gets_no_logprobs_rather_than_wrong_ones() -> None:
    lp = TextLogprobs()
    lp.add(entries(["ab", "c"]))
    assert lp.route(ContentDelta("xyz")) == [] and lp.route(ContentDelta("")) == []
    assert [e["token"] for e in lp.route(ContentDelta("bc"))] == ["ab", "c"]
    assert lp.route(ContentDelta("c")) == []  # each token goes to one text only


def responses(body: dict[str, Any]) -> Any:
    req = parse_responses(json.dumps({"model": "m", **body}).encode())
    return build_responses_call(req, None, {}, CollectorConfig())


def test_include_logprobs_asks_the_engine() -> None:
    rc = responses({"input": "q", "include": ["message.output_text.logprobs"], "top_logprobs": 3})
    assert rc.call.logprobs and rc.call.top_logprobs == 3
    rc = responses({"input": "q", "include": ["reasoning.encrypted_content"], "top_logprobs": 0})
    assert not rc.call.logprobs and rc.call.top_logprobs == 0
    with pytest.raises(ApiError, match="needs 'include'") as bad:
        responses({"input": "q", "top_logprobs": 2})
    assert bad.value.param == "top_logprobs"


def test_streamed_logprobs_and_the_stored_final_response() -> None:
    rc = responses({"input": "q", "include": ["message.output_text.logprobs"]})
    shape = ResponseShape(rc.req, "m", rc.call.sampling)
    store = ResponseStore(None, Keys("p"), ttl_s=60, timeout_s=1)
    w = ResponsesEvents(shape, ResponsesApi(cast(Any, None), store), rc.history, logprobs=True)
    raw = w.start()
    all_entries = entries(["Let", " me", " look."])
    raw += w.feed([ContentDelta("Let me")], all_entries[:2])
    raw += w.feed([ContentDelta(" look.")], all_entries[2:])
    ans = answer({"role": "assistant", "content": "Let me look."})
    kept = w.persist(ans)
    assert kept is not None
    raw += w.end(ans)
    events = sse(raw)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [[x["token"] for x in d["logprobs"]] for d in deltas] == [["Let", " me"], [" look."]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == all_entries
    final = events[-1]
    assert final["type"] == "response.completed" and final["sequence_number"] == len(events) - 1
    Response.model_validate(final["response"])
    assert final["response"]["output"][0]["content"][0]["logprobs"] == all_entries
    # What is stored is what the client received, serialized once.
    assert json.loads(kept.item[1])["response"] == final["response"]


# -- Anthropic count_tokens ------------------------------------------------------------------------


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": FN["description"], "input_schema": FN["parameters"]}]


def test_count_tokens_renders_what_a_message_request_would() -> None:
    body = {"model": "m", "system": "be brief", "tools": ANTHROPIC_TOOLS,
            "messages": [{"role": "user", "content": "weather?"}]}  # fmt: skip
    count = build_count_call(parse_count_tokens(json.dumps(body).encode()), CollectorConfig())
    message = build_messages_call(parse_messages(json.dumps({**body, "max_tokens": 5}).encode()), {},
                                  CollectorConfig()).call  # fmt: skip
    assert (count.messages, count.tools) == (message.messages, message.tools) and count.tools
    none = {**body, "tool_choice": {"type": "none"}}
    assert build_count_call(parse_count_tokens(json.dumps(none).encode()), CollectorConfig()).tools is None


@pytest.mark.parametrize(("body", "match"), [
    ({"messages": [{"role": "user", "content": "q"}]}, "model"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "text only"),
    ({"model": "m", "messages": [{"role": "user", "content": "q"}], "tools": [{"type": "web_search_20250305",
                                                                              "name": "web_search"}],
      "tool_choice": {"type": "tool", "name": "web_search"}}, "server tool"),
])  # fmt: skip
def test_count_tokens_refuses_what_messages_refuses(body: dict[str, Any], match: str) -> None:
    with pytest.raises(ApiError, match=match) as bad:
        build_count_call(parse_count_tokens(json.dumps(body).encode()), CollectorConfig())
    assert bad.value.status == 400
