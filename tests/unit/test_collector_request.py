"""Request validation and settings: every bad input is a 400 naming its param; defaults apply."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.collector.openai_shapes import ApiError, ChunkWriter
from services.collector.request import ChatCall, build_call, parse_body
from services.collector.settings import CollectorConfig, CollectorSettings
from shared.errors import SettingsError
from shared.settings import load_settings

USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def call(body: dict[str, Any], headers: dict[str, str] | None = None,
         cfg: CollectorConfig | None = None) -> ChatCall:  # fmt: skip
    return build_call(parse_body(json.dumps(body).encode()), headers or {}, cfg or CollectorConfig())


def error(body: bytes | dict[str, Any], headers: dict[str, str] | None = None) -> ApiError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ApiError) as info:
        build_call(parse_body(raw), headers or {}, CollectorConfig())
    return info.value


def test_invalid_json_and_empty_body() -> None:
    err = error(b'{"messages": [')
    assert (err.status, err.code, err.kind) == (400, "invalid_json", "invalid_request_error")
    assert error(b"  ").status == 400


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ({"messages": USER, "temperature": 3}, "temperature"),
        ({"messages": USER, "top_p": 0}, "top_p"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": USER, "n": 17}, "n"),
        ({"messages": USER, "n": 0}, "n"),
        ({"messages": USER, "n": 2, "stream": True}, "n"),
        ({"messages": USER, "stop": [""]}, "stop"),
        ({"messages": USER, "stop": ["x"] * 17}, "stop"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": USER, "tools": ["nope"]}, "tools"),
        ({"messages": USER, "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": USER, "stream": "maybe"}, "stream"),
    ],
)
def test_schema_errors_name_the_param(body: dict[str, Any], param: str) -> None:
    err = error(body)
    assert err.status == 400 and err.param == param, err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_n_choices_up_to_the_limit_and_not_streamed() -> None:
    assert call({"messages": USER}).n == 1 and call({"messages": USER, "n": 1}).n == 1
    c = call({"messages": USER, "n": 3, "seed": 7})
    assert (c.n, c.stream, c.sampling.seed) == (3, False, 7)
    assert call({"messages": USER, "n": 4}, cfg=CollectorConfig(max_n=4)).n == 4
    big = error({"messages": USER, "n": 17})
    assert "at most 16 choices" in big.message and big.code == "invalid_value"
    streamed = error({"messages": USER, "n": 2, "stream": True})
    assert streamed.code == "unsupported_value" and "stream: false" in streamed.message
    # A stream with n = 1 is a stream as ever.
    assert call({"messages": USER, "n": 1, "stream": True}).stream is True


def test_defaults_come_from_the_configuration() -> None:
    cfg = CollectorConfig(default_temperature=0.7, default_top_p=0.9, default_max_tokens=33)
    c = call({"messages": USER}, cfg=cfg)
    assert (c.sampling.temperature, c.sampling.top_p, c.sampling.max_tokens) == (0.7, 0.9, 33)
    c = call({"messages": USER, "temperature": 0, "max_tokens": 5, "max_completion_tokens": 7,
              "stop": "END", "seed": 4, "top_k": 20}, cfg=cfg)  # fmt: skip
    assert c.sampling.temperature == 0 and c.sampling.max_tokens == 7
    assert c.sampling.stop == ["END"] and c.sampling.seed == 4 and c.sampling.top_k == 20


def test_tool_choice_none_renders_without_tools() -> None:
    assert call({"messages": USER, "tools": TOOLS}).tools == TOOLS
    for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        c = call({"messages": USER, "tools": TOOLS, "tool_choice": choice})
        assert c.tools_enabled and c.tools == TOOLS
    c = call({"messages": USER, "tools": TOOLS, "tool_choice": "none"})
    assert c.tools is None and not c.tools_enabled
    assert error({"messages": USER, "tools": []}).param == "tools"  # OpenAI: empty array


def test_headers_session_and_turn_type() -> None:
    c = call({"messages": USER, "session_id": "body", "user": "u"})
    assert (c.session_hint, c.user, c.turn_type, c.session_done) == ("body", "u", "main", False)
    c = call({"messages": USER, "session_id": "body"},
             {"x-session-id": "hdr", "x-turn-type": "Side", "x-session-done": "1"})  # fmt: skip
    assert (c.session_hint, c.turn_type, c.session_done) == ("hdr", "side", True)
    assert call({"messages": USER}, cfg=CollectorConfig(default_turn_type="side")).turn_type == "side"
    assert error({"messages": USER}, {"x-turn-type": "both"}).param == "X-Turn-Type"
    assert error({"messages": USER, "session_id": "s" * 257}).param == "session_id"
    assert error({"messages": USER, "user": "u" * 257}).param == "user"


def test_unknown_and_ignored_fields_are_accepted() -> None:
    c = call({"messages": USER, "logprobs": True, "frequency_penalty": 0.5, "metadata": {"a": "1"},
              "stream": True, "stream_options": {"include_usage": True}, "model": "whatever",
              "chat_template_kwargs": {"x": 1}, "repetition_penalty": 1.1})  # fmt: skip
    assert c.stream and c.include_usage and c.logprobs and c.top_logprobs == 0
    assert c.raw_messages == USER


def test_api_keys_from_env_as_list_or_commas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXTSTATE_COLLECTOR__API_KEYS", "k1, k2")
    assert load_settings(CollectorSettings).collector.key_values() == ["k1", "k2"]
    monkeypatch.setenv("NEXTSTATE_COLLECTOR__API_KEYS", '["a,b", "c"]')
    assert load_settings(CollectorSettings).collector.key_values() == ["a,b", "c"]


def test_prod_without_keys_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"NEXTSTATE_ENV": "prod", "NEXTSTATE_BUCKET__ACCESS_KEY": "a",
                 "NEXTSTATE_BUCKET__SECRET_KEY": "b",
                 "NEXTSTATE_INTERNAL__TOKEN": "internal-token-0123456789"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("NEXTSTATE_COLLECTOR__API_KEYS", raising=False)
    with pytest.raises(SettingsError, match="NEXTSTATE_COLLECTOR__API_KEYS"):
        load_settings(CollectorSettings)
    monkeypatch.setenv("NEXTSTATE_COLLECTOR__API_KEYS", "secret")
    assert load_settings(CollectorSettings).env == "prod"


def test_bad_settings_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXTSTATE_COLLECTOR__TOOL_PARSER", "nope")
    with pytest.raises(SettingsError, match="NEXTSTATE_COLLECTOR__TOOL_PARSER"):
        load_settings(CollectorSettings)


def test_stream_chunks_are_openai_chunks() -> None:
    w = ChunkWriter("chatcmpl-1", 5, "m", "fp")
    ev = w.delta({"content": "hé"}, None)
    assert ev.startswith(b"data: ") and ev.endswith(b"\n\n")
    chunk = json.loads(ev[6:])
    assert chunk == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5,
                     "model": "m", "system_fingerprint": "fp",
                     "choices": [{"index": 0, "delta": {"content": "hé"}, "logprobs": None,
                                  "finish_reason": None}]}  # fmt: skip
    usage = json.loads(w.usage(3, 4)[6:])
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 7
    assert json.loads(w.error(ApiError(502, "down"))[6:])["error"]["type"] == "server_error"
    assert w.done() == b"data: [DONE]\n\n"


# -- strict OpenAI edges ---------------------------------------------------------------------------

CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param", "code", "says"),
    [
        # lax pydantic used to coerce these; OpenAI refuses them
        ({"messages": USER, "temperature": "0.5"}, "temperature", "invalid_type", "expected a number"),
        ({"messages": USER, "max_tokens": "10"}, "max_tokens", "invalid_type", "expected an integer"),
        ({"messages": USER, "stream": "yes"}, "stream", "invalid_type", "expected a boolean"),
        ({"messages": USER, "n": True}, "n", "invalid_type", "got a boolean"),
        ({"messages": USER, "seed": 1.5}, "seed", "invalid_type", "expected an integer"),
        ({"messages": USER, "stop": ["a", 5]}, "stop", "invalid_type", "'stop[1]'"),
        ({"messages": USER, "logprobs": 1}, "logprobs", "invalid_type", "expected a boolean"),
        # messages
        ({"messages": "hi"}, "messages", "invalid_type", "expected an array"),
        ({"messages": ["hi"]}, "messages", "invalid_type", "'messages[0]'"),
        ({"messages": [{"content": "x"}]}, "messages", "missing_required_parameter", "'messages[0].role'"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages", "invalid_value", "'function'"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages", "invalid_type", "'messages[0].content'"),
        ({"messages": [{"role": "user", "content": None}]}, "messages", "invalid_type", "got null"),
        ({"messages": [*USER, {"role": "assistant", "content": None}]}, "messages",
         "missing_required_parameter", "'messages[1].content'"),
        # tool results and the calls they answer
        ({"messages": [*USER, {"role": "tool", "tool_call_id": "c1", "content": "r"}]}, "messages",
         "invalid_value", "must answer a tool call"),
        ({"messages": [*USER, CALL, {"role": "tool", "tool_call_id": "zz", "content": "r"}]}, "messages",
         "invalid_value", "'zz' matches no tool call"),
        ({"messages": [*USER, CALL, {"role": "tool", "content": "r"}]}, "messages",
         "missing_required_parameter", "'messages[2].tool_call_id'"),
        ({"messages": [*USER, CALL, {"role": "user", "content": "r"}]}, "messages", "invalid_value",
         "no answer for 'c1'"),
        ({"messages": [*USER, CALL]}, "messages", "invalid_value", "no tool message answering"),
        ({"messages": [*USER, {"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages", "missing_required_parameter", "'messages[1].tool_calls[0].id'"),
        ({"messages": [*USER, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}]}]},
         "messages", "invalid_type", "arguments': expected a string"),
        # tools and tool_choice
        ({"messages": USER, "tools": [{"type": "function", "function": {"description": "d"}}]},
         "tools", "missing_required_parameter", "'tools[0].function.name'"),
        ({"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools", "invalid_value", "tools[0].function.name"),
        ({"messages": USER, "tools": [{"type": "retrieval"}]}, "tools", "invalid_value", "'function'"),
        ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice", "invalid_value", "no function named 'g'"),
        ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function"}},
         "tool_choice", "missing_required_parameter", "tool_choice.function.name"),
        ({"messages": USER, "tool_choice": "auto"}, "tool_choice", "invalid_value", "only allowed when"),
        ({"messages": USER, "parallel_tool_calls": False}, "parallel_tool_calls", "invalid_value", "tools"),
        # the rest
        ({"messages": USER, "top_logprobs": 2}, "top_logprobs", "invalid_value", "'logprobs': true"),
        ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value", "20"),
        ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options", "invalid_value",
         "'stream' is true"),
        ({"messages": USER, "top_k": 0}, "top_k", "invalid_value", "-1"),
        ({"messages": USER, "logit_bias": {"5": 10}}, "logit_bias", "unsupported_value", "not supported"),
        ({"messages": USER, "functions": [{"name": "f"}]}, "functions", "unsupported_value", "tools"),
        ({"messages": USER, "modalities": ["text", "audio"]}, "modalities", "unsupported_value", "text"),
        ({"messages": USER, "response_format": {"type": "grammar"}}, "response_format",
         "unsupported_value", "'grammar' is not supported"),
        ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format",
         "missing_required_parameter", "response_format.json_schema"),
        ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "response_format", "missing_required_parameter", "response_format.json_schema.name"),
        ({"messages": USER, "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "x", "schema": "{}"}}},
         "response_format", "invalid_type", "expected an object"),
        ({"messages": USER, "response_format": "json_object"}, "response_format", "invalid_type", "object"),
    ],
)  # fmt: skip
def test_strict_openai_edges(body: dict[str, Any], param: str, code: str, says: str) -> None:
    err = error(body)
    assert (err.status, err.param, err.code, err.kind) == (400, param, code, "invalid_request_error"), err.message
    assert says in err.message


def test_well_formed_tool_history_passes() -> None:
    answer = {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    c = call({"messages": [*USER, CALL, answer, {"role": "assistant", "content": "ok"},
                           {"role": "user", "content": "thanks"}], "tools": TOOLS,
              "tool_choice": {"type": "function", "function": {"name": "f"}},
              "parallel_tool_calls": True})  # fmt: skip
    assert c.tools_enabled and c.raw_messages[2] == answer
    assert c.messages[1]["tool_calls"][0]["function"]["arguments"] == {}  # normalized for templates


def test_response_format_becomes_a_json_schema_constraint() -> None:
    assert call({"messages": USER, "response_format": {"type": "text"}}).sampling.json_schema is None
    c = call({"messages": USER, "response_format": {"type": "json_object"}})
    assert c.sampling.json_schema == '{"type":"object"}'
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    c = call({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": schema, "strict": True}}})  # fmt: skip
    assert c.sampling.json_schema is not None and json.loads(c.sampling.json_schema) == schema


def test_logprobs_and_top_logprobs() -> None:
    c = call({"messages": USER, "logprobs": True, "top_logprobs": 3})
    assert (c.logprobs, c.top_logprobs) == (True, 3)
    c = call({"messages": USER, "logprobs": False})
    assert (c.logprobs, c.top_logprobs) == (False, 0)


def test_integers_are_numbers_and_nulls_are_absent() -> None:
    c = call({"messages": USER, "temperature": 1, "top_p": 1, "max_tokens": None, "stop": None,
              "tools": None, "tool_choice": None, "seed": None})  # fmt: skip
    assert c.sampling.temperature == 1.0 and c.sampling.top_p == 1.0
