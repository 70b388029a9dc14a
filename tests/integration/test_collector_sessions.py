"""The agents' own session ids, through the real collector process (services/collector/sessions.py).

A stand-in engine answers every request "OK". A Codex-shaped conversation (the Responses API,
`session-id` and `thread-id` headers, as the Codex CLI sends them) and a Claude-Code-shaped one
(the Messages API, `x-claude-code-session-id` and the JSON `metadata.user_id`) each change their
system prompt between turns, so the prefix rule cannot pair the follow-up, and their exchange,
"hi" -> "OK", is under PAIRING_MIN_ANCHOR_CHARS: unscoped, nothing pairs it. Scoped to the
session id the agent sent, the follow-up pairs with its own session's turn — also when another
session (a Codex thread of the same root session, a Claude Code subagent of the same session)
sent the very same first request and got the very same answer — and a session with no turn of
its own pairs with none.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from shared.schemas import Turn
from tests.support.collector_harness import Turns, standin_collector

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[dict[str, str]]:
    with standin_collector(tmp_path_factory.mktemp("sessions-tok"), redis_url, "--reply", "OK") as s:
        yield s


@pytest.fixture
def turns(stack: dict[str, str]) -> Iterator[Turns]:
    with Turns(stack["redis"], stack["prefix"]) as t:
        yield t


def closed(turns: Turns, tag: str) -> dict[str, Turn]:
    """The closed turns of this test (their system prompt holds `tag`), by session id. A
    follow-up closes the turn it pairs with inside its own request (the close script emits
    it), so once the requests have been answered, every pairing there is is on the stream."""
    out: dict[str, Turn] = {}
    for t in turns.all():
        if tag in str(t.messages[0].get("content")):
            assert t.session_id not in out, f"two turns of {t.session_id} closed"
            out[t.session_id] = t
    return out


def user_texts(turn: Turn) -> list[str]:
    return [str(m["content"]) for m in turn.next_state or [] if m["role"] == "user"]


def test_codex_shaped_follow_ups_pair_by_their_thread_id(stack: dict[str, str], turns: Turns) -> None:
    tag = uuid.uuid4().hex[:8]
    root, threads = f"root-{tag}", {k: f"thread-{k}-{tag}" for k in ("main", "sub", "other")}
    with openai.OpenAI(base_url=stack["url"] + "/v1", api_key="k", max_retries=0, timeout=30) as client:

        def send(thread: str | None, minute: int, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
            headers = {"session-id": root, "thread-id": thread} if thread else {}
            out = client.responses.create(
                model="m", instructions=f"You are Codex ({tag}). The time is 10:{minute:02}.",
                input=items, store=False, max_output_tokens=8, extra_headers=headers)  # type: ignore[arg-type]  # fmt: skip
            assert out.output_text == "OK"
            return [item.model_dump(exclude_none=True) for item in out.output]

        def msg(text: str) -> dict[str, Any]:
            return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}

        # The main thread and a subagent's thread (the same root session-id) ask the very
        # same first question and get the very same answer.
        answer = send(threads["main"], 0, [msg("hi")])
        send(threads["sub"], 0, [msg("hi")])
        send(None, 0, [msg(f"hi {tag}")])  # and one without any session header
        # The follow-ups, a minute later (the system prompt changed: no prefix pairs them).
        send(threads["main"], 1, [msg("hi"), *answer, msg("go on")])
        send(threads["sub"], 1, [msg("hi"), *answer, msg("continue")])
        send(threads["other"], 1, [msg("hi"), *answer, msg("what?")])  # no turn of its own
        send(None, 1, [msg(f"hi {tag}"), *answer, msg("and?")])  # "hi …" -> "OK": too short unscoped

    got = closed(turns, tag)
    assert set(got) == {threads["main"], threads["sub"]}, {k: user_texts(t) for k, t in got.items()}
    assert user_texts(got[threads["main"]]) == ["go on"] and user_texts(got[threads["sub"]]) == ["continue"]
    for t in got.values():
        assert t.closed_by == "next_request" and t.turn_index == 0 and t.user is None


def test_claude_code_shaped_follow_ups_pair_by_their_session_id(stack: dict[str, str], turns: Turns) -> None:
    tag = uuid.uuid4().hex[:8]
    device = uuid.uuid4().hex * 2  # Claude Code's device_id: 64 hex digits
    main, other = str(uuid.uuid4()), str(uuid.uuid4())
    agent = "a" + uuid.uuid4().hex[:16]  # a subagent of the main session
    with anthropic.Anthropic(base_url=stack["url"], api_key="k", max_retries=0, timeout=30) as client:

        def send(session: str | None, minute: int, messages: list[dict[str, Any]],
                 subagent: str | None = None) -> dict[str, Any]:  # fmt: skip
            headers = {"x-claude-code-session-id": session} if session else {}
            if subagent:
                headers["x-claude-code-agent-id"] = subagent
            user_id = json.dumps({"device_id": device, "account_uuid": "", "session_id": session or ""})
            out = client.messages.create(
                model="m", max_tokens=8, messages=messages,  # type: ignore[arg-type]
                system=[{"type": "text", "text": f"You are Claude Code ({tag}). The time is 10:{minute:02}."}],
                metadata={"user_id": user_id} if session else anthropic.NOT_GIVEN, extra_headers=headers)  # fmt: skip
            assert [b.model_dump(exclude_none=True) for b in out.content] == [{"type": "text", "text": "OK"}]
            return {"role": "assistant", "content": "OK"}

        def msg(text: str) -> dict[str, Any]:
            return {"role": "user", "content": text}

        answer = send(main, 0, [msg("hi")])
        send(main, 0, [msg("hi")], subagent=agent)  # the very same first request, in a subagent
        send(None, 0, [msg(f"hi {tag}")])
        send(main, 1, [msg("hi"), answer, msg("go on")])
        send(main, 1, [msg("hi"), answer, msg("continue")], subagent=agent)
        send(other, 1, [msg("hi"), answer, msg("what?")])  # a session with no turn of its own
        send(None, 1, [msg(f"hi {tag}"), answer, msg("and?")])

    got = closed(turns, tag)
    sub = f"{main}/{agent}"
    assert set(got) == {main, sub}, {k: user_texts(t) for k, t in got.items()}
    assert user_texts(got[main]) == ["go on"] and user_texts(got[sub]) == ["continue"]
    for t in got.values():  # the device is the user, not the JSON string with its session id
        assert t.closed_by == "next_request" and t.user == device
