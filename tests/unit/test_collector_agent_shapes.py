"""What real agents send, taken as they mean it: the requests OpenClaw 2026.9.6 (all three
API kinds), the Codex CLI 0.171.0 and Claude Code 2.1.332 sent, first and follow-up, as
tests/data/agents/record.py recorded them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.responses import ResponseFunctionToolCall

from services.collector.anthropic_request import build_messages_call, parse_messages
from services.collector.builtin_tools import header_value
from services.collector.input_items import conversation_items
from services.collector.openai_shapes import ApiError
from services.collector.pairing import canonical
from services.collector.request import build_call, parse_body
from services.collector.responses_api import call_item, output_items
from services.collector.responses_request import build_responses_call, parse_responses
from services.collector.settings import CollectorConfig
from shared.chat import ChatTemplate
from tests.support.agents import recording


def recorded(name: str, i: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = recording(name)[i]["body"]
    return body


def raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def responses(body: dict[str, Any], cfg: CollectorConfig | None = None) -> Any:
    return build_responses_call(parse_responses(raw(body)), None, {}, cfg or CollectorConfig())


def messages(body: dict[str, Any], cfg: CollectorConfig | None = None) -> Any:
    return build_messages_call(parse_messages(raw(body)), {}, cfg or CollectorConfig())


def same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Equal as pairing sees conversations."""
    return [canonical(m) for m in a] == [canonical(m) for m in b]


@pytest.fixture(scope="module")
def tiny(tiny_tokenizer: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(tiny_tokenizer)


# -- the Codex CLI (Responses API) --------------------------------------------------------------


def test_codex_namespace_tools_are_flattened_and_its_web_search_left_out(tiny: ChatTemplate) -> None:
    body = recorded("codex")
    rc = responses(body)
    namespace = next(t for t in body["tools"] if t["type"] == "namespace")
    assert namespace["name"] == "multi_agent_v1" and len(namespace["tools"]) > 1
    names = [t["function"]["name"] for t in rc.call.tools]
    flat = [f"multi_agent_v1.{t['name']}" for t in namespace["tools"]]
    plain = [t["name"] for t in body["tools"] if t["type"] == "function"]
    assert names == [*plain[:4], *flat, *plain[4:]]  # in the request's order
    spawn = next(t["function"] for t in rc.call.tools if t["function"]["name"] == flat[0])
    member = namespace["tools"][0]
    assert (spawn["description"], spawn["parameters"]) == (member["description"], member["parameters"])
    assert rc.call.dropped_tools == ("web_search",) and header_value(rc.call.dropped_tools) == "web_search"
    assert rc.call.stream and rc.req.store is False and rc.call.tools_enabled
    # The model is shown the flattened tools.
    prompt = tiny.render(rc.call.messages, rc.call.tools)
    assert all(f'"name": "{n}"' in prompt for n in flat)


def test_codex_with_unsupported_tools_refused() -> None:
    with pytest.raises(ApiError, match="built-in tool 'web_search'") as bad:
        responses(recorded("codex"), CollectorConfig(unsupported_tools="refuse"))
    assert (bad.value.status, bad.value.param) == (400, "tools")


def test_codex_follow_up_continues_its_first_request() -> None:
    first, follow = responses(recorded("codex")), responses(recorded("codex", 1))
    n = len(first.call.raw_messages)
    assert same(follow.call.raw_messages[:n], first.call.raw_messages)
    call, output = follow.call.raw_messages[n:]
    assert call["tool_calls"][0]["function"]["name"] == "exec_command" and output["role"] == "tool"
    assert follow.call.dropped_tools == ("web_search",) and follow.call.tools == first.call.tools


def test_codex_namespaced_calls_go_back_namespaced_and_come_back_flat() -> None:
    body = recorded("codex")
    answer = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "multi_agent_v1.spawn_agent", "arguments": '{"message": "look"}'}}]}  # fmt: skip
    [item] = output_items(answer, "tool_calls")
    assert (item["name"], item["namespace"]) == ("spawn_agent", "multi_agent_v1")
    ResponseFunctionToolCall.model_validate(item)  # the SDK's own type
    assert "namespace" not in call_item("call_2", "exec_command", "{}")
    # Codex's follow-up: the call as it received it, then its output.
    follow = {**body, "input": [*body["input"], item,
                                {"type": "function_call_output", "call_id": "call_1", "output": "done"}]}  # fmt: skip
    rc = responses(follow)
    first = responses(body)
    assert same(rc.call.raw_messages[: len(first.call.raw_messages)], first.call.raw_messages)
    assert same([rc.call.raw_messages[-2]], [answer])  # the captured answer, continued
    # The stored conversation lists it as Codex sent it.
    listed = conversation_items([*first.history, answer])
    assert (listed[-1]["name"], listed[-1]["namespace"]) == ("spawn_agent", "multi_agent_v1")


def test_a_namespaced_tool_choice_names_the_flat_function() -> None:
    body = {**recorded("codex"),
            "tool_choice": {"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}}
    assert responses(body).call.tools_enabled
    with pytest.raises(ApiError, match="forces the built-in tool 'web_search'"):
        responses({**body, "tool_choice": {"type": "web_search"}})


# -- Claude Code (Messages API) -------------------------------------------------------------------


def test_claude_code_environment_entry_is_a_system_message_in_place(tiny: ChatTemplate) -> None:
    body = recorded("claude")
    mc = messages(body)
    env = body["messages"][1]["content"][0]
    assert "cache_control" in env and env["text"].startswith("# Environment")
    assert [m["role"] for m in mc.call.raw_messages] == ["system", "user", "system"]
    assert mc.call.raw_messages[2]["content"] == env["text"]
    assert len(mc.call.tools) == len(body["tools"]) and mc.call.dropped_tools == ()
    assert (mc.call.sampling.max_tokens, mc.call.stream) == (32000, True)
    # A template that writes only the first system message (this one) gets it as a user turn.
    assert not tiny.renders_late_system
    prompt = tiny.render(mc.call.messages, mc.call.tools)
    assert "<|im_start|>user\n# Environment" in prompt


def test_claude_code_follow_up_continues_the_captured_conversation() -> None:
    first, follow = recorded("claude"), recorded("claude", 1)
    # The environment entry, newest: a block list with cache_control; afterwards a string.
    assert isinstance(first["messages"][1]["content"], list) and isinstance(follow["messages"][1]["content"], str)
    turn = messages(first).call.raw_messages
    later = messages(follow).call.raw_messages
    assert same(later[: len(turn)], turn)  # the same system message either way
    call, result = later[len(turn):]
    assert call["tool_calls"][0]["function"]["name"] == "Bash" and result["role"] == "tool"


def test_anthropic_server_tools_are_left_out_unless_forced() -> None:
    body = recorded("claude")
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    mc = messages({**body, "tools": [*body["tools"], search]})
    assert mc.call.dropped_tools == ("web_search_20250305",)
    assert "web_search" not in [t["function"]["name"] for t in mc.call.tools]
    with pytest.raises(ApiError, match="server tool 'web_search_20250305' cannot run here"):
        messages({**body, "tools": [search]}, CollectorConfig(unsupported_tools="refuse"))
    with pytest.raises(ApiError, match="forces the server tool 'web_search'"):
        messages({**body, "tools": [search], "tool_choice": {"type": "tool", "name": "web_search"}})


# -- OpenClaw (all three APIs) -----------------------------------------------------------------------


@pytest.mark.parametrize("api", ["openai-completions", "openai-responses", "anthropic-messages"])
def test_openclaw_requests_pass_on_every_api(api: str, tiny: ChatTemplate) -> None:
    for i, req in enumerate(recording(f"openclaw-{api}")):
        body = req["body"]
        if api == "openai-completions":
            call = build_call(parse_body(raw(body)), {}, CollectorConfig())
        elif api == "openai-responses":
            call = responses(body).call
        else:
            call = messages(body).call
        if i == 0:
            assert [m["role"] for m in call.messages] == ["system", "user", "user"]
            assert call.messages[-1]["content"].startswith("<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>")
        assert [t["function"]["name"] for t in call.tools] == [
            t.get("name") or t["function"]["name"] for t in body["tools"]]
        assert call.dropped_tools == () and call.stream
        tiny.render(call.messages, call.tools)
