"""The collector when things go wrong, with real processes: the engine killed mid-stream
(a clean error event, nothing captured), the engine down (502), an engine that accepts
and never answers (504), Redis stopped (requests still succeed; the spooled turns
arrive once it is back), and pending turns nobody follows up (emitted at the TTL).

Every process of the module starts at once (they share the machine's two cores while
they load), then each test uses its own pieces.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from shared.chat import ChatTemplate
from tests.support.collector_harness import (
    StandIn,
    Turns,
    check_turn,
    collector_process,
    engine_process,
    wait_ready,
)
from tests.support.metrics import total
from tests.support.servers import RedisServer, ServiceProcess

pytestmark = pytest.mark.integration


@dataclass
class Rig:
    redis_url: str
    own_redis: RedisServer
    prefix: str
    ttl: str  # collector with a 1 s pending TTL
    outage: str  # collector on own_redis
    fragile: str  # collector whose engine the test kills
    fragile_engine: ServiceProcess
    stalled: str  # collector in front of an engine that never answers


@pytest.fixture(scope="module")
def rig(tiny_model: Path, redis_url: str) -> Iterator[Rig]:
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    own = RedisServer().start()
    stall = StandIn(stall=True).start()
    env = {"NEXTSTATE_ENV": "test", "NEXTSTATE_REDIS__URL": redis_url, "NEXTSTATE_REDIS__PREFIX": prefix}
    engine = engine_process(tiny_model)
    fragile_engine = engine_process(tiny_model)
    quick = {"redis_timeout_s": 0.2, "redis_retry_s": 0.2, "sweep_interval_s": 0.2}
    ttl = collector_process(env, engine[1], pending_ttl_s=1, **quick)
    outage = collector_process({**env, "NEXTSTATE_REDIS__URL": own.url}, engine[1], **quick)
    fragile = collector_process(env, fragile_engine[1], engine_timeout_s=10)
    stalled = collector_process(env, stall.url, engine_timeout_s=1, tokenizer=tiny_model,
                                served_model_name="tiny")  # fmt: skip
    procs = [engine, fragile_engine, ttl, outage, fragile, stalled]
    try:
        wait_ready(engine)
        wait_ready(fragile_engine, ttl, outage, fragile, stalled)
        yield Rig(redis_url, own, prefix, ttl[1], outage[1], fragile[1], fragile_engine[0], stalled[1])
    finally:
        codes = {p.name + str(i): p.stop() for i, (p, _) in enumerate(procs)}
        stall.stop()
        own.close()
    assert all(c in (0, None) for c in codes.values()), codes


@pytest.fixture(scope="module")
def tpl(tiny_model: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(tiny_model)


def sdk(url: str, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout)


def user(text: str) -> Any:
    return {"role": "user", "content": text}


def test_engine_killed_mid_stream_then_down(rig: Rig, tiny_model: Path) -> None:
    turns = Turns(rig.redis_url, rig.prefix)
    with sdk(rig.fragile) as client:
        # Greedy on the random model repeats one word and never stops: a long stream.
        with client.chat.completions.with_streaming_response.create(
            model="tiny", messages=[user("go on forever")], temperature=0, max_tokens=1800,
            stream=True,
        ) as raw:
            sid = raw.headers["x-session-id"]
            stream = raw.parse()
            got = []
            with pytest.raises(openai.APIError) as info:
                for chunk in stream:
                    got.append(chunk)
                    if len(got) == 3:
                        rig.fragile_engine.kill()
        assert len(got) >= 3 and not isinstance(info.value, openai.APIStatusError)
        assert "unavailable" in info.value.message
        # The engine is gone: a plain 502, streamed or not, in OpenAI's shape.
        with pytest.raises(openai.InternalServerError) as down:
            client.chat.completions.create(model="tiny", messages=[user("hello?")])
        assert down.value.status_code == 502
        assert isinstance(down.value.body, dict) and down.value.body["code"] == "engine_unavailable"
        assert down.value.response.headers["x-policy-version"] == "0"
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="tiny", messages=[user("hello?")], stream=True)
        # The half-finished turn is not captured (not even as pending: a follow-up closes nothing).
        r = httpx.post(rig.fragile + "/v1/chat/completions", timeout=10, headers={"X-Session-Done": "1"},
                       json={"messages": [user("go on forever"), {"role": "assistant", "content": "x"}]})  # fmt: skip
        assert r.status_code == 502
    # The collector counted every request above as answered (the broken stream's error event
    # is counted before it is sent, and a stream is captured only before its closing events)
    # and captured none: no pending turn stored, no turn emitted.
    text = httpx.get(rig.fragile + "/metrics", timeout=5).text
    assert total(text, "nextstate_collector_requests_total", mode="stream", status="502") == 2
    assert total(text, "nextstate_collector_requests_total", mode="plain", status="502") == 2
    assert total(text, "nextstate_collector_pending_total", event="stored") == 0
    assert total(text, "nextstate_collector_turns_total") == 0
    assert turns.of(sid) == []
    turns.close()


def test_engine_that_never_answers_is_a_504(rig: Rig) -> None:
    with sdk(rig.stalled, timeout=30) as client:
        for stream in (False, True):
            t0 = time.monotonic()
            with pytest.raises(openai.APIStatusError) as info:
                client.chat.completions.create(model="tiny", messages=[user("hi")], stream=stream)
            assert info.value.status_code == 504
            assert isinstance(info.value.body, dict) and info.value.body["code"] == "engine_timeout"
            assert time.monotonic() - t0 < 5


def test_unanswered_turns_expire_at_the_ttl(rig: Rig, tpl: ChatTemplate) -> None:
    turns = Turns(rig.redis_url, rig.prefix)
    with sdk(rig.ttl) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[user("anyone there?")], max_tokens=8
        )
    sid = raw.headers["x-session-id"]
    t0 = time.monotonic()
    (t,) = turns.wait(lambda ts: len(ts) == 1, sessions=[sid], timeout=10)
    assert time.monotonic() - t0 > 0.5  # not before the deadline
    assert t.closed_by == "ttl" and t.next_state is None
    check_turn(t, tpl)
    turns.close()


def test_redis_outage_requests_succeed_and_turns_arrive_later(rig: Rig, tpl: ChatTemplate) -> None:
    rig.own_redis.stop()
    sid = f"outage-{uuid.uuid4().hex[:6]}"
    hdr = {"X-Session-Id": sid}
    msgs: list[Any] = [user("redis is down")]
    with sdk(rig.outage, timeout=30) as client:
        for i in range(3):
            t0 = time.monotonic()
            last = i == 2
            headers = {**hdr, "X-Session-Done": "1"} if last else hdr
            if i == 1:
                parts = client.chat.completions.create(
                    model="tiny", messages=msgs, max_tokens=8, stream=True, extra_headers=headers
                )
                reply = {"role": "assistant", "content": "".join(
                    c.choices[0].delta.content or "" for c in parts if c.choices)}  # fmt: skip
            else:
                resp = client.chat.completions.create(
                    model="tiny", messages=msgs, max_tokens=8, extra_headers=headers
                )
                reply = resp.choices[0].message.model_dump(exclude_none=True)
            assert time.monotonic() - t0 < 5
            msgs = [*msgs, reply, user(f"still down {i}")]
    ready = httpx.get(rig.outage + "/readyz", timeout=5)
    assert ready.status_code == 503 and ready.json()["checks"]["redis"] != "ok"
    rig.own_redis.start()
    turns = Turns(rig.own_redis.url, rig.prefix)
    got = sorted(turns.wait(lambda ts: len(ts) == 3, sessions=[sid], timeout=15),
                 key=lambda t: t.turn_index)  # fmt: skip
    assert [t.closed_by for t in got] == ["next_request", "next_request", "session_done"]
    assert [t.next_state for t in got] == [[user("still down 0")], [user("still down 1")], None]
    for t in got:
        check_turn(t, tpl)
    metrics = httpx.get(rig.outage + "/metrics", timeout=5).text
    assert 'nextstate_collector_spooled_total{op="turn"} 3.0' in metrics
    assert 'nextstate_collector_flushed_total{op="turn"} 3.0' in metrics
    turns.close()
