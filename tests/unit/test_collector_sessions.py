"""The session id and the user the collector reads from what a client sends (sessions.py), on
the requests recorded from the real agents (tests/data/agents: OpenClaw 2026.9.6, the Codex CLI
0.171.0 and Claude Code 2.1.332, each file says how it was recorded), and what pairing makes of
them: the subagents of one Claude Code session are conversations of their own."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from services.collector.anthropic_request import build_messages_call, parse_messages
from services.collector.openai_shapes import ApiError
from services.collector.pairing import HISTORY, canonical
from services.collector.request import ChatCall
from services.collector.responses_request import build_responses_call, parse_responses
from services.collector.sessions import agent_session, claude_user
from services.collector.settings import CollectorConfig
from tests.support.agents import recording
from tests.unit.test_collector_pairing_anchors import Pairer

CFG = CollectorConfig()
SESSION_HEADERS = ("x-session-id", "session-id", "thread-id", "x-claude-code-session-id")


def collector_call(req: dict[str, Any]) -> ChatCall:
    """The call the collector builds from a recorded request, headers and all."""
    body, headers = json.dumps(req["body"]).encode(), req["headers"]
    if req["path"].split("?")[0].endswith("/responses"):
        return build_responses_call(parse_responses(body), None, headers, CFG).call
    return build_messages_call(parse_messages(body), headers, CFG).call


def without(req: dict[str, Any], *headers: str) -> dict[str, Any]:
    out = copy.deepcopy(req)
    for h in headers:
        del out["headers"][h]
    return out


def metadata(req: dict[str, Any]) -> dict[str, str]:
    meta: dict[str, str] = json.loads(req["body"]["metadata"]["user_id"])
    return meta


# -- the Codex CLI -------------------------------------------------------------------------------


def test_codex_names_its_thread_and_that_is_the_session() -> None:
    for req in recording("codex"):
        call = collector_call(req)
        assert (call.session_hint, call.session_from) == (req["headers"]["thread-id"], "thread-id")
        assert call.user is None
    # Without a thread id (a Codex that sends none), its session id.
    req = without(recording("codex")[0], "thread-id")
    assert (collector_call(req).session_hint, collector_call(req).session_from) == (req["headers"]["session-id"], "session-id")


def test_a_codex_subagent_runs_in_a_thread_of_its_own() -> None:
    root, follow, sub = recording("codex-subagent")
    assert [r["body"]["input"][-1].get("type") for r in (root, follow)] == ["message", "function_call_output"]
    # What Codex sends: the root's session-id and prompt_cache_key, a thread of its own.
    h = sub["headers"]
    assert h["session-id"] == root["headers"]["session-id"] == root["headers"]["thread-id"]
    assert sub["body"]["prompt_cache_key"] == root["body"]["prompt_cache_key"]
    assert h["thread-id"] != root["headers"]["thread-id"] == h["x-codex-parent-thread-id"]
    assert h["x-openai-subagent"] == "collab_spawn"
    # The collector: two sessions, the root's thread and the subagent's.
    sessions = [collector_call(r).session_hint for r in (root, follow, sub)]
    assert sessions == [root["headers"]["thread-id"]] * 2 + [h["thread-id"]]


# -- Claude Code -------------------------------------------------------------------------------------


def test_claude_code_names_its_session_and_its_device_is_the_user() -> None:
    reqs = recording("claude")
    meta = metadata(reqs[0])
    assert set(meta) == {"device_id", "account_uuid", "session_id"} and meta["account_uuid"] == ""
    for req in reqs:
        call = collector_call(req)
        sid = req["headers"]["x-claude-code-session-id"]
        assert (call.session_hint, call.session_from) == (sid, "x-claude-code-session-id")
        assert metadata(req)["session_id"] == sid
        # Not the whole JSON string with its per-session id: the device, in every session.
        assert call.user == meta["device_id"] != req["body"]["metadata"]["user_id"]
        # Through a proxy that drops the header: the session id inside metadata.user_id.
        bare = collector_call(without(req, "x-claude-code-session-id"))
        assert (bare.session_hint, bare.session_from, bare.user) == (sid, "metadata.user_id", call.user)


def test_claude_code_subagents_are_sessions_of_their_own() -> None:
    reqs = recording("claude-subagents")
    sid = reqs[0]["headers"]["x-claude-code-session-id"]
    # What Claude Code sends: one session id (header and metadata) on every request; a
    # subagent's requests also carry its own agent id.
    assert {r["headers"]["x-claude-code-session-id"] for r in reqs} == {sid}
    assert {r["body"]["metadata"]["user_id"] for r in reqs} == {reqs[0]["body"]["metadata"]["user_id"]}
    agents = [r["headers"].get("x-claude-code-agent-id") for r in reqs]
    assert agents[0] is agents[1] is agents[-1] is None and len(set(agents) - {None}) == 3
    calls = [collector_call(r) for r in reqs]
    assert [c.session_hint for c in calls] == [sid if a is None else f"{sid}/{a}" for a in agents]
    assert {c.user for c in calls} == {metadata(reqs[0])["device_id"]}
    # Two nested subagents sent the very same first request: two sessions all the same.
    assert [canonical(m) for m in calls[3].messages] == [canonical(m) for m in calls[4].messages]
    assert None is not agents[3] != agents[4] is not None and calls[3].session_hint != calls[4].session_hint


def test_twin_subagents_pair_each_with_its_own_turn() -> None:
    """The two nested subagents' very same first request, answered the same (as a greedy
    policy would), then each one's follow-up: scoped to its agent's session, each closes
    its own turn. By the session id alone (the one a whole Claude Code session shares),
    the two are one scope: both are refused, neither pairs wrongly. As the collector had it
    before (the whole metadata string as the session and the user), the second turn
    replaced the first as a retry would, and the first subagent's follow-up closed the
    second's turn."""
    reqs = recording("claude-subagents")
    first = [collector_call(reqs[i]) for i in (3, 4)]
    follow = collector_call(reqs[5])  # the first twin's follow-up, as recorded
    assert reqs[5]["headers"]["x-claude-code-agent-id"] == reqs[3]["headers"]["x-claude-code-agent-id"]
    n = len(first[0].messages)
    answer = follow.messages[n]  # its answer: the Agent call
    assert [canonical(m) for m in follow.messages[:n]] == [canonical(m) for m in first[0].messages]
    assert answer["role"] == "assistant" and answer["tool_calls"]
    own = [follow.messages, copy.deepcopy(follow.messages)]
    result = next(m for m in own[1][n + 1:] if m["role"] == "tool")
    result["content"] = "The second twin's own subagent said: hello.py, notes.txt"
    # (scope of each twin, conversation of each twin) as each collector version takes them
    sid = reqs[3]["headers"]["x-claude-code-session-id"]
    user_id = reqs[3]["body"]["metadata"]["user_id"]
    cases = {
        "agent": ([c.session_hint for c in first], ["c3", "c4"], [["t3"], ["t4"]]),
        "session id alone": ([sid, sid], ["c3", "c4"], [[], []]),
        "before": ([user_id, user_id], [user_id, user_id], [["t4"], []]),
    }
    for case, (scopes, conversations, expect) in cases.items():
        p = Pairer()
        for k, (call, scope, conv) in enumerate(zip(first, scopes, conversations, strict=True)):
            p.request(call.messages, answer, f"t{k + 3}", scope, conv)
        got = [p.request(msgs, {"role": "assistant", "content": "Done."}, f"f{k}", scope, conv)[0]
               for k, (msgs, scope, conv) in enumerate(zip(own, scopes, conversations, strict=True))]  # fmt: skip
        assert got == expect, case


def test_a_scoped_follow_up_tells_the_very_same_conversation_of_two_sessions_apart() -> None:
    """Two sessions, the very same first request and answer: the prefix rule cannot tell
    whose a follow-up is, the anchors scoped to the follow-up's session can."""
    for scoped in (False, True):
        p = Pairer()
        first = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
        ok = {"role": "assistant", "content": "OK"}
        for s in ("a", "b"):
            p.request(first, ok, f"{s}1", s if scoped else None, s)
        for s in ("b", "a"):
            got = p.request([*first, ok, {"role": "user", "content": f"{s}: go on"}], ok, f"{s}2",
                            s if scoped else None, s)  # fmt: skip
            assert got == (([f"{s}1"], HISTORY) if scoped else ([], "prefix")), (scoped, s)


# -- OpenClaw, and our own session id ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["openclaw-openai-completions", "openclaw-openai-responses",
                                  "openclaw-anthropic-messages", "openclaw-lean"])  # fmt: skip
def test_openclaw_sends_no_session_id(name: str) -> None:
    from services.collector.request import build_call, parse_body

    for req in recording(name):
        names = set(req["headers"])
        assert not names & set(SESSION_HEADERS)
        assert not [h for h in names if any(w in h for w in ("session", "thread", "conversation"))], names
        assert not {"session_id", "user", "metadata", "prompt_cache_key"} & set(req["body"])
        body = json.dumps(req["body"]).encode()
        if req["path"].endswith("/chat/completions"):
            call = build_call(parse_body(body), req["headers"], CFG)
        else:
            call = collector_call(req)
        assert (call.session_hint, call.session_from, call.user) == (None, None, None)


def test_our_session_id_wins_over_the_agents() -> None:
    codex, claude = recording("codex")[0], recording("claude")[0]
    for req in (codex, claude):
        header = copy.deepcopy(req)
        header["headers"]["x-session-id"] = "mine"
        header["body"]["session_id"] = "body"
        assert (collector_call(header).session_hint, collector_call(header).session_from) == ("mine", "x-session-id")
        body = copy.deepcopy(req)
        body["body"]["session_id"] = "body"
        assert (collector_call(body).session_hint, collector_call(body).session_from) == ("body", "session_id")
    mine = copy.deepcopy(claude)
    mine["headers"]["x-session-id"] = "mine"
    assert collector_call(mine).user == metadata(claude)["device_id"]
    long = copy.deepcopy(codex)
    long["headers"]["x-session-id"] = "x" * 257
    with pytest.raises(ApiError, match="session_id is longer than 256"):
        collector_call(long)


def test_an_agent_id_that_is_empty_too_long_or_not_printable_is_not_used() -> None:
    base = {"session-id": "root", "x-claude-code-session-id": "cc"}
    for bad in ("", "   ", "t" * 257, "a\tb"):
        got = agent_session({**base, "thread-id": bad})
        assert got is not None and (got.id, got.source) == ("root", "session-id"), bad
        got = agent_session({"x-claude-code-session-id": bad}, "embedded")
        assert got is not None and (got.id, got.source) == ("embedded", "metadata.user_id"), bad
    assert agent_session({}) is None and agent_session({"x-claude-code-agent-id": "a1"}) is None
    got = agent_session({"x-claude-code-session-id": "s" * 250, "x-claude-code-agent-id": "a1234567"})
    assert got is not None and got.id == "s" * 250  # with its agent id it would be too long


@pytest.mark.parametrize(("user_id", "expect"), [
    ('{"device_id":"d1","account_uuid":"acc-1","session_id":"s1"}', ("acc-1", "s1")),  # logged in
    ('{"device_id":"d1","account_uuid":"","session_id":"s1"}', ("d1", "s1")),
    ('{"user_id":"u1","session_id":"s1"}', ("u1", "s1")),
    ('{"session_id":"s1"}', (None, "s1")),
    ("user_" + "ab" * 32 + "_account_0b1c-22d3_session_5e6f-77a8", ("0b1c-22d3", "5e6f-77a8")),  # before the JSON
    ("user_" + "ab" * 32 + "_account__session_5e6f-77a8", ("ab" * 32, "5e6f-77a8")),
    ("alice@example.com", ("alice@example.com", None)),  # any other client's: as sent
    ('{"team":"blue"}', ('{"team":"blue"}', None)),
    ('{"device_id": 7}', ('{"device_id": 7}', None)),
    ('["d1"]', ('["d1"]', None)),
    ("{not json", ("{not json", None)),
])  # fmt: skip
def test_claude_user_id(user_id: str, expect: tuple[str | None, str | None]) -> None:
    assert claude_user(user_id) == expect
