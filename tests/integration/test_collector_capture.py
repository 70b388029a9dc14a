"""Capture against a real redis-server, in process: closing at most once across replicas,
the TTL sweeper across replicas, and the outage path (spool + in-memory pairing, replay
once Redis is back, replay after a restart)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from services.collector.capture import Capture, State
from services.collector.pairing import candidates, prefix_hashes, response_hash
from services.collector.pending_store import connect
from services.collector.settings import CollectorConfig
from services.collector.spool import Spool
from shared.chat import PromptCache
from shared.schemas import Turn
from shared.settings import Settings
from shared.streams import Bus
from tests.support.collector_harness import StandIn
from tests.support.servers import RedisServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

CACHE = PromptCache(text="<|im_start|>user\nq", ids=[5, 6, 7], cuts=[])


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def new_turn(messages: list[dict[str, Any]], reply: str, session: str = "s1", index: int = 0) -> Turn:
    return Turn(session_id=session, turn_index=index, messages=messages,
                response={"role": "assistant", "content": reply}, prompt_ids=CACHE.ids,
                response_ids=[8, 9], response_logprobs=[-0.5, -0.25], weight_version="3",
                policy_version=3)  # fmt: skip


class Replicas:
    """Capture instances sharing one Redis, as collector replicas do."""

    def __init__(self, settings: Settings, tmp: Path) -> None:
        self.settings = settings
        self.tmp = tmp
        self.made: list[Capture] = []
        self.fast: list[Any] = []

    def make(self, n: int = 0, **cfg: Any) -> Capture:
        config = CollectorConfig(**{"redis_retry_s": 0.05, "sweep_interval_s": 0.05,
                                    "redis_background_timeout_s": 2.0, **cfg})  # fmt: skip
        url = self.settings.redis.url
        bus = Bus(self.settings, client=connect(url, config.redis_background_timeout_s))
        fast = connect(url, config.redis_timeout_s)
        cap = Capture(config, bus, Spool(self.tmp / f"spool-{n}.jsonl", 1 << 20), fast)
        self.made.append(cap)
        self.fast.append(fast)
        return cap

    async def turns(self) -> list[Turn]:
        rows = await self.made[0].bus.redis.xrange(self.made[0].bus.keys.turns)
        return [Turn.from_json(f["data"]) for _, f in rows]

    async def wait_turns(self, pred: Callable[[list[Turn]], bool], timeout: float = 10) -> list[Turn]:
        deadline = time.monotonic() + timeout
        while True:
            got = await self.turns()
            if pred(got):
                return got
            assert time.monotonic() < deadline, f"timed out; have {got}"
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        for cap in self.made:
            cap.stop()
            await cap.drain(2)
            await cap.bus.aclose()
        for fast in self.fast:
            await fast.aclose()


@pytest.fixture
async def replicas(settings: Settings, tmp_path: Path) -> AsyncIterator[Replicas]:
    r = Replicas(settings, tmp_path)
    yield r
    await r.close()


def state_of(cap: Capture) -> State:
    return cap.state


def follow_up(messages: list[dict[str, Any]], turn: Turn, reply: str) -> tuple[list[dict[str, Any]], Any]:
    msgs = [*messages, turn.response, user(reply)]
    return msgs, candidates(msgs, prefix_hashes(msgs), 64)


async def test_a_pending_turn_closes_once_across_replicas(replicas: Replicas) -> None:
    a, b = replicas.make(0), replicas.make(1)
    msgs = [user("q")]
    turn = new_turn(msgs, "answer")
    await a.finish(turn, CACHE, response_hash(prefix_hashes(msgs), turn.response))
    follow, cands = follow_up(msgs, turn, "next")
    la, lb = await asyncio.gather(a.begin(follow, cands), b.begin(follow, cands))
    winner, loser = (la, lb) if la.closed else (lb, la)
    assert (winner.closed, loser.closed) == (1, 0)
    assert winner.cache == CACHE and loser.cache is None
    # Both know the session and the next turn index (the loser through the lineage).
    assert (winner.session_id, winner.turn_index) == ("s1", 1)
    assert (loser.session_id, loser.turn_index) == ("s1", 1)
    # Closing is emitting, in one script: the turn is on `turns` when begin() returns, so
    # a collector killed right after (nothing left in memory or in the background) loses it not.
    (got,) = await replicas.turns()
    assert got.id == turn.id and got.closed_by == "next_request"
    assert got.next_state == [user("next")] and got.prompt_ids == CACHE.ids
    assert got.response_logprobs == [-0.5, -0.25]
    # A third request with the same history finds nothing left to close.
    assert (await a.begin(follow, cands)).closed == 0


async def test_expired_turns_are_emitted_once_by_the_sweepers(replicas: Replicas) -> None:
    a, b = replicas.make(0, pending_ttl_s=0.3), replicas.make(1, pending_ttl_s=0.3)
    turns = []
    for i in range(5):
        msgs = [user(f"q{i}")]
        t = new_turn(msgs, f"a{i}", session=f"s{i}")
        await (a if i % 2 else b).finish(t, CACHE, response_hash(prefix_hashes(msgs), t.response))
        turns.append(t)
    runners = [asyncio.create_task(c.run()) for c in (a, b)]
    try:
        await replicas.wait_turns(lambda ts: len(ts) >= 5)
        # Both sweepers complete two more sweeps (the first may have begun before the last
        # turn came out): a turn either could emit twice would be on the stream by then.
        after = [c.sweeps for c in (a, b)]
        await eventually(lambda: all(c.sweeps >= n + 2 for c, n in zip((a, b), after, strict=True)),
                         what="two more sweeps on each replica")  # fmt: skip
        got = await replicas.turns()
    finally:
        a.stop()
        b.stop()
        await asyncio.gather(*runners)
    assert sorted(t.id for t in got) == sorted(t.id for t in turns)
    assert all(t.closed_by == "ttl" and t.next_state is None for t in got)
    assert await a.bus.redis.zcard(a.bus.keys.pending_deadlines) == 0


async def test_outage_spools_pairs_in_memory_and_replays(
    settings: Settings, tmp_path: Path
) -> None:
    server = RedisServer().start()
    own = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": server.url})})
    reps = Replicas(own, tmp_path)
    try:
        cap = reps.make(0, redis_timeout_s=0.2)
        # A turn stored before the outage: pairs once Redis is back.
        m0 = [user("before")]
        t0_ = new_turn(m0, "a0", session="s0")
        await cap.finish(t0_, CACHE, response_hash(prefix_hashes(m0), t0_.response))
        server.stop()
        t0 = time.monotonic()
        msgs = [user("q")]
        t1 = new_turn(msgs, "a1")
        await cap.finish(t1, CACHE, response_hash(prefix_hashes(msgs), t1.response))
        assert cap.state is State.DOWN
        # Its follow-up arrives during the outage: it pairs from memory.
        follow, cands = follow_up(msgs, t1, "u2")
        lk = await cap.begin(follow, cands)
        assert (lk.closed, lk.cache, lk.session_id, lk.turn_index) == (1, CACHE, "s1", 1)
        t2 = new_turn(follow, "a2", index=lk.turn_index)
        h2 = response_hash(prefix_hashes(follow), t2.response)
        await cap.finish(t2, CACHE, h2)
        follow2, _ = follow_up(follow, t2, "u3")
        t3 = new_turn(follow2, "a3", index=2)
        h3 = response_hash(prefix_hashes(follow2), t3.response)
        await cap.finish(t3, CACHE, h3)
        # The turn stored in Redis cannot be reached now: no pairing, no waiting.
        f0, c0 = follow_up(m0, t0_, "after")
        assert (await cap.begin(f0, c0)).closed == 0
        assert time.monotonic() - t0 < 1.5  # never more than the Redis timeout on a request
        def spooled() -> list[str]:
            text = cap.spool.path.read_text() if cap.spool.path.exists() else ""
            return [json.loads(line)["op"] for line in text.splitlines()]

        # the background emissions reach the spool: one turn, three pendings, one close
        await eventually(lambda: len(spooled()) >= 5, what="five spooled writes")
        ops = spooled()
        assert ops.count("turn") == 1 and ops.count("pending") == 3 and ops.count("closed") == 1
        server.start()
        runner = asyncio.create_task(cap.run())
        deadline = time.monotonic() + 10
        while state_of(cap) is not State.UP:
            assert time.monotonic() < deadline, "capture never went back to Redis"
            await asyncio.sleep(0.02)
        cap.stop()
        await runner
        # t1 was stored and closed during the outage: it arrives with its next state, and
        # its pending write is not replayed. t2 and t3 are pending in Redis now.
        (got,) = await reps.wait_turns(lambda ts: len(ts) == 1)
        assert got.id == t1.id and got.next_state == [user("u2")]
        r = cap.bus.redis
        for h, there in ((h2, 1), (h3, 1), (response_hash(prefix_hashes(msgs), t1.response), 0)):
            assert await r.exists(cap.bus.keys.pending_turn(h)) == there
        assert not cap.spool.has_data()
        # Any replica now closes what the outage left: t2 too, by a request that has
        # passed it (u3 is its next state). (t0 was in Redis only, and this redis-server
        # restarts empty: without persistence, pending turns do not survive a restart.)
        other = reps.make(1)
        follow3, cands3 = follow_up(follow2, t3, "u4")
        lk3 = await other.begin(follow3, cands3)
        assert (lk3.closed, lk3.session_id, lk3.turn_index) == (2, "s1", 3)
        got_all = await reps.wait_turns(lambda ts: len(ts) == 3)
        states = {t.id: t.next_state for t in got_all}
        assert states[t2.id] == [user("u3")] and states[t3.id] == [user("u4")]
    finally:
        await reps.close()
        server.close()


async def test_a_restarted_collector_replays_its_spool(settings: Settings, tmp_path: Path) -> None:
    server = RedisServer().start()
    own = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": server.url})})
    reps = Replicas(own, tmp_path)
    try:
        server.stop()
        first = reps.make(0)
        msgs = [user("q")]
        t1 = new_turn(msgs, "a1", session="closed-by-ttl")
        await first.finish(t1, CACHE, response_hash(prefix_hashes(msgs), t1.response))
        t2 = new_turn([user("bye")], "a2", session="done").model_copy(update={"closed_by": "session_done"})
        await first.finish(t2, CACHE, "unused")
        await first.drain(1)  # the process stops with Redis still down
        assert first.spool.has_data()
        server.start()
        again = reps.make(0, pending_ttl_s=0.2)  # same spool file, new process
        assert again.state is State.RECOVERING
        runner = asyncio.create_task(again.run())
        try:
            got = await reps.wait_turns(lambda ts: len(ts) == 1)
            assert got[0].id == t2.id and got[0].closed_by == "session_done"
            # t1's pending write was replayed with its original deadline; it expires normally.
            await first.bus.redis.zadd(first.bus.keys.pending_deadlines,
                                       {response_hash(prefix_hashes(msgs), t1.response): 0})  # fmt: skip
            got = await reps.wait_turns(lambda ts: len(ts) == 2)
        finally:
            again.stop()
            await runner
        assert {t.id: t.closed_by for t in got} == {t1.id: "ttl", t2.id: "session_done"}
    finally:
        await reps.close()
        server.close()


async def test_a_slow_redis_degrades_requests_but_is_down_only_after_repeated_timeouts(
    settings: Settings, tmp_path: Path
) -> None:
    hung = StandIn(stall=True).start()  # accepts connections, never answers: a hung Redis
    own = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": f"redis://127.0.0.1:{hung.port}/0"})})
    reps = Replicas(own, tmp_path)
    try:
        cap = reps.make(0, redis_timeout_s=0.1)
        msgs = [user("q")]
        t1 = new_turn(msgs, "a1")
        t0 = time.monotonic()
        await cap.finish(t1, CACHE, response_hash(prefix_hashes(msgs), t1.response))
        assert cap.state is State.UP  # one timeout: the write is spooled for later
        follow, cands = follow_up(msgs, t1, "u2")
        assert (await cap.begin(follow, cands)).closed == 0
        assert cap.state is State.UP
        await cap.begin(follow, cands)  # the third timeout in a row
        assert state_of(cap) is State.DOWN
        assert time.monotonic() - t0 < 1.0  # three requests, each bounded by the timeout
        assert cap.spool.has_data()
    finally:
        await reps.close()
        hung.stop()


async def test_each_capture_write_is_one_round_trip_and_carries_a_stored_response(
    settings: Settings, tmp_path: Path
) -> None:
    """Closing (lookup), storing pending and emitting at the end of a session each send one
    pipeline: no SCRIPT EXISTS before the scripts (redis-py's own pipelines ask it on every
    execute), and a stored Responses object rides along with the pending record or the
    emission. A server without the scripts (new, restarted, SCRIPT FLUSH) gets them."""
    server = RedisServer().start()
    own = settings.model_copy(update={"redis": settings.redis.model_copy(update={"url": server.url})})
    reps = Replicas(own, tmp_path)
    try:
        cap = reps.make(0)
        admin, keys = cap.bus.redis, cap.bus.keys

        async def conversation(n: int) -> None:
            """Two turns with stored responses: one closed by a follow-up, one ending the session."""
            msgs = [user(f"q{n}")]
            t1 = new_turn(msgs, "a1", session=f"s{n}")
            kept = (keys.stored_response(f"resp_{n}a"), b'{"response":{}}', 60_000)
            assert await cap.finish(t1, CACHE, response_hash(prefix_hashes(msgs), t1.response), kept)
            follow, cands = follow_up(msgs, t1, "u2")
            assert (await cap.begin(follow, cands)).closed == 1
            t2 = new_turn(follow, "a2", session=f"s{n}", index=1)
            kept2 = (keys.stored_response(f"resp_{n}b"), b'{"response":{}}', 60_000)
            done = t2.model_copy(update={"closed_by": "session_done"})
            assert await cap.finish(done, CACHE, "unused", kept2)
            got = [(t.id, t.closed_by) for t in await replicas_turns(cap)][-2:]
            assert got == [(t1.id, "next_request"), (t2.id, "session_done")]
            assert await admin.get(kept[0]) and 0 < await admin.pttl(kept2[0]) <= 60_000

        await conversation(0)  # a new server: each script is loaded on its first NOSCRIPT
        await admin.config_resetstat()
        await conversation(1)
        stats = await admin.info("commandstats")
        assert "cmdstat_script|exists" not in stats and "cmdstat_script|load" not in stats
        # Three round trips: EVALSHA (store: SET SET ZADD) SET | EVALSHA GET | EVALSHA SET
        assert stats["cmdstat_evalsha"]["calls"] == 3 and stats["cmdstat_set"]["calls"] == 4
        await admin.script_flush()
        await conversation(2)
    finally:
        await reps.close()
        server.close()


async def replicas_turns(cap: Capture) -> list[Turn]:
    rows = await cap.bus.redis.xrange(cap.bus.keys.turns)
    return [Turn.from_json(f["data"]) for _, f in rows]
