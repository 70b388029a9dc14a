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
        ({"messages": USER, "n": 2}, "n"),
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


def test_n_greater_than_one_says_what_to_do() -> None:
    assert "send 3 requests" in error({"messages": USER, "n": 3}).message
    assert call({"messages": USER, "n": 1}).stream is False


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
    assert not call({"messages": USER, "tools": []}).tools_enabled


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
    c = call({"messages": USER, "logprobs": True, "frequency_penalty": 0.5, "metadata": {"a": 1},
              "stream": True, "stream_options": {"include_usage": True}, "model": "whatever"})  # fmt: skip
    assert c.stream and c.include_usage
    assert c.raw_messages == USER


def test_api_keys_from_env_as_list_or_commas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXTSTATE_COLLECTOR__API_KEYS", "k1, k2")
    assert load_settings(CollectorSettings).collector.key_values() == ["k1", "k2"]
    monkeypatch.setenv("NEXTSTATE_COLLECTOR__API_KEYS", '["a,b", "c"]')
    assert load_settings(CollectorSettings).collector.key_values() == ["a,b", "c"]


def test_prod_without_keys_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"NEXTSTATE_ENV": "prod", "NEXTSTATE_BUCKET__ACCESS_KEY": "a",
                 "NEXTSTATE_BUCKET__SECRET_KEY": "b"}.items():  # fmt: skip
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
