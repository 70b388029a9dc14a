"""Groups (`n > 1`) in capture, against a real redis-server, in process: the n choices of
one completion stored as n pending turns; the follow-up that continues one closes it and,
in the same script, its siblings by GROUP_UNCHOSEN (keep, judge, drop); identical
choices; expiry; two replicas racing; the outage path (closing from memory).

The official client against the real collector and CPU engine is in
test_collector_groups_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.collector.capture import State
from services.collector.completion import ChatService
from services.collector.openai_shapes import ApiError
from services.collector.pairing import prefix_hashes, response_hash
from services.collector.request import ChatRequest, build_call
from shared.chat import ChatTemplate
from shared.engine_client import SGLangClient
from shared.schemas import Turn
from shared.settings import Settings
from tests.integration.test_collector_capture import CACHE, Replicas, follow_up, replicas, user
from tests.support.servers import RedisServer

pytestmark = pytest.mark.integration

__all__ = ["replicas"]  # the fixture, shared with test_collector_capture.py

MSGS = [user("pick one")]


def group(replies: list[str], gid: str = "chatcmpl-g1", session: str = "s1", index: int = 0) -> list[Turn]:
    """The n turns a completion with n = len(replies) captures (one group)."""
    return [Turn(session_id=session, turn_index=index, messages=MSGS,
                 response={"role": "assistant", "content": r}, prompt_ids=CACHE.ids,
                 response_ids=[8 + i, 9], response_logprobs=[-0.5, -0.25 * (i + 1)],
                 weight_version="3", policy_version=3, completion_id=gid, group_id=gid,
                 group_index=i, group_size=len(replies))
            for i, r in enumerate(replies)]  # fmt: skip


def keys_of(turns: list[Turn]) -> list[str]:
    return [response_hash(prefix_hashes(MSGS), t.response) for t in turns]


def by_index(turns: list[Turn]) -> dict[int, Turn]:
    return {t.group_index: t for t in turns}


@pytest.mark.parametrize("mode", ["keep", "judge", "drop"])
async def test_the_follow_up_closes_its_choice_and_the_siblings_by_the_setting(
    replicas: Replicas, mode: str
) -> None:
    cap = replicas.make(0, group_unchosen=mode)
    turns = group(["red", "green", "blue"])
    await cap.finish_group(turns, CACHE, keys_of(turns))
    r = cap.bus.redis
    assert await r.zcard(cap.bus.keys.pending_deadlines) == 3
    assert await replicas.turns() == []  # pending until a follow-up
    follow, cands = follow_up(MSGS, turns[1], "green it is, thanks")
    lk = await cap.begin(follow, cands)
    # The follow-up continues the group's session, one turn further.
    assert (lk.closed, lk.session_id, lk.turn_index, lk.cache) == (1, "s1", 1, CACHE)
    want = 1 if mode == "drop" else 3
    got = by_index(await replicas.wait_turns(lambda ts: len(ts) >= want))
    chosen = got[1]
    assert chosen.id == turns[1].id and chosen.closed_by == "next_request"
    assert chosen.next_state == [user("green it is, thanks")]
    assert (chosen.group_id, chosen.group_index, chosen.group_size) == ("chatcmpl-g1", 1, 3)
    assert chosen.prompt_ids == CACHE.ids and chosen.response_logprobs == [-0.5, -0.5]
    if mode == "drop":
        assert set(got) == {1}
    else:
        for i in (0, 2):
            t = got[i]
            assert t.id == turns[i].id and t.closed_by == "unchosen"
            assert t.next_state == (chosen.next_state if mode == "judge" else None)
            assert t.group_id == "chatcmpl-g1" and t.response_ids == turns[i].response_ids
            assert t.response_logprobs == turns[i].response_logprobs and t.prompt_ids == CACHE.ids
    # Nothing of the group is left pending, and nothing more is emitted.
    assert await r.zcard(cap.bus.keys.pending_deadlines) == 0
    for key in keys_of(turns):
        assert await r.exists(cap.bus.keys.pending_turn(key)) == 0
    # Closing emits inside the script (nothing runs in the background here, no sweeper):
    # once begin() returned, whatever it emitted is on the stream.
    assert (await cap.begin(*follow_up(MSGS, turns[0], "no, red"))).closed == 0
    assert len(await replicas.turns()) == want


async def test_identical_choices_close_with_the_chosen_one(replicas: Replicas) -> None:
    cap = replicas.make(0, group_unchosen="keep")
    turns = group(["same", "other", "same", " same "])  # 0, 2 and 3 are one message to pairing
    keys = keys_of(turns)
    assert keys[0] == keys[2] == keys[3] != keys[1]
    await cap.finish_group(turns, CACHE, keys)
    assert await cap.bus.redis.zcard(cap.bus.keys.pending_deadlines) == 4  # four records, no overwrite
    follow, cands = follow_up(MSGS, turns[0], "good")
    assert (await cap.begin(follow, cands)).closed == 1
    got = by_index(await replicas.wait_turns(lambda ts: len(ts) == 4))
    # The follow-up continues "same" whichever of the three the client kept: all three are chosen.
    for i in (0, 2, 3):
        assert (got[i].id, got[i].closed_by, got[i].next_state) == (turns[i].id, "next_request", [user("good")])
    assert got[1].closed_by == "unchosen" and got[1].next_state is None


async def test_choosing_the_twin_of_another_choice_closes_the_others_as_unchosen(replicas: Replicas) -> None:
    cap = replicas.make(0, group_unchosen="judge")
    turns = group(["a", "b", "a"])
    await cap.finish_group(turns, CACHE, keys_of(turns))
    follow, cands = follow_up(MSGS, turns[1], "b!")
    await cap.begin(follow, cands)
    got = by_index(await replicas.wait_turns(lambda ts: len(ts) == 3))
    assert got[1].closed_by == "next_request"
    assert [got[i].closed_by for i in (0, 2)] == ["unchosen", "unchosen"]
    assert all(t.next_state == [user("b!")] for t in got.values())


async def test_a_group_nobody_follows_up_expires_member_by_member(replicas: Replicas) -> None:
    cap = replicas.make(0, pending_ttl_s=0.2, group_unchosen="judge")
    turns = group(["x", "y"])
    await cap.finish_group(turns, CACHE, keys_of(turns))
    runner = asyncio.create_task(cap.run())
    try:
        got = await replicas.wait_turns(lambda ts: len(ts) == 2)
    finally:
        cap.stop()
        await runner
    assert {t.id for t in got} == {t.id for t in turns}
    assert all(t.closed_by == "ttl" and t.next_state is None for t in got)


async def test_a_group_that_ends_its_session_is_emitted_at_once(replicas: Replicas) -> None:
    cap = replicas.make(0)
    turns = [t.model_copy(update={"closed_by": "session_done"}) for t in group(["p", "q", "r"])]
    await cap.finish_group(turns, CACHE, keys_of(turns))
    got = await replicas.wait_turns(lambda ts: len(ts) == 3)
    assert sorted(t.group_index for t in got) == [0, 1, 2]
    assert all(t.closed_by == "session_done" and t.next_state is None for t in got)
    assert await cap.bus.redis.zcard(cap.bus.keys.pending_deadlines) == 0


async def test_two_replicas_continuing_different_choices_close_the_group_once(replicas: Replicas) -> None:
    a, b = replicas.make(0, group_unchosen="keep"), replicas.make(1, group_unchosen="keep")
    turns = group(["one", "two", "three"])
    await a.finish_group(turns, CACHE, keys_of(turns))
    # Two clients (or a client retrying after an edit) continue choices 0 and 2 at once.
    la, lb = await asyncio.gather(a.begin(*follow_up(MSGS, turns[0], "u0")),
                                  b.begin(*follow_up(MSGS, turns[2], "u2")))  # fmt: skip
    assert la.closed + lb.closed == 1  # whichever ran first closed the whole group
    # Both begin() calls returned, and each emits inside its script: every emission is on
    # the stream now, and nothing is left pending for a sweeper to emit again.
    got = await replicas.turns()
    assert await a.bus.redis.zcard(a.bus.keys.pending_deadlines) == 0
    assert len(got) == 3 and len({t.id for t in got}) == 3
    assert sorted(t.closed_by for t in got) == ["next_request", "unchosen", "unchosen"]


async def test_in_an_outage_the_group_closes_from_memory(settings: Settings, tmp_path: Path) -> None:
    server = RedisServer().start()
    own = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": server.url})})
    reps = Replicas(own, tmp_path)
    try:
        cap = reps.make(0, redis_timeout_s=0.2, group_unchosen="judge")
        server.stop()
        turns = group(["k", "l", "m"])
        await cap.finish_group(turns, CACHE, keys_of(turns))
        assert cap.state is State.DOWN
        follow, cands = follow_up(MSGS, turns[2], "m, please")
        assert (await cap.begin(follow, cands)).closed == 1
        assert not cap._local  # the siblings were closed with it, not left to expire
        server.start()
        runner = asyncio.create_task(cap.run())
        try:
            got = by_index(await reps.wait_turns(lambda ts: len(ts) == 3))
        finally:
            cap.stop()
            await runner
        assert got[2].closed_by == "next_request"
        assert [got[i].closed_by for i in (0, 1)] == ["unchosen", "unchosen"]
        assert all(t.next_state == [user("m, please")] for t in got.values())
        # Their pending writes were not replayed: nothing is left to expire again.
        assert await cap.bus.redis.zcard(cap.bus.keys.pending_deadlines) == 0
    finally:
        await reps.close()
        server.close()


# -- the service: n engine requests, one failure fails them all --------------------------------------


class Engine:
    """An SGLang /generate stand-in (httpx.MockTransport): answers each seed with its own
    reply, fails `fail_seed` with a 500, and holds the others until they are cancelled."""

    def __init__(self, fail_seed: int | None = None) -> None:
        self.fail_seed = fail_seed
        self.seeds: list[int] = []
        self.cancelled = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seed = int(body["sampling_params"]["sampling_seed"])
        self.seeds.append(seed)
        if self.fail_seed is not None:
            if seed == self.fail_seed:
                await asyncio.sleep(0.05)
                return httpx.Response(500, json={"error": {"message": "out of memory"}})
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        ids = [40 + seed % 7, 41]
        return httpx.Response(200, json={"text": f"answer {seed}", "output_ids": ids, "meta_info": {
            "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, i, None] for i in ids],
            "prompt_tokens": 3, "completion_tokens": 2, "weight_version": "4"}})


def service(cap: Any, engine: Engine, tiny_model: Path) -> ChatService:
    client = SGLangClient("http://engine", transport=httpx.MockTransport(engine))
    return ChatService(cap.cfg, client, ChatTemplate.from_pretrained(tiny_model), cap, "tiny", "4")


async def test_the_service_asks_the_engine_n_times_with_seed_plus_i(replicas: Replicas, tiny_model: Path) -> None:
    cap = replicas.make(0)
    engine = Engine()
    svc = service(cap, engine, tiny_model)
    body, headers = await svc.complete(build_call(
        ChatRequest(messages=MSGS, n=3, seed=11, max_tokens=2), {"x-session-id": "sv"}, cap.cfg))
    out = json.loads(body)
    assert sorted(engine.seeds) == [11, 12, 13]
    assert [c["message"]["content"] for c in out["choices"]] == ["answer 11", "answer 12", "answer 13"]
    assert out["usage"] == {"prompt_tokens": len(svc.template.encode(MSGS, None)), "completion_tokens": 6,
                            "total_tokens": len(svc.template.encode(MSGS, None)) + 6}
    assert headers["x-policy-version"] == "4"
    assert await cap.bus.redis.zcard(cap.bus.keys.pending_deadlines) == 3
    await svc.engine.aclose()


async def test_one_failed_choice_fails_the_request_and_captures_nothing(
    replicas: Replicas, tiny_model: Path
) -> None:
    cap = replicas.make(0)
    engine = Engine(fail_seed=12)
    svc = service(cap, engine, tiny_model)
    call = build_call(ChatRequest(messages=MSGS, n=3, seed=11, max_tokens=2), {}, cap.cfg)
    began = time.monotonic()
    with pytest.raises(ApiError) as info:
        await svc.complete(call)
    assert info.value.status == 502 and info.value.code == "engine_unavailable"
    assert time.monotonic() - began < 5  # not waiting for the two others: they were cancelled
    assert engine.cancelled == 2
    assert await cap.bus.redis.zcard(cap.bus.keys.pending_deadlines) == 0
    assert await replicas.turns() == []
    await svc.engine.aclose()
