"""The collector's strict OpenAI edges, against the real collector and CPU engine processes:
a battery of requests OpenAI rejects (each a 400 in OpenAI's error shape naming its
`param`), mutations of a good request that must never give a 5xx, wrong methods (405)
and unknown paths (404) in the same shape, and `logprobs` / `top_logprobs` as OpenAI
returns them, plain and streamed (parsed by the official SDK's types).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionTokenLogprob

from tests.support.collector_harness import Turns, collector_process, engine_process, wait_ready

pytestmark = pytest.mark.integration

KEY = "strict-key"
USER = [{"role": "user", "content": "hello there"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}  # fmt: skip


@pytest.fixture(scope="module")
def stack(tiny_model: Path, redis_url: str) -> Iterator[dict[str, str]]:
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    env = {"NEXTSTATE_ENV": "test", "NEXTSTATE_REDIS__URL": redis_url,
           "NEXTSTATE_REDIS__PREFIX": prefix}  # fmt: skip
    engine, engine_url = engine_process(tiny_model)
    collector, url = collector_process(env, engine_url, api_keys=KEY)
    try:
        wait_ready((engine, engine_url), (collector, url))
        yield {"url": url, "prefix": prefix, "redis": redis_url}
    finally:
        rc = collector.stop()
        engine.stop()
    assert rc == 0, collector.logs()


@pytest.fixture
def client(stack: dict[str, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack["url"] + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


def send(stack: dict[str, str], body: Any, method: str = "POST",
         path: str = "/v1/chat/completions") -> httpx.Response:  # fmt: skip
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.request(method, stack["url"] + path, content=content, timeout=30,
                         headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})  # fmt: skip


def openai_error(r: httpx.Response) -> dict[str, Any]:
    """The response's error, checked to be exactly OpenAI's shape."""
    assert r.headers["content-type"].startswith("application/json"), r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and isinstance(err["message"], str) and err["message"]
    return dict(err)


# -- the battery ------------------------------------------------------------------------------------

BATTERY: list[tuple[str, dict[str, Any], str]] = [
    # lax validation used to coerce these
    ("temperature as a string", {"messages": USER, "temperature": "0.5"}, "temperature"),
    ("max_tokens as a string", {"messages": USER, "max_tokens": "10"}, "max_tokens"),
    ("stream as a string", {"messages": USER, "stream": "yes"}, "stream"),
    ("n as a boolean", {"messages": USER, "n": True}, "n"),
    ("top_p as a string", {"messages": USER, "top_p": "1"}, "top_p"),
    ("seed as a float", {"messages": USER, "seed": 3.5}, "seed"),
    ("stop as a number", {"messages": USER, "stop": 7}, "stop"),
    ("logprobs as a string", {"messages": USER, "logprobs": "true"}, "logprobs"),
    ("user as a number", {"messages": USER, "user": 42}, "user"),
    ("model as a number", {"messages": USER, "model": 3}, "model"),
    # ranges and values
    ("temperature above 2", {"messages": USER, "temperature": 2.5}, "temperature"),
    ("max_tokens zero", {"messages": USER, "max_tokens": 0}, "max_tokens"),
    ("n above max_n", {"messages": USER, "n": 17}, "n"),
    ("n zero", {"messages": USER, "n": 0}, "n"),
    ("n > 1 streamed", {"messages": USER, "n": 2, "stream": True}, "n"),
    ("top_logprobs above 20", {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("top_logprobs without logprobs", {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ("stream_options without stream", {"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
    # messages
    ("no messages", {"model": "m"}, "messages"),
    ("empty messages", {"messages": []}, "messages"),
    ("messages not a list", {"messages": "hi"}, "messages"),
    ("a message that is a string", {"messages": ["hi"]}, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("no role", {"messages": [{"content": "x"}]}, "messages"),
    ("no content", {"messages": [{"role": "user"}]}, "messages"),
    ("content a number", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("image content", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ("tool message without a call", {"messages": [*USER, {"role": "tool", "tool_call_id": "call_1", "content": "r"}]}, "messages"),
    ("tool_call_id matching no call", {"messages": [*USER, CALL, {"role": "tool", "tool_call_id": "call_9", "content": "r"}]}, "messages"),
    ("tool message without tool_call_id", {"messages": [*USER, CALL, {"role": "tool", "content": "r"}]}, "messages"),
    ("unanswered tool call", {"messages": [*USER, CALL, {"role": "user", "content": "and?"}]}, "messages"),
    ("tool call without id", {"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages"),
    ("tool call arguments as an object", {"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}]}, "messages"),
    # tools
    ("tool without a function name", {"messages": USER, "tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ("tool with a bad function name", {"messages": USER, "tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools"),
    ("tool of another type", {"messages": USER, "tools": [{"type": "browser"}]}, "tools"),
    ("empty tools", {"messages": USER, "tools": []}, "tools"),
    ("tool_choice naming an unknown function", {"messages": USER, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
    ("tool_choice without tools", {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ("tool_choice unknown string", {"messages": USER, "tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    # response_format
    ("unsupported response_format type", {"messages": USER, "response_format": {"type": "regex"}}, "response_format"),
    ("json_schema without json_schema", {"messages": USER, "response_format": {"type": "json_schema"}}, "response_format"),
    ("json_schema without a name", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
    # features that would be silently ignored
    ("logit_bias", {"messages": USER, "logit_bias": {"50": 10}}, "logit_bias"),
    ("functions", {"messages": USER, "functions": [{"name": "f"}]}, "functions"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "body", "param"), BATTERY, ids=[b[0] for b in BATTERY])
def test_bad_request_battery(stack: dict[str, str], what: str, body: dict[str, Any], param: str) -> None:
    r = send(stack, body)
    assert r.status_code == 400, (what, r.status_code, r.text)
    err = openai_error(r)
    assert err["param"] == param, (what, err)
    assert len(err["message"]) > 15, err


def test_the_sdk_raises_bad_request_with_the_param(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=USER, extra_body={"temperature": "0.5"})  # type: ignore[arg-type]
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "temperature" and body["code"] == "invalid_type"
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(
            model="m", messages=[*USER, CALL, {"role": "tool", "tool_call_id": "nope", "content": "x"}],  # type: ignore[list-item]
            tools=TOOLS,  # type: ignore[list-item]
        )


BAD_VALUES: list[Any] = ["x", "", 1, -1, 0, 1.5, 1e308, True, False, [], [1], ["x"], {}, {"a": 1}, None]
FIELDS = ["model", "messages", "temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens",
          "stop", "seed", "n", "stream", "stream_options", "tools", "tool_choice", "parallel_tool_calls",
          "logprobs", "top_logprobs", "response_format", "frequency_penalty", "presence_penalty",
          "logit_bias", "user", "session_id", "metadata", "modalities"]  # fmt: skip


def test_no_mutation_of_a_good_request_is_a_5xx(stack: dict[str, str]) -> None:
    """Every field of a valid request set to every kind of JSON value: 200 or an OpenAI-shaped
    4xx, never a 5xx (and never a hang)."""
    seen: dict[int, int] = {}
    with httpx.Client(base_url=stack["url"], timeout=30,
                      headers={"authorization": f"Bearer {KEY}"}) as http:  # fmt: skip
        for field in FIELDS:
            for value in BAD_VALUES:
                body = {"model": "m", "messages": USER, "max_tokens": 2, field: value}
                r = http.post("/v1/chat/completions", json=body)
                seen[r.status_code] = seen.get(r.status_code, 0) + 1
                assert r.status_code < 500, (field, value, r.status_code, r.text)
                if r.status_code != 200:
                    assert r.status_code == 400, (field, value, r.text)
                    assert openai_error(r)["param"] is not None, (field, value)
        for raw in (b"[]", b"null", b"1", b'"text"', b'{"messages": [{"role": "user", "content": "x"}]]'):
            r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (raw, r.text)
            openai_error(r)
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0


# -- routing ----------------------------------------------------------------------------------------


def test_wrong_method_is_405_and_unknown_path_404_in_openai_shape(stack: dict[str, str], client: openai.OpenAI) -> None:
    for method in ("GET", "PUT", "DELETE"):
        r = send(stack, b"", method=method)
        assert r.status_code == 405, (method, r.text)
        assert r.headers["allow"] == "POST"
        assert openai_error(r)["code"] == "method_not_allowed"
    r = send(stack, {"x": 1}, method="POST", path="/v1/models")
    assert r.status_code == 405 and "GET" in r.headers["allow"]
    openai_error(r)
    for method, path in (("GET", "/v1/nope"), ("POST", "/v1/completions"), ("POST", "/v1/embeddings"),
                         ("GET", "/")):  # fmt: skip
        r = send(stack, b"{}", method=method, path=path)
        assert r.status_code == 404, (path, r.text)
        err = openai_error(r)
        assert err["code"] == "unknown_url" and path in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="m", prompt="hi")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="m", input="hi")


# -- logprobs -----------------------------------------------------------------------------------------


def check_entries(entries: list[ChatCompletionTokenLogprob], top: int) -> None:
    for e in entries:
        assert e.logprob <= 0 and e.bytes is not None
        assert len(e.top_logprobs) == top
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        if top:
            assert e.logprob <= values[0] + 1e-6
            if e.token in [t.token for t in e.top_logprobs]:
                assert e.logprob == pytest.approx(
                    next(t.logprob for t in e.top_logprobs if t.token == e.token), abs=1e-6
                )


def test_logprobs_plain_match_openai_types_and_the_captured_turn(
    client: openai.OpenAI, stack: dict[str, str]
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=USER, max_tokens=16, seed=5, temperature=0.8, logprobs=True,  # type: ignore[arg-type]
        top_logprobs=3, extra_headers={"X-Session-Done": "1"},
    )
    resp: ChatCompletion = raw.parse()
    choice = resp.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    check_entries(entries, 3)
    # every sampled token but a matched stop token, whose bytes spell the answer
    assert resp.usage is not None
    stopped = choice.finish_reason == "stop"
    assert len(entries) == resp.usage.completion_tokens - (1 if stopped else 0)
    assert bytes(b for e in entries for b in e.bytes or []).decode(errors="replace") == choice.message.content
    # the same values the collector captured for training
    turns = Turns(stack["redis"], stack["prefix"])
    try:
        (turn,) = turns.wait(lambda ts: len(ts) == 1, sessions=[raw.headers["x-session-id"]])
    finally:
        turns.close()
    assert turn.response_logprobs is not None
    assert [e.logprob for e in entries] == pytest.approx(turn.response_logprobs[: len(entries)], abs=1e-6)
    # no logprobs unless asked
    plain = client.chat.completions.create(model="m", messages=USER, max_tokens=4, seed=5)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None


def test_logprobs_streamed_equal_the_plain_ones(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "m", "messages": USER, "max_tokens": 16, "seed": 9, "temperature": 0.9,
                          "logprobs": True, "top_logprobs": 2}  # fmt: skip
    plain = client.chat.completions.create(**kw).choices[0]
    assert plain.logprobs is not None and plain.logprobs.content is not None
    chunks: list[ChatCompletionChunk] = list(client.chat.completions.create(stream=True, **kw))
    entries: list[ChatCompletionTokenLogprob] = []
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            entries += c.choices[0].logprobs.content or []
    check_entries(entries, 2)
    assert [(e.token, e.bytes) for e in entries] == [(e.token, e.bytes) for e in plain.logprobs.content]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in plain.logprobs.content], abs=1e-5)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.message.content
    unasked = list(client.chat.completions.create(model="m", messages=USER, max_tokens=4, stream=True))  # type: ignore[arg-type]
    assert all(c.choices[0].logprobs is None for c in unasked if c.choices)
