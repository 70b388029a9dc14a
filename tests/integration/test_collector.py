"""The collector end to end: official OpenAI SDK -> collector process -> CPU engine process on
the tiny random model, with real Redis. Completions (plain and streamed), pairing of
turns with their next states (sessions, interleaving, branches, side turns, session
end), auth, bad input, and the ops endpoints.

One engine and one collector serve the module; each test tells its turns apart by the
session ids the collector returns in `X-Session-Id`.
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

from shared.chat import ChatTemplate
from shared.engine_client import SGLangClient
from shared.schemas import SamplingParams
from tests.support.collector_harness import (
    Turns,
    check_turn,
    collector_process,
    engine_process,
    wait_ready,
)

pytestmark = pytest.mark.integration

KEYS = ("key-one", "key-two")


@pytest.fixture(scope="module")
def stack(tiny_model: Path, redis_url: str) -> Iterator[dict[str, str]]:
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    env = {"NEXTSTATE_ENV": "test", "NEXTSTATE_REDIS__URL": redis_url,
           "NEXTSTATE_REDIS__PREFIX": prefix}  # fmt: skip
    engine, engine_url = engine_process(tiny_model)
    collector, url = collector_process(env, engine_url, api_keys=",".join(KEYS), max_body_bytes=65536)
    try:
        wait_ready((engine, engine_url), (collector, url))
        collector.wait_http(url + "/readyz")
        yield {"url": url, "engine": engine_url, "prefix": prefix, "redis": redis_url,
               "model": tiny_model.name}  # fmt: skip
    finally:
        rc = collector.stop()
        engine.stop()
    assert rc == 0, collector.logs()
    assert "hello there" not in collector.logs()  # no conversation text in the logs


@pytest.fixture(scope="module")
def tpl(tiny_model: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(tiny_model)


@pytest.fixture
def client(stack: dict[str, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack["url"] + "/v1", api_key=KEYS[0], max_retries=0,
                       timeout=60) as c:  # fmt: skip
        yield c


@pytest.fixture
def turns(stack: dict[str, str]) -> Iterator[Turns]:
    t = Turns(stack["redis"], stack["prefix"])
    yield t
    t.close()


def ask(client: openai.OpenAI, messages: list[Any], headers: dict[str, str] | None = None,
        **kw: Any) -> tuple[dict[str, Any], dict[str, str]]:  # fmt: skip
    """One plain completion: (assistant message as an agent appends it, response headers
    plus `completion-id`: the response's own `id`)."""
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=kw.pop("max_tokens", 12), extra_headers=headers,
        **kw,
    )
    resp = raw.parse()
    assert resp.object == "chat.completion" and len(resp.choices) == 1
    msg = resp.choices[0].message.model_dump(exclude_none=True)
    return msg, {**raw.headers, "completion-id": resp.id}


def ask_stream(client: openai.OpenAI, messages: list[Any],
               headers: dict[str, str] | None = None, **kw: Any) -> tuple[dict[str, Any], dict[str, str], Any]:  # fmt: skip
    with client.chat.completions.with_streaming_response.create(
        model="tiny", messages=messages, max_tokens=kw.pop("max_tokens", 12), stream=True,
        stream_options={"include_usage": True}, extra_headers=headers, **kw,
    ) as raw:
        chunks = list(raw.parse())
        hdrs = {**raw.headers, "completion-id": chunks[0].id}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert finish == ["stop"] or finish == ["length"], finish
    return {"role": "assistant", "content": text}, hdrs, usage


def user(text: str) -> Any:
    return {"role": "user", "content": text}


# -- completions -------------------------------------------------------------------------------


def test_plain_completion_is_captured_with_the_engines_exact_tokens(
    client: openai.OpenAI, turns: Turns, tpl: ChatTemplate, stack: dict[str, str]
) -> None:
    msgs = [{"role": "system", "content": "be brief"}, user("hello there")]
    reply, headers = ask(client, msgs, seed=11, temperature=0.9)
    assert headers["x-policy-version"] == "0"
    sid = headers["x-session-id"]
    # Pending until its next state is known.
    assert turns.of(sid) == []
    _, h2 = ask(client, [*msgs, reply, user("thanks, great")], seed=12)
    assert h2["x-session-id"] == sid
    (t,) = turns.wait(lambda ts: len(ts) == 1, sessions=[sid])
    check_turn(t, tpl)
    assert (t.turn_index, t.closed_by, t.turn_type, t.source) == (0, "next_request", "main", "collector")
    assert t.next_state == [user("thanks, great")]
    assert t.messages == msgs and t.response["content"] == reply["content"]
    assert t.sampling == SamplingParams(temperature=0.9, max_tokens=12, seed=11)
    assert t.weight_version == "0" and t.model == stack["model"]
    assert t.completion_id == headers["completion-id"]  # the client's response, tied to its turn
    # The engine itself, given the same ids and seed, samples exactly these tokens.
    import asyncio

    async def direct() -> Any:
        async with SGLangClient(stack["engine"]) as eng:
            return await eng.generate(t.prompt_ids, t.sampling, stop_token_ids=tpl.stop_token_ids)

    res = asyncio.run(direct())
    assert res.output_ids == t.response_ids
    assert res.text == tpl.decode(t.response_ids)
    assert res.output_logprobs == pytest.approx(t.response_logprobs, abs=1e-5)


def test_streamed_completion_and_session_done(client: openai.OpenAI, turns: Turns, tpl: ChatTemplate) -> None:
    msgs = [user("tell me something")]
    reply, headers, usage = ask_stream(client, msgs, seed=3)
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["x-policy-version"] == "0"
    sid = headers["x-session-id"]
    assert usage is not None and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    follow = [*msgs, reply, user("ok, bye")]
    reply2, h2, _ = ask_stream(client, follow, {"X-Session-Done": "1"}, seed=4)
    assert h2["x-session-id"] == sid
    got = turns.wait(lambda ts: len(ts) == 2, sessions=[sid])
    by_index = {t.turn_index: t for t in got}
    first, last = by_index[0], by_index[1]
    assert first.closed_by == "next_request" and first.next_state == [user("ok, bye")]
    assert first.response["content"] == reply["content"]
    assert last.closed_by == "session_done" and last.next_state is None
    assert last.response["content"] == reply2["content"] and last.messages == follow
    assert (first.completion_id, last.completion_id) == (headers["completion-id"], h2["completion-id"])
    for t in got:
        check_turn(t, tpl)
    assert len(first.response_ids) == usage.completion_tokens


def test_multi_turn_session_keeps_its_id_and_counts_turns(
    client: openai.OpenAI, turns: Turns, tpl: ChatTemplate
) -> None:
    sid = f"s-{uuid.uuid4().hex[:8]}"
    msgs: list[Any] = [user("first question")]
    for i in range(3):
        if i == 1:  # streamed and plain turns pair the same way
            reply, headers, _ = ask_stream(client, msgs, {"X-Session-Id": sid}, seed=i)
        else:
            reply, headers = ask(client, msgs, {"X-Session-Id": sid}, seed=i)
        assert headers["x-session-id"] == sid
        msgs = [*msgs, reply, user(f"follow-up {i}")]
    ask(client, msgs, {"X-Session-Id": sid, "X-Session-Done": "true"})
    got = sorted(turns.wait(lambda ts: len(ts) == 4, sessions=[sid]), key=lambda t: t.turn_index)
    assert [t.turn_index for t in got] == [0, 1, 2, 3]
    assert [t.closed_by for t in got] == ["next_request"] * 3 + ["session_done"]
    for i, t in enumerate(got[:3]):
        assert t.next_state == [user(f"follow-up {i}")]
        check_turn(t, tpl)
    check_turn(got[3], tpl)


def test_interleaved_sessions_and_a_branch_pair_correctly(
    client: openai.OpenAI, turns: Turns, tpl: ChatTemplate
) -> None:
    a = [user("session A starts")]
    b = [user("session B starts")]
    ra, ha = ask(client, a, seed=1)
    rb, hb = ask(client, b, seed=2)
    sa, sb = ha["x-session-id"], hb["x-session-id"]
    assert sa != sb
    b2 = [*b, rb, user("B continues")]
    a2 = [*a, ra, user("A continues")]
    rb2, hb2 = ask(client, b2, seed=3)
    ra2, ha2 = ask(client, a2, seed=4)
    assert (ha2["x-session-id"], hb2["x-session-id"]) == (sa, sb)
    # A branch: the same A history, a different last message (the user edited it).
    a2_branch = [*a, ra, user("A takes another road")]
    _, hbr = ask(client, a2_branch, seed=5)
    assert hbr["x-session-id"] == sa  # inherited through the lineage of A's first response
    # Close the open turns so every one is emitted.
    ask(client, [*a2, ra2, user("A done")], {"X-Session-Done": "1"})
    ask(client, [*b2, rb2, user("B done")], {"X-Session-Done": "1"})
    got = turns.wait(lambda ts: len([t for t in ts if t.closed_by == "next_request"]) == 4,
                     sessions=[sa, sb])  # fmt: skip
    closed = {(t.session_id, t.turn_index): t for t in got if t.closed_by == "next_request"}
    assert closed[(sa, 0)].next_state == [user("A continues")]
    assert closed[(sb, 0)].next_state == [user("B continues")]
    assert closed[(sa, 1)].next_state == [user("A done")]
    assert closed[(sb, 1)].next_state == [user("B done")]
    assert closed[(sa, 1)].messages == a2 and closed[(sb, 1)].messages == b2
    # The branch's response is still pending (nobody followed it up): A's first turn was
    # emitted once, with the next state of the request that reached it first.
    assert [t.next_state for t in got if t.session_id == sa and t.turn_index == 0] == [
        [user("A continues")]
    ]
    for t in got:
        check_turn(t, tpl)


def test_side_turns_are_served_but_neither_captured_nor_closing(
    client: openai.OpenAI, turns: Turns, tpl: ChatTemplate
) -> None:
    msgs = [user("main line")]
    reply, headers = ask(client, msgs, seed=7)
    sid = headers["x-session-id"]
    follow = [*msgs, reply, user("next")]
    side, hs = ask(client, follow, {"X-Turn-Type": "side", "X-Session-Id": sid}, seed=8)
    assert side["content"] is not None and hs["x-policy-version"] == "0"
    ask(client, [*follow, side, user("more")], {"X-Turn-Type": "side", "X-Session-Id": sid})
    assert turns.of(sid) == []  # the side calls neither emitted anything nor closed the main turn
    ask(client, follow, {"X-Session-Done": "1"}, seed=9)
    got = turns.wait(lambda ts: len(ts) == 2, sessions=[sid])
    assert all(t.turn_type == "main" for t in got)
    (first,) = [t for t in got if t.turn_index == 0]
    assert first.next_state == [user("next")]
    for t in got:
        check_turn(t, tpl)


def test_tool_choice_none_renders_without_tools(client: openai.OpenAI, turns: Turns, tpl: ChatTemplate) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    _, headers = ask(client, [user("no tools please")], {"X-Session-Done": "1"}, tools=tools,
                     tool_choice="none")  # fmt: skip
    (t,) = turns.wait(lambda ts: len(ts) == 1, sessions=[headers["x-session-id"]])
    assert t.tools is None
    check_turn(t, tpl)


# -- auth, bad input, ops ------------------------------------------------------------------------


def test_auth(stack: dict[str, str]) -> None:
    base = stack["url"] + "/v1"
    for key in ("wrong", ""):
        with openai.OpenAI(base_url=base, api_key=key or "-", max_retries=0) as c, pytest.raises(
            openai.AuthenticationError
        ) as info:
            c.models.list()
        err = info.value.body
        assert isinstance(err, dict) and err["code"] == "invalid_api_key"
        assert set(err) == {"message", "type", "param", "code"}
    r = httpx.post(base + "/chat/completions", json={"messages": [user("x")]}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    assert "x-policy-version" in r.headers
    with openai.OpenAI(base_url=base, api_key=KEYS[1], max_retries=0) as c:
        assert [m.id for m in c.models.list().data] == [stack["model"]]


def post(stack: dict[str, str], body: bytes | dict[str, Any]) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(stack["url"] + "/v1/chat/completions", content=content, timeout=10,
                      headers={"authorization": f"Bearer {KEYS[0]}", "content-type": "application/json"})  # fmt: skip


def test_bad_inputs_get_openai_shaped_errors(stack: dict[str, str], client: openai.OpenAI) -> None:
    big = {"messages": [user("x" * 70_000)]}
    r = post(stack, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = post(stack, b'{"messages": [')
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = post(stack, {"messages": [{"role": "user"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert r.headers["x-policy-version"] == "0"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[user("x")], temperature=5)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="n=2 is not supported with stream"):
        client.chat.completions.create(model="tiny", messages=[user("x")], n=2, stream=True)


def test_ops_endpoints(stack: dict[str, str], client: openai.OpenAI) -> None:
    ask(client, [user("count me")], {"X-Turn-Type": "side"})
    assert httpx.get(stack["url"] + "/healthz", timeout=5).status_code == 200
    ready = httpx.get(stack["url"] + "/readyz", timeout=5)
    assert ready.status_code == 200 and ready.json()["checks"] == {"engine": "ok", "redis": "ok"}
    metrics = httpx.get(stack["url"] + "/metrics", timeout=5).text
    assert 'nextstate_collector_requests_total{mode="plain",status="200"}' in metrics
    assert "nextstate_collector_overhead_seconds_bucket" in metrics
    assert 'nextstate_collector_tokenize_total{mode="incremental"}' in metrics


def test_session_ids_from_the_body_and_user(client: openai.OpenAI, turns: Turns) -> None:
    sid = f"séance-{uuid.uuid4().hex[:6]}"  # not latin-1-safe as a header: kept, not echoed
    _, headers = ask(client, [user("body session")], {"X-Session-Done": "1"},
                     extra_body={"session_id": sid})  # fmt: skip
    assert "x-session-id" not in headers
    (first,) = turns.wait(lambda ts: len(ts) == 1, sessions=[sid])
    assert (first.closed_by, first.user) == ("session_done", None)
    who = f"user-{uuid.uuid4().hex[:6]}"
    _, headers = ask(client, [user("by user")], {"X-Session-Done": "1"}, user=who)
    assert headers["x-session-id"] == who
    # The client's `user` is kept on the turn (the judge's per-user experience store).
    assert turns.wait(lambda ts: len(ts) == 1, sessions=[who])[0].user == who
    _, _ = ask(client, [user("labelled")], {"X-Session-Done": "1"}, user=who, extra_body={"session_id": sid + "2"})
    assert turns.wait(lambda ts: len(ts) == 1, sessions=[sid + "2"])[0].user == who
