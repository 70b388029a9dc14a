"""Pairing hashes: robust to what clients do to a history, sensitive to what matters."""

from __future__ import annotations

import json
from typing import Any

from services.collector.pairing import (
    candidates,
    canonical,
    next_state,
    prefix_hashes,
    response_hash,
)
from shared.chat_messages import normalize_messages

CALL = {"id": "call_abc", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}  # fmt: skip


def norm(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return normalize_messages(messages)


def key(messages: list[dict[str, Any]]) -> str:
    return prefix_hashes(norm(messages))[-1].hex()


def test_response_as_returned_matches_the_history_a_client_sends_back() -> None:
    request = [{"role": "user", "content": "weather?"}]
    returned = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    pending = response_hash(prefix_hashes(norm(request)), returned)
    # What different clients send back for that same response:
    variants: list[dict[str, Any]] = [
        {"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None},
        {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning_content": "hm"},
        {"role": "assistant", "tool_calls": [{
            "id": "call_OTHER", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"unit":"c","city":"Paris"}'}}]},
        {"role": "assistant", "content": [], "tool_calls": [{
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
    ]  # fmt: skip
    for v in variants:
        assert key([*request, v]) == pending, v


def test_content_forms_and_roles_that_mean_the_same() -> None:
    a = key([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi "}])
    b = key([{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
             {"role": "user", "content": "hi", "name": "bob"}])  # fmt: skip
    assert a == b


def test_tool_results_pair_without_their_call_ids() -> None:
    a = key([{"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    b = key([{"role": "tool", "tool_call_id": "x", "name": "get_weather", "content": "sunny"}])
    assert a == b


def test_differences_that_matter_change_the_hash() -> None:
    base = [{"role": "user", "content": "hi"}]
    assert key(base) != key([{"role": "user", "content": "hi!"}])
    assert key(base) != key([{"role": "system", "content": "hi"}])
    args_changed = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    assert key([{"role": "assistant", "content": None, "tool_calls": [CALL]}]) != key(
        [{"role": "assistant", "content": None, "tool_calls": [args_changed]}]
    )
    # Order is part of the conversation.
    two = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert key(two) != key(list(reversed(two)))


def test_hashes_chain_over_prefixes() -> None:
    msgs = norm([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                 {"role": "user", "content": "c"}])  # fmt: skip
    hs = prefix_hashes(msgs)
    assert len(hs) == 3 and len(set(hs)) == 3
    assert prefix_hashes(msgs[:2]) == hs[:2]
    assert response_hash(hs[:1], {"role": "assistant", "content": "b"}) == hs[1].hex()


def test_arguments_that_are_not_json_compare_as_text() -> None:
    bad = {"function": {"name": "f", "arguments": " not json "}}
    same = {"function": {"name": "f", "arguments": "not json"}}
    m1 = {"role": "assistant", "content": None, "tool_calls": [bad]}
    m2 = {"role": "assistant", "content": None, "tool_calls": [same]}
    assert canonical(m1) == canonical(m2)
    assert json.loads(canonical(m1))[2] == ["f", "not json"]


def test_candidates_are_prefixes_ending_on_assistant_messages() -> None:
    msgs = norm([
        {"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"}, {"role": "tool", "content": "t"},
    ])  # fmt: skip
    hs = prefix_hashes(msgs)
    cands = candidates(msgs, hs, limit=10)
    assert [c.end for c in cands] == [3, 5]
    assert [c.key for c in cands] == [hs[2].hex(), hs[4].hex()]
    assert [c.end for c in candidates(msgs, hs, limit=1)] == [5]


def test_next_state_runs_to_the_next_assistant_message() -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
        {"role": "tool", "content": "t1"}, {"role": "tool", "content": "t2"},
        {"role": "assistant", "content": "a2"}, {"role": "user", "content": "u3"},
    ]  # fmt: skip
    assert next_state(msgs, 2) == msgs[2:4]
    assert next_state(msgs, 5) == msgs[5:]
    assert next_state(msgs, 6) == []
