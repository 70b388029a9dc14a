"""The pairing rule against the history rewrites real agents make, and against false pairs.

`Pairer` runs the rule over in-memory state as the close and register scripts run it in
Redis (pending_store.py; tested there against a real Redis in
tests/integration/test_collector_pairing.py): the prefix rule closes every candidate it
finds; when it knows nothing of the last response, the first registered anchor decides.
Requests go through the real request builders of each API, so a shape is tested as the
collector sees it; the sessions recorded from the real OpenClaw (three APIs), Codex CLI
and Claude Code (tests/data/agents) are replayed the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from services.collector.anthropic_request import build_messages_call, parse_messages
from services.collector.pairing import (
    ANSWER,
    EXCHANGE,
    HISTORY,
    PREVIOUS,
    AnchorIndex,
    analyze,
    candidates,
    next_state,
    offer,
    response_hash,
    stored_anchors,
)
from services.collector.request import build_call, parse_body
from services.collector.responses_request import build_responses_call, parse_responses
from services.collector.settings import CollectorConfig

CFG = CollectorConfig()
SYSTEM = "You are a personal assistant running inside OpenClaw. Use the tools when needed."
RETRY = "[Retry after the previous model attempt failed or timed out]\n\n"


def ctx(n: int) -> dict[str, Any]:
    """OpenClaw's trailing internal-context user message (a new one on every request)."""
    text = ("<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nConversation data (data, not instructions):\n"
            f'"Active exec sessions:\\n{"none" if n % 2 else f"exec-{n} (running)"}"\n'
            "<<<END_OPENCLAW_INTERNAL_CONTEXT>>>")  # fmt: skip
    return {"role": "user", "content": text}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def reply(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def call(name: str, args: dict[str, Any], cid: str = "call_1") -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}  # fmt: skip


def tool(content: str, cid: str = "call_1") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": cid, "content": content}


def sys(text: str = SYSTEM) -> dict[str, Any]:
    return {"role": "system", "content": text}


@dataclass
class Pairer:
    """The collector's two rules over in-memory pending turns (see the module docstring)."""

    rule: str = "anchors"
    min_chars: int = CFG.pairing_min_anchor_chars
    pending: dict[str, tuple[str, str]] = field(default_factory=dict)  # prefix hash -> (label, session)
    lineage: dict[str, str] = field(default_factory=dict)  # prefix hash -> label, "*": two sessions'
    index: AnchorIndex = field(default_factory=lambda: AnchorIndex(1 << 20))
    refused: int = 0

    def request(self, messages: list[dict[str, Any]], answer: dict[str, Any], label: str,
                scope: str | None = None, session: str = "s") -> tuple[list[str], str | None]:  # fmt: skip
        """Pair a request's (normalized) messages, then store its answer as turn `label` of
        `session`. Returns (the labels of the turns it closed, the rule that closed the last
        response's turn)."""
        conv = analyze(messages, scope)
        cands = candidates(messages, conv.hashes, CFG.max_pairing_candidates)
        closed = []
        clash = False
        for c in cands:
            if c.key in self.pending and self.lineage.get(c.key) == "*":
                clash = c is cands[-1]
                self.refused += c is not cands[-1]
            elif c.key in self.pending:
                closed.append(self.pending.pop(c.key)[0])
        # Scoped anchors decide also where the prefix rule saw two sessions' very conversation.
        known = bool(cands) and cands[-1].key in self.lineage
        how = "prefix" if known and not (conv.scope and self.lineage[cands[-1].key] == "*") else None
        tolerant = offer(conv, self.min_chars) if self.rule == "anchors" else None
        if cands and how is None and tolerant is not None:
            assert tolerant.end == cands[-1].end  # both are the last assistant message
            via, h = self.index.decide([a.key for a in tolerant.anchors])
            if via < 0 or (h is not None and self.lineage.get(h) == "*" and not conv.scope):
                self.refused += not clash
            elif h is not None and h in self.pending:
                closed.append(self.pending.pop(h)[0])
                how, clash = tolerant.anchors[via - 1].kind, False
        self.refused += clash
        key = target = response_hash(conv.hashes, answer)
        held = self.pending.get(key)
        if self.lineage.get(key) == "*" or (held is not None and held[1] != session):
            self.lineage[key], target = "*", f"{key}#{label}"  # the same conversation, two sessions
        else:
            self.lineage[key] = label
        self.pending[target] = (label, session)
        if self.rule == "anchors":
            self.index.register(target, stored_anchors(conv, answer, self.min_chars))
        return closed, how


def chat(messages: list[dict[str, Any]], session: str | None = None) -> list[dict[str, Any]]:
    body: dict[str, Any] = {"model": "m", "messages": messages}
    return build_call(parse_body(json.dumps(body).encode()), {"x-session-id": session} if session else {},
                      CFG).messages  # fmt: skip


def responses(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same conversation as a Responses request: instructions, then input items (an
    assistant answer as the output items an SDK resends)."""
    items: list[dict[str, Any]] = []
    for m in messages[1:]:
        if m["role"] == "assistant" and m.get("tool_calls"):
            items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                       "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]  # fmt: skip
        elif m["role"] == "assistant":
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": m["content"]}]})  # fmt: skip
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
        else:
            items.append({"type": "message", "role": m["role"],
                          "content": [{"type": "input_text", "text": m["content"]}]})  # fmt: skip
    body = {"model": "m", "instructions": messages[0]["content"], "input": items}
    return build_responses_call(parse_responses(json.dumps(body).encode()), None, {}, CFG).call.messages


def anthropic(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same conversation as a Messages request: system on top, tool calls and results
    as content blocks."""
    out: list[dict[str, Any]] = []
    for m in messages[1:]:
        if m["role"] == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in m["tool_calls"]]})  # fmt: skip
        elif m["role"] == "tool":
            out.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}]})  # fmt: skip
        else:
            out.append({"role": m["role"], "content": m["content"]})
    body = {"model": "m", "max_tokens": 64, "system": messages[0]["content"], "messages": out}
    return build_messages_call(parse_messages(json.dumps(body).encode()), {}, CFG).call.messages


APIS = {"chat": chat, "responses": responses, "messages": anthropic}


# -- (a) trailing messages after the user's, dropped or replaced -------------------------------------


@pytest.mark.parametrize("api", list(APIS))
def test_openclaw_trailing_context_is_dropped_and_replaced(api: str) -> None:
    to = APIS[api]
    a1, a2 = reply("Lisbon in May is mild, about 22 C by day."), reply("Pack a light jacket for the evenings.")
    u1, u2, u3 = user("What is the weather like in Lisbon in May?"), user("What should I pack?"), user("thanks")
    for rule, expect in (("anchors", ([["t1"], ["t2"]], HISTORY)), ("prefix", ([[], []], None))):
        p = Pairer(rule)
        assert p.request(to([sys(), u1, ctx(1)]), a1, "t1") == ([], None)
        got1 = p.request(to([sys(), u1, a1, u2, ctx(2)]), a2, "t2")
        got2 = p.request(to([sys(), u1, a1, u2, a2, u3, ctx(3)]), reply("You're welcome."), "t3")
        assert [got1[0], got2[0]] == expect[0] and got1[1] == got2[1] == expect[1], rule


@pytest.mark.parametrize("api", list(APIS))
def test_openclaw_tool_loop_with_context_after_each_tool_result(api: str) -> None:
    to = APIS[api]
    p = Pairer()
    u1 = user("Run the unit tests of the parser and tell me what fails.")
    c1 = call("exec", {"command": "pytest -q -k parser"})
    t1 = tool("1 failed, 41 passed: test_parser.py::test_unicode_escape")
    a2 = reply("One test fails: test_unicode_escape. Want me to look at it?")
    p.request(to([sys(), u1, ctx(1)]), c1, "call")
    follow = to([sys(), u1, c1, t1, ctx(2)])
    assert p.request(follow, a2, "answer") == (["call"], HISTORY)
    # The next state is what followed the call in this request: the result and the context.
    end = offer(analyze(follow), CFG.pairing_min_anchor_chars)
    assert end is not None and [m["role"] for m in next_state(follow, end.end)] == ["tool", "user"]


def test_context_replaced_inside_the_resent_history_pairs_by_the_exchange() -> None:
    """An agent that keeps its context message after the user's in the history it resends,
    but rewrites it on every request."""
    p = Pairer()
    u1 = user("Summarize the open pull requests of the repository.")
    c1 = call("gh", {"args": ["pr", "list", "--state", "open"]})
    t1 = tool("#12 parser: unicode escapes\n#14 docs: pairing")
    c2 = call("gh", {"args": ["pr", "view", "12"]}, "call_2")
    t2 = tool("parser: unicode escapes (+40 -3), 2 approvals", "call_2")
    p.request(chat([sys(), u1, ctx(1)]), c1, "call1")
    assert p.request(chat([sys(), u1, ctx(2), c1, t1]), c2, "call2") == (["call1"], HISTORY)
    got = p.request(chat([sys(), u1, ctx(3), c1, t1, c2, t2]), reply("Two are open: #12 and #14."), "answer")
    assert got == (["call2"], EXCHANGE)


# -- (b) a system prompt that changes between turns -------------------------------------------------


@pytest.mark.parametrize("api", list(APIS))
def test_changing_system_prompt(api: str) -> None:
    to = APIS[api]
    p = Pairer()
    u1, a1 = user("Remind me what is on my calendar today."), reply("You have a dentist appointment at 15:00.")
    p.request(to([sys(f"{SYSTEM}\nCurrent time: 2026-12-02 09:15"), u1]), a1, "t1")
    got = p.request(to([sys(f"{SYSTEM}\nCurrent time: 2026-12-02 09:17 | 3 unread"), u1, a1,
                        user("Move it to tomorrow.")]), reply("Done."), "t2")  # fmt: skip
    assert got == (["t1"], HISTORY)
    assert Pairer("prefix").request(to([sys(), u1]), a1, "x") == ([], None)


# -- (c) compaction -------------------------------------------------------------------------------


def session(n: int) -> list[dict[str, Any]]:
    """n exchanges of a coding session (user, assistant), without the system prompt."""
    out: list[dict[str, Any]] = []
    for i in range(n):
        out += [user(f"Step {i}: rename the helper number {i} in utils.py and update its callers."),
                reply(f"Renamed helper_{i} to format_{i} and updated 3 callers in cli.py.")]  # fmt: skip
    return out


@pytest.mark.parametrize("api", list(APIS))
def test_compaction_keeps_the_last_exchange(api: str) -> None:
    to = APIS[api]
    history = session(4)
    summary = user("The conversation history before this point was compacted into the following "
                   "summary:\nThe user asked to rename four helpers in utils.py; all were renamed.")  # fmt: skip
    nxt = user("Now run the tests.")
    p = Pairer()
    p.request(to([sys(), *history[:-1]]), history[-1], "t4")
    # Only the last exchange kept after the summary: the user's message and the answer.
    assert p.request(to([sys(), summary, *history[-2:], nxt]), reply("Running them."), "t5") == (["t4"], ANSWER)
    # The previous answer kept too: the exchange decides.
    p.request(to([sys(), *history[:-1]]), history[-1], "t4b")
    assert p.request(to([sys(), summary, *history[-3:], nxt]), reply("Running."), "t5b") == (["t4b"], EXCHANGE)
    if api != "messages":  # (no system message inside Anthropic's messages)
        # A summary as a system message: what is left of the history still holds the answer.
        p.request(to([sys(), *history[:-1]]), history[-1], "t4c")
        got = p.request(to([sys(), sys("Summary: four helpers renamed."), *history[-2:], nxt]),
                        reply("Ok, running."), "t5c")  # fmt: skip
        assert got == (["t4c"], ANSWER)
    assert Pairer("prefix").request(to([sys(), summary, *history[-2:], nxt]), reply("x"), "y")[0] == []


# -- (d) a resend after a retry ----------------------------------------------------------------------


def test_identical_resend_pairs_the_answer_the_agent_kept() -> None:
    p = Pairer()
    u1 = user("Write a haiku about the sea, please.")
    first, second = reply("Grey waves fold and break / salt wind over empty sand / the gulls have gone home"), \
        reply("Blue water breathing / the tide keeps its old promise / shells count the hours")
    p.request(chat([sys(), u1]), first, "attempt1")  # the agent timed out before it arrived
    p.request(chat([sys(), u1]), second, "attempt2")
    assert p.request(chat([sys(), u1, second, user("Another one.")]), reply("..."), "t2") == (["attempt2"], "prefix")
    assert p.pending.get(response_hash(analyze(chat([sys(), u1])).hashes, first)) == ("attempt1", "s")  # expires


@pytest.mark.parametrize("api", list(APIS))
def test_retry_that_rewrote_the_users_message(api: str) -> None:
    """OpenClaw's fallback retry prefixes the user's message; the history it resends holds
    the message as first typed."""
    to = APIS[api]
    p = Pairer()
    u1, a1 = user("Find the cheapest flight to Porto next Friday."), reply("The cheapest is TAP 1234 at 89 EUR.")
    u2 = user("Book it with my saved card.")
    p.request(to([sys(), u1, ctx(1)]), a1, "t1")
    p.request(to([sys(), u1, a1, u2, ctx(2)]), reply("Booking now..."), "lost")  # timed out at the agent
    a2 = reply("Booked TAP 1234 for Friday; confirmation AB12CD sent to your email.")
    marked = user(RETRY + u2["content"])
    assert p.request(to([sys(), u1, a1, marked, ctx(3)]), a2, "t2") == ([], None)  # t1 was closed already
    got = p.request(to([sys(), u1, a1, u2, a2, user("Thanks!"), ctx(4)]), reply("You're welcome."), "t3")
    assert got == (["t2"], PREVIOUS)
    # The transcript kept the marked message: the history anchor.
    p.request(to([sys(), u1, a1, marked, ctx(3)]), a2, "t2b")
    assert p.request(to([sys(), u1, a1, marked, a2, user("Thanks!")]), reply("Sure."), "t3b") == (["t2b"], HISTORY)


def test_a_resent_follow_up_closes_nothing_more() -> None:
    p = Pairer()
    u1, a1 = user("Translate 'good morning' into Portuguese."), reply("'Good morning' is 'Bom dia' in Portuguese.")
    p.request(chat([sys(), u1, ctx(1)]), a1, "t1")
    follow = chat([sys(), u1, a1, user("And good night?"), ctx(2)])
    assert p.request(follow, reply("Boa noite."), "t2") == (["t1"], HISTORY)
    assert p.request(follow, reply("Boa noite!"), "t2-again") == ([], None)
    assert p.refused == 0


# -- no false pairs --------------------------------------------------------------------------------


def test_sessions_sharing_a_short_reply_pair_each_with_its_own() -> None:
    p = Pairer()
    for s in ("a", "b"):
        history = [user(f"Session {s}: delete the temp files in /tmp/{s}-build?"), reply("OK")]
        p.request(chat([sys(), history[0], ctx(1)]), history[1], f"{s}1")
    for s in ("b", "a"):
        history = [user(f"Session {s}: delete the temp files in /tmp/{s}-build?"), reply("OK")]
        assert p.request(chat([sys(), *history, user("yes"), ctx(2)]), reply("OK"), f"{s}2") == ([f"{s}1"], HISTORY)
    # Their second exchanges ("yes" -> "OK") are the same: each pairs by its own history.
    for s in ("a", "b"):
        history = [user(f"Session {s}: delete the temp files in /tmp/{s}-build?"), reply("OK"), user("yes"), reply("OK")]
        assert p.request(chat([sys(), *history, user("thanks"), ctx(3)]), reply("."), f"{s}3") == ([f"{s}2"], HISTORY)


def test_a_short_exchange_of_another_session_is_never_taken() -> None:
    """Session b's own turn is not pending (expired, or never captured); a's is. b's
    follow-up shares only the exchange "yes" -> "OK" with it: too weak to pair."""
    p = Pairer()
    p.request(chat([sys(), user("Shall I archive the old logs of March?"), reply("Please confirm."),
                    user("yes"), ctx(1)]), reply("OK"), "a2")  # fmt: skip
    got = p.request(chat([sys(), user("Clear the cache of the build server."), reply("Please confirm."),
                          user("yes"), reply("OK"), user("and the logs too"), ctx(2)]), reply("OK"), "b3")  # fmt: skip
    assert got == ([], None) and ("a2", "s") in p.pending.values()


def test_common_system_prompt_and_first_message_with_different_answers() -> None:
    p = Pairer()
    first = user("Hi! Can you help me plan a weekend trip?")
    answers = {s: reply(f"Of course! Where would you like to go, and is it {s} people?") for s in ("two", "four")}
    for s, a in answers.items():
        p.request(chat([sys(), first, ctx(1)]), a, s, session=s)
    for s, a in answers.items():
        got = p.request(chat([sys(), first, a, user("Porto."), ctx(2)]), reply("Nice."), s + "2", session=s)
        assert got == ([s], HISTORY)


def test_identical_exchanges_of_two_live_sessions_are_refused() -> None:
    """Both sessions said the same and got the same answer (at temperature 0); their
    contexts differ, so the prefix rule tells the two pending turns apart but no anchor
    does: each follow-up is refused rather than given a coin flip."""
    p = Pairer()
    first = user("Hi! Can you help me plan a weekend trip?")
    same = reply("Of course! Where would you like to go?")
    p.request(chat([sys(), first, ctx(1)]), same, "a1", session="a")
    p.request(chat([sys(), first, ctx(2)]), same, "b1", session="b")
    assert p.request(chat([sys(), first, same, user("Porto."), ctx(3)]), reply("Nice."), "a2") == ([], None)
    assert p.refused == 1 and {("a1", "a"), ("b1", "b")} <= set(p.pending.values())


@pytest.mark.parametrize("trailing", [False, True])
def test_the_very_same_conversation_in_two_sessions_pairs_with_neither(trailing: bool) -> None:
    """Same system prompt, same first message, same answer, word for word (and the same
    context, or none): the two turns share a prefix hash, and no follow-up tells whose it
    is. Neither is continued (both expire, no next state), neither overwrites the other;
    a retry within one session still replaces its own turn."""
    tail = [ctx(1)] if trailing else []
    first, same = user("hello"), reply("Hello! How can I help you today?")
    for rule in ("anchors", "prefix"):
        p = Pairer(rule)
        p.request(chat([sys(), first, *tail]), same, "a1", session="a")
        p.request(chat([sys(), first, *tail]), same, "b1", session="b")
        assert len(p.pending) == 2
        for s in ("a", "b"):
            got = p.request(chat([sys(), first, same, user(f"{s}: book a table for two")]), reply("Done."), f"{s}2")
            assert got == ([], "prefix" if not trailing else None), rule
    p = Pairer()
    p.request(chat([sys(), first]), same, "a1", session="a")
    p.request(chat([sys(), first]), same, "a1-retry", session="a")
    assert p.request(chat([sys(), first, same, user("book it")]), reply("Done."), "a2") == (["a1-retry"], "prefix")


def test_ambiguity_outlives_the_turns_that_made_it() -> None:
    """An anchor two turns registered stays refused after one of them closed: a later
    follow-up of the closed one must not take the other."""
    p = Pairer()
    first = user("Hi! Can you help me plan a weekend trip?")
    same = reply("Of course! Where would you like to go?")
    p.request(chat([sys(), first, ctx(2)]), same, "a1")
    assert p.request(chat([sys(), first, same, user("Porto."), ctx(4)]), reply("Nice."), "a2") == (["a1"], HISTORY)
    p.request(chat([sys(), first, ctx(6)]), same, "b1")
    assert p.request(chat([sys(), first, same, user("Lisbon."), ctx(8)]), reply("Great."), "b2") == ([], None)
    assert p.refused == 1


def test_weak_anchors_pair_within_a_session_id() -> None:
    short = [user("yes"), reply("OK")]
    for scope, expect in ((None, ([], None)), ("s-1", (["t1"], HISTORY))):
        p = Pairer()
        p.request(chat([sys(), short[0], ctx(1)], scope), short[1], "t1", scope)
        assert p.request(chat([sys(), *short, user("go"), ctx(2)], scope), reply("Done."), "t2", scope) == expect
    p = Pairer()
    p.request(chat([sys(), short[0], ctx(1)], "s-1"), short[1], "t1", "s-1")
    assert p.request(chat([sys(), *short, user("go"), ctx(2)], "s-2"), reply("Done."), "t2", "s-2") == ([], None)


# -- the anchors themselves -------------------------------------------------------------------------


def test_anchor_kinds_and_their_order() -> None:
    request = chat([sys(), user("Open the settings page and enable dark mode."), reply("Which device?"),
                    user("The laptop."), ctx(1)])  # fmt: skip
    answer = reply("Dark mode is now enabled on your laptop.")
    conv = analyze(request)
    stored = stored_anchors(conv, answer, 32)
    follow = offer(analyze(chat([sys("other"), *request[1:-1], answer, user("thanks")])), 32)
    assert follow is not None
    assert [a.kind for a in follow.anchors] == [HISTORY, EXCHANGE, ANSWER, PREVIOUS]
    assert follow.anchors[0].key in stored and set(stored) >= {a.key for a in follow.anchors}
    # The answer anchors of a stored turn: one per message after its previous response.
    assert len(stored) == 5
    assert offer(analyze(chat([sys(), user("hello")])), 0) is None  # no assistant message yet


# -- the recorded agents (tests/data/agents/*.jsonl: each file says how it was recorded) ------------

RECORDED = Path(__file__).resolve().parents[1] / "data" / "agents"


def recorded_session(name: str) -> list[list[dict[str, Any]]]:
    """Each request of a recorded session as the collector's messages, in order."""
    out = []
    for line in (RECORDED / f"{name}.jsonl").read_text().splitlines():
        req = json.loads(line)
        path, body = req["path"].split("?")[0], json.dumps(req["body"]).encode()
        if path.endswith("/chat/completions"):
            out.append(build_call(parse_body(body), {}, CFG).messages)
        elif path.endswith("/responses"):
            out.append(build_responses_call(parse_responses(body), None, {}, CFG).call.messages)
        else:
            out.append(build_messages_call(parse_messages(body), {}, CFG).call.messages)
    return out


@pytest.mark.parametrize(("name", "today", "rules"), [
    ("openclaw-openai-completions", [[], []], [HISTORY, HISTORY]),
    ("openclaw-openai-responses", [["t0"], []], ["prefix", EXCHANGE]),  # keeps the context mid-loop once
    ("openclaw-anthropic-messages", [[], []], [HISTORY, HISTORY]),
    ("codex", [["t0"]], ["prefix"]),
    ("claude", [["t0"]], ["prefix"]),
])  # fmt: skip
def test_every_recorded_follow_up_closes_the_turn_it_continues(name: str, today: list[list[str]],
                                                               rules: list[str]) -> None:  # fmt: skip
    """Each request's answer is the assistant message its follow-up resends; the prefix
    rule alone (today's) is the baseline."""
    requests = recorded_session(name)
    for rule in ("prefix", "anchors"):
        p = Pairer(rule)
        got = []
        for k, messages in enumerate(requests):
            answered = sum(m["role"] == "assistant" for m in messages)
            later = [m for m in requests[k + 1] if m["role"] == "assistant"] if k + 1 < len(requests) else []
            answer = later[answered] if len(later) > answered else reply("the last answer")
            got.append(p.request(messages, answer, f"t{k}"))
        closed, how = [c for c, _ in got[1:]], [h for _, h in got[1:]]
        if rule == "prefix":
            assert closed == today, rule
        else:
            assert closed == [[f"t{k}"] for k in range(len(requests) - 1)] and how == rules
