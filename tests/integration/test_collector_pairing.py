"""Pairing by anchor through real Redis: the close and register scripts in process (across
replicas, ambiguity, groups, an outage), and the real collector process driven the way
OpenClaw drives it — a trailing internal-context message on every request, dropped and
replaced in the history it resends, no session id — on Chat Completions, the Responses
API and Anthropic Messages, with the official clients.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from services.collector.capture import State
from services.collector.pairing import analyze, candidates, offer, response_hash, stored_anchors
from shared.schemas import Turn
from shared.settings import Settings
from tests.integration.test_collector_capture import CACHE, Replicas, new_turn, replicas_turns, user
from tests.support.collector_harness import Turns, standin_collector
from tests.support.servers import RedisServer

pytestmark = pytest.mark.integration

SYSTEM = "You are a personal assistant running inside OpenClaw."
MIN = 32


def ctx(n: int) -> dict[str, Any]:
    return {"role": "user", "content": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nActive exec sessions:\n"
                                       f"exec-{n} (running)\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"}  # fmt: skip


def system() -> dict[str, Any]:
    return {"role": "system", "content": SYSTEM}


def reply(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


@pytest.fixture
async def replicas(settings: Settings, tmp_path: Path) -> AsyncIterator[Replicas]:
    r = Replicas(settings, tmp_path)
    yield r
    await r.close()


class Agent:
    """Stores and follows up turns through Capture as the chat service does (both rules)."""

    def __init__(self, cap: Any) -> None:
        self.cap = cap

    async def store(self, messages: list[dict[str, Any]], answer: str, session: str = "s1",
                    index: int = 0) -> Turn:  # fmt: skip
        conv = analyze(messages)
        t = new_turn(messages, answer, session, index)
        await self.cap.finish(t, CACHE, response_hash(conv.hashes, t.response),
                              anchors=stored_anchors(conv, t.response, MIN))  # fmt: skip
        return t

    async def follow(self, messages: list[dict[str, Any]]) -> Any:
        conv = analyze(messages)
        return await self.cap.begin(messages, candidates(messages, conv.hashes, 64), offer(conv, MIN))


async def test_a_follow_up_that_dropped_the_context_pairs_by_anchor_across_replicas(replicas: Replicas) -> None:
    a, b = Agent(replicas.make(0)), Agent(replicas.make(1))
    u1, u2 = user("What is the weather like in Lisbon in May?"), user("And in June?")
    t1 = await a.store([system(), u1, ctx(1)], "Mild, about 22 C by day, cooler at night.")
    follow = [system(), u1, t1.response, u2, ctx(2)]
    lk = await b.follow(follow)
    assert (lk.closed, lk.paired_by, lk.cache, lk.session_id, lk.turn_index) == (1, "history", CACHE, "s1", 1)
    (got,) = await replicas.turns()
    assert got.id == t1.id and got.closed_by == "next_request" and got.next_state == [u2, ctx(2)]
    # Resent (a retry of the follow-up): nothing more to close; the session carries over.
    again = await a.follow(follow)
    assert (again.closed, again.paired_by, again.session_id, again.turn_index) == (0, None, "s1", 1)
    assert len(await replicas.turns()) == 1


async def test_an_anchor_two_sessions_registered_is_refused(replicas: Replicas) -> None:
    agent = Agent(replicas.make(0))
    u1 = user("Hi! Can you help me plan a weekend trip?")
    same = "Of course! Where would you like to go?"
    ta = await agent.store([system(), u1, ctx(1)], same, "sa")
    tb = await agent.store([system(), u1, ctx(2)], same, "sb")
    lk = await agent.follow([system(), u1, ta.response, user("Porto."), ctx(3)])
    assert (lk.closed, lk.refused, lk.session_id) == (0, True, None)
    r, keys = agent.cap.bus.redis, agent.cap.bus.keys
    for messages, t in (([system(), u1, ctx(1)], ta), ([system(), u1, ctx(2)], tb)):  # both still pending
        assert await r.exists(keys.pending_turn(response_hash(analyze(messages).hashes, t.response)))
    assert await replicas.turns() == []


async def test_the_very_same_conversation_in_two_sessions_pairs_with_neither_and_both_expire(
    replicas: Replicas,
) -> None:
    cap = replicas.make(0, pending_ttl_s=0.5)
    agent = Agent(cap)
    first = [system(), user("hello")]
    ta = await agent.store(first, "Hello! How can I help you today?", "sa")
    tb = await agent.store(first, "Hello! How can I help you today?", "sb")
    lk = await agent.follow([*first, ta.response, user("Book a table for two.")])
    assert (lk.closed, lk.refused, lk.session_id) == (0, True, None)
    # A retry within one session replaces its own turn, as before.
    again = [system(), user("good evening")]
    await agent.store(again, "Good evening! What can I do for you?", "sc")
    tc = await agent.store(again, "Good evening! What can I do for you?", "sc")
    lk = await agent.follow([*again, tc.response, user("A table, please.")])
    assert (lk.closed, lk.session_id) == (1, "sc")
    runner = asyncio.create_task(cap.run())
    try:
        got = await replicas.wait_turns(lambda ts: len(ts) == 3)
    finally:
        cap.stop()
        await runner
    assert {t.id: t.closed_by for t in got} == {ta.id: "ttl", tb.id: "ttl", tc.id: "next_request"}


async def test_a_group_member_continued_by_anchor_closes_its_siblings(replicas: Replicas) -> None:
    cap = replicas.make(0, group_unchosen="keep")
    request = [system(), user("Suggest a name for my sourdough starter."), ctx(1)]
    conv = analyze(request)
    names = ["Clint Yeastwood, a classic pun.", "Bread Pitt: it rises to the occasion.", "Doughbi-Wan Kenobi!"]
    turns = [new_turn(request, n).model_copy(update={"group_id": "g1", "group_index": i, "group_size": 3})
             for i, n in enumerate(names)]  # fmt: skip
    await cap.finish_group(turns, CACHE, [response_hash(conv.hashes, t.response) for t in turns],
                           [stored_anchors(conv, t.response, MIN) for t in turns])  # fmt: skip
    lk = await Agent(cap).follow([system(), request[1], turns[1].response, user("Love it."), ctx(2)])
    assert (lk.closed, lk.paired_by) == (1, "history")
    got = {t.group_index: t for t in await replicas.wait_turns(lambda ts: len(ts) == 3)}
    assert got[1].closed_by == "next_request" and got[1].next_state == [user("Love it."), ctx(2)]
    assert {got[0].closed_by, got[2].closed_by} == {"unchosen"}


async def test_anchors_pair_in_memory_in_an_outage_and_are_replayed(settings: Settings, tmp_path: Path) -> None:
    server = RedisServer().start()
    own = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": server.url})})
    reps = Replicas(own, tmp_path)
    try:
        cap = reps.make(0, redis_timeout_s=0.2)
        agent = Agent(cap)
        server.stop()
        u1, u2, u3 = user("List the files in the build folder."), user("Delete the logs."), user("Thanks.")
        t1 = await agent.store([system(), u1, ctx(1)], "There are 3 files: app.log, out.bin, run.log.")
        assert cap.state is State.DOWN
        f1 = [system(), u1, t1.response, u2, ctx(2)]
        lk = await agent.follow(f1)  # from memory
        assert (lk.closed, lk.paired_by, lk.session_id, lk.turn_index) == (1, "history", "s1", 1)
        t2 = await agent.store(f1, "Deleted app.log and run.log.", index=1)  # held, spooled with its anchors
        server.start()
        runner = asyncio.create_task(cap.run())
        deadline = time.monotonic() + 10
        while cap.state is not State.UP:
            assert time.monotonic() < deadline, "capture never went back to Redis"
            await asyncio.sleep(0.02)
        cap.stop()
        await runner
        # t2 was replayed into Redis with its anchors: another replica pairs it by anchor.
        lk2 = await Agent(reps.make(1)).follow([system(), u1, t1.response, u2, t2.response, u3, ctx(3)])
        assert (lk2.closed, lk2.paired_by, lk2.session_id, lk2.turn_index) == (1, "history", "s1", 2)
        got = {t.id: t for t in await reps.wait_turns(lambda ts: len(ts) == 2)}
        assert got[t1.id].next_state == [u2, ctx(2)] and got[t2.id].next_state == [u3, ctx(3)]
    finally:
        await reps.close()
        server.close()


async def test_turns_stored_without_anchors_still_pair_by_prefix(replicas: Replicas) -> None:
    """A pending turn an earlier version stored (no anchors) pairs as before."""
    cap = replicas.make(0)
    msgs = [system(), user("q")]
    t = new_turn(msgs, "a1")
    await cap.finish(t, CACHE, response_hash(analyze(msgs).hashes, t.response))  # no anchors
    lk = await Agent(cap).follow([*msgs, t.response, user("next")])
    assert (lk.closed, lk.paired_by) == (1, None)
    assert [x.id for x in await replicas_turns(cap)] == [t.id]


# -- the real collector, driven like OpenClaw -----------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[dict[str, str]]:
    with standin_collector(tmp_path_factory.mktemp("pairing-tok"), redis_url) as s:
        yield s


@pytest.fixture
def turns(stack: dict[str, str]) -> Iterator[Turns]:
    with Turns(stack["redis"], stack["prefix"]) as t:
        yield t


Send = Callable[[list[dict[str, Any]], bool], tuple[str, list[dict[str, Any]]]]


def conversation(send: Send, turns: Turns) -> None:
    """Three requests shaped like OpenClaw's: [system, u1, ctx1], then the history it keeps
    (without the context) + the next message + a new context. `send(messages, done)` returns
    (the session id answered, what the agent appends to its history for the answer)."""
    tag = uuid.uuid4().hex[:8]
    u = [user(f"{tag}: what is the weather like in Lisbon in May?"), user(f"{tag}: and in June?"),
         user(f"{tag}: thanks!")]  # fmt: skip
    sid, a1 = send([system(), u[0], ctx(1)], False)
    sid2, a2 = send([system(), u[0], *a1, u[1], ctx(2)], False)
    sid3, _ = send([system(), u[0], *a1, u[1], *a2, u[2], ctx(3)], True)
    assert sid == sid2 == sid3
    got = sorted(turns.wait(lambda ts: len(ts) == 3, sessions=[sid], what="three turns"), key=lambda t: t.turn_index)
    assert [(t.turn_index, t.closed_by) for t in got] == [(0, "next_request"), (1, "next_request"), (2, "session_done")]
    for t, (k, c) in zip(got[:2], ((1, 2), (2, 3)), strict=True):
        assert [m["content"] for m in t.next_state or []] == [u[k]["content"], ctx(c)["content"]]


def test_openclaw_shape_pairs_on_chat_completions(stack: dict[str, str], turns: Turns) -> None:
    with openai.OpenAI(base_url=stack["url"] + "/v1", api_key="k", max_retries=0, timeout=30) as client:
        def send(messages: list[dict[str, Any]], done: bool) -> tuple[str, list[dict[str, Any]]]:
            raw = client.chat.completions.with_raw_response.create(
                model="m", messages=messages, max_tokens=32,  # type: ignore[arg-type]
                extra_headers={"X-Session-Done": "1"} if done else None)  # fmt: skip
            msg = raw.parse().choices[0].message
            return raw.headers["x-session-id"], [{"role": "assistant", "content": msg.content}]

        conversation(send, turns)


def test_openclaw_shape_pairs_on_the_responses_api(stack: dict[str, str], turns: Turns) -> None:
    with openai.OpenAI(base_url=stack["url"] + "/v1", api_key="k", max_retries=0, timeout=30) as client:
        def send(messages: list[dict[str, Any]], done: bool) -> tuple[str, list[dict[str, Any]]]:
            raw = client.responses.with_raw_response.create(
                model="m", instructions=messages[0]["content"], input=messages[1:],  # type: ignore[arg-type]
                max_output_tokens=32, store=False, extra_headers={"X-Session-Done": "1"} if done else None)  # fmt: skip
            out = raw.parse().output
            return raw.headers["x-session-id"], [item.model_dump(exclude_none=True) for item in out]

        conversation(send, turns)


def test_openclaw_shape_pairs_on_anthropic_messages(stack: dict[str, str], turns: Turns) -> None:
    with anthropic.Anthropic(base_url=stack["url"], api_key="k", max_retries=0, timeout=30) as client:
        def send(messages: list[dict[str, Any]], done: bool) -> tuple[str, list[dict[str, Any]]]:
            raw = client.messages.with_raw_response.create(
                model="m", system=messages[0]["content"], messages=messages[1:], max_tokens=32,  # type: ignore[arg-type]
                extra_headers={"X-Session-Done": "1"} if done else None)  # fmt: skip
            msg = raw.parse()
            return raw.headers["x-session-id"], [{"role": "assistant",
                                                  "content": [b.model_dump(exclude_none=True) for b in msg.content]}]

        conversation(send, turns)
