"""/openapi.json describes the bodies the collector takes: the real agents' recorded
requests (tests/data/agents) conform to it, and so do SDK-shaped requests."""

from __future__ import annotations

from typing import Any

import pytest
from jsonschema import Draft202012Validator

from services.collector.openapi import document
from tests.support.agents import recording

SCHEMAS = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/responses": "ResponsesCreateRequest",
           "/v1/messages": "MessagesCreateRequest"}
RECORDED = [(name, i) for name in ("openclaw-openai-completions", "openclaw-openai-responses",
                                   "openclaw-anthropic-messages", "codex", "claude")
            for i in range(len(recording(name)))]  # fmt: skip


def validator(name: str) -> Draft202012Validator:
    doc = document()
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": doc["components"]})


def test_the_document_is_openapi_3_1_over_the_three_apis() -> None:
    doc = document()
    assert doc["openapi"] == "3.1.0"
    assert {"/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
            "/v1/responses/{response_id}/input_items", "/v1/models"} <= set(doc["paths"])  # fmt: skip
    for schema in doc["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)
    integers = [s for s in _walk(doc) if s.get("type") == "integer"]
    assert integers and all(s["maximum"] <= (1 << 63) - 1 and s["minimum"] >= -(1 << 63) for s in integers)


def _walk(node: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if isinstance(node, dict):
        out.append(node)
        for v in node.values():
            out += _walk(v)
    elif isinstance(node, list):
        for v in node:
            out += _walk(v)
    return out


@pytest.mark.parametrize(("name", "i"), RECORDED)
def test_recorded_agent_requests_conform(name: str, i: int) -> None:
    req = recording(name)[i]
    errors = sorted(validator(SCHEMAS[req["path"].split("?")[0]]).iter_errors(req["body"]), key=str)
    assert not errors, [f"{list(e.absolute_path)}: {e.message[:200]}" for e in errors[:5]]


@pytest.mark.parametrize(("schema", "body"), [
    ("ChatCompletionRequest", {"model": "m", "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "x"}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
     "tool_choice": {"type": "function", "function": {"name": "f"}},
     "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}),
    ("ResponsesCreateRequest", {"model": "m", "input": [
        {"role": "user", "content": "q"}, {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": "ns"},
        {"type": "function_call_output", "call_id": "c", "output": "x"}],
     "tools": [{"type": "namespace", "name": "ns", "description": "d", "tools": [{"type": "function", "name": "f"}]},
               {"type": "web_search"}],
     "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}}),
    ("MessagesCreateRequest", {"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "s"}],
     "messages": [{"role": "user", "content": "q"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}],
     "tools": [{"name": "f", "input_schema": {"type": "object"}}, {"type": "web_search_20250305", "name": "web_search"}],
     "tool_choice": {"type": "auto"}}),
])  # fmt: skip
def test_sdk_shaped_requests_conform(schema: str, body: dict[str, Any]) -> None:
    errors = list(validator(schema).iter_errors(body))
    assert not errors, [e.message[:200] for e in errors[:5]]


def test_a_64_bit_overflow_does_not_conform() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "seed": 1 << 64}
    assert list(validator("ChatCompletionRequest").iter_errors(body))
