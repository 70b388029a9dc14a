"""The stream bus against a real redis-server: delivery, reclaim, dedupe, dead letters, bounds."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

from shared.consumer import Consumer, Delivery
from shared.schemas import DeadLetter
from shared.settings import Settings
from shared.streams import Bus
from tests.support.bus_worker import Ping
from tests.support.servers import REPO
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration


def fast(settings: Settings, **streams: Any) -> Settings:
    cfg = {"claim_idle_ms": 300, "retry_delay_ms": 30, "block_ms": 100, "max_deliveries": 3,
           "shutdown_grace_s": 2.0, **streams}
    return settings.model_copy(update={"streams": settings.streams.model_copy(update=cfg)})


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[Bus]:
    async with Bus(fast(settings)) as b:
        yield b


async def pending(bus: Bus, stream: str = "turns", group: str = "judge") -> int:
    return int((await bus.redis.xpending(bus.keys.stream(stream), group))["pending"])


async def dead_letters(bus: Bus) -> list[DeadLetter]:
    rows = await bus.redis.xrange(bus.keys.dead)
    return [DeadLetter.from_json(f["data"]) for _, f in rows]


async def test_publish_consume_ack(bus: Bus) -> None:
    seen: list[int] = []

    async def handle(msg: Ping, d: Delivery) -> None:
        assert d.deliveries == 1
        seen.append(msg.n)

    c = Consumer(bus, "turns", "judge", Ping, handle, name="c1", concurrency=4)
    task = asyncio.create_task(c.run())
    for n in range(50):
        assert await bus.publish("turns", Ping(n=n)) is not None
    await eventually(lambda: len(seen) == 50, what="50 handled")
    await eventually(lambda: _zero(bus), what="all acked")
    c.stop()
    await asyncio.wait_for(task, 5)
    assert sorted(seen) == list(range(50))
    assert await pending(bus) == 0


async def _zero(bus: Bus, stream: str = "turns") -> bool:
    """Every entry delivered to the group and acknowledged."""
    (group,) = await bus.redis.xinfo_groups(bus.keys.stream(stream))
    return int(group["pending"]) == 0 and group["lag"] == 0


async def test_duplicate_message_id_handled_once(bus: Bus) -> None:
    calls: list[str] = []

    async def handle(msg: Ping, d: Delivery) -> None:
        calls.append(msg.id)

    c = Consumer(bus, "turns", "judge", Ping, handle, name="c1")
    task = asyncio.create_task(c.run())
    msg = Ping(n=1)
    await bus.publish("turns", msg)
    await eventually(lambda: len(calls) == 1)
    await eventually(lambda: _zero(bus), what="first acked")
    await bus.publish("turns", msg)  # a producer retry: same message id
    await bus.publish("turns", Ping(n=2))
    await eventually(lambda: len(calls) == 2)
    await eventually(lambda: _zero(bus), what="all acked")
    c.stop()
    await task
    assert calls.count(msg.id) == 1


async def test_killed_consumer_entry_reclaimed_and_handled_once(bus: Bus, settings: Settings) -> None:
    prefix = settings.redis.prefix
    worker = subprocess.Popen(
        [sys.executable, "-m", "tests.support.bus_worker", "--url", settings.redis.url,
         "--prefix", prefix, "--name", "doomed", "--mode", "hang", "--claim-idle-ms", "300"],
        cwd=REPO,
    )
    try:
        await bus.ensure_group("turns", "judge")
        msg = Ping(n=7)
        await bus.publish("turns", msg)
        await eventually(lambda: bus.redis.exists(f"{prefix}:started:{msg.id}"), 20, "worker started")
        worker.send_signal(signal.SIGKILL)
        worker.wait(5)
    finally:
        if worker.poll() is None:
            worker.kill()
    handled: list[Delivery] = []

    async def handle(m: Ping, d: Delivery) -> None:
        await bus.redis.incr(f"{prefix}:count:{m.id}")
        handled.append(d)

    c = Consumer(bus, "turns", "judge", Ping, handle, name="rescuer")
    task = asyncio.create_task(c.run())
    await eventually(lambda: len(handled) == 1, what="reclaimed")
    await eventually(lambda: _zero(bus), what="acked")
    # Three more janitor passes, each of which would have claimed the entry again had the
    # ack not held: nothing is handled twice.
    passes = c.janitor_passes
    await eventually(lambda: c.janitor_passes >= passes + 3, what="three janitor passes after the ack")
    c.stop()
    await task
    assert await bus.redis.get(f"{prefix}:count:{msg.id}") == "1"
    assert handled[0].deliveries == 2


async def test_many_consumers_share_work_exactly_once(bus: Bus, settings: Settings) -> None:
    prefix = settings.redis.prefix
    await bus.ensure_group("turns", "judge")
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.bus_worker", "--url", settings.redis.url,
             "--prefix", prefix, "--name", f"w{i}", "--mode", "incr", "--work-s", "0.01"],
            cwd=REPO,
        )
        for i in range(3)
    ]
    try:
        async def all_reading() -> bool:
            return int(await bus.redis.exists(*[f"{prefix}:ready:w{i}" for i in range(3)])) == 3

        await eventually(all_reading, 30, "three consumers reading")
        msgs = [Ping(n=i) for i in range(60)]
        for m in msgs:
            await bus.publish("turns", m)
        await eventually(lambda: _zero(bus), 30, "all acked")
        counts = await bus.redis.mget([f"{prefix}:count:{m.id}" for m in msgs])
        assert counts == ["1"] * 60
    finally:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        codes = []
        for w in workers:
            try:
                codes.append(w.wait(10))
            except subprocess.TimeoutExpired:
                w.kill()  # never leave a worker behind, even when the test fails
                codes.append(w.wait(5))
    assert codes == [0, 0, 0], "workers did not stop gracefully on SIGTERM"


async def test_poison_message_dead_lettered_with_error(bus: Bus) -> None:
    attempts: list[int] = []

    async def handle(msg: Ping, d: Delivery) -> None:
        attempts.append(d.deliveries)
        raise ValueError("cannot judge this")

    c = Consumer(bus, "turns", "judge", Ping, handle, name="c1")
    task = asyncio.create_task(c.run())
    msg = Ping(n=1)
    await bus.publish("turns", msg)
    await eventually(lambda: bus.redis.xlen(bus.keys.dead), what="dead letter")
    c.stop()
    await task
    (letter,) = await dead_letters(bus)
    assert attempts == [1, 2, 3]
    assert letter.deliveries == 3 and letter.group == "judge" and letter.stream == "turns"
    assert "ValueError: cannot judge this" in letter.error
    assert Ping.from_json(letter.data) == msg
    assert await pending(bus) == 0


async def test_malformed_entry_dead_lettered_at_once(bus: Bus) -> None:
    calls: list[Ping] = []

    async def handle(msg: Ping, d: Delivery) -> None:
        calls.append(msg)

    c = Consumer(bus, "turns", "judge", Ping, handle, name="c1")
    task = asyncio.create_task(c.run())
    await bus.publish_raw("turns", '{"type": "ping", "n": "not a number"}')
    await eventually(lambda: bus.redis.xlen(bus.keys.dead), what="dead letter")
    c.stop()
    await task
    (letter,) = await dead_letters(bus)
    assert letter.deliveries == 1 and "n:" in letter.error and calls == []


async def test_silent_consumer_past_max_deliveries_dead_lettered(bus: Bus) -> None:
    await bus.ensure_group("turns", "judge")
    await bus.publish("turns", Ping(n=3))
    key = bus.keys.stream("turns")
    # Three consumers that read it and died (never acked): delivered three times.
    entry = (await bus.redis.xreadgroup("judge", "ghost", {key: ">"}, count=1))[0][1][0][0]
    for _ in range(2):
        await bus.redis.xclaim(key, "judge", "ghost", 0, [entry])

    async def idle_past_claim() -> bool:
        (row,) = await bus.redis.xpending_range(key, "judge", "-", "+", 1)
        return int(row["time_since_delivered"]) > 300  # claim_idle_ms

    await eventually(idle_past_claim, what="the entry idle past claim_idle_ms")

    async def handle(msg: Ping, d: Delivery) -> None:
        raise AssertionError("must not be handled a fourth time")

    c = Consumer(bus, "turns", "judge", Ping, handle, name="c1")
    task = asyncio.create_task(c.run())
    await eventually(lambda: bus.redis.xlen(bus.keys.dead), what="dead letter")
    c.stop()
    await task
    (letter,) = await dead_letters(bus)
    assert letter.deliveries == 3 and "went silent" in letter.error


async def test_bounded_stream_sheds_and_counts(bus: Bus) -> None:
    ids = [await bus.publish("turns", Ping(n=i), maxlen=5) for i in range(8)]
    assert sum(i is not None for i in ids) == 5 and ids[5:] == [None, None, None]
    assert await bus.redis.xlen(bus.keys.turns) == 5
    info = await bus.stream_info("turns")
    assert info["shed"] == 3


async def test_restarted_consumer_handles_own_pending_first(bus: Bus) -> None:
    await bus.ensure_group("turns", "judge")
    old = [Ping(n=i) for i in range(3)]
    for m in old:
        await bus.publish("turns", m)
    await bus.redis.xreadgroup("judge", "stable-name", {bus.keys.turns: ">"}, count=3)  # then "crashed"
    new = Ping(n=99)
    await bus.publish("turns", new)
    order: list[int] = []

    async def handle(msg: Ping, d: Delivery) -> None:
        order.append(msg.n)

    c = Consumer(bus, "turns", "judge", Ping, handle, name="stable-name", concurrency=1)
    task = asyncio.create_task(c.run())
    await eventually(lambda: len(order) == 4)
    c.stop()
    await task
    assert order == [0, 1, 2, 99]


async def test_graceful_stop_finishes_in_flight_work(bus: Bus) -> None:
    started = asyncio.Event()
    finished: list[int] = []

    async def handle(msg: Ping, d: Delivery) -> None:
        started.set()
        await asyncio.sleep(0.3)
        finished.append(msg.n)

    c = Consumer(bus, "turns", "judge", Ping, handle, name="c1")
    task = asyncio.create_task(c.run())
    await bus.publish("turns", Ping(n=1))
    await asyncio.wait_for(started.wait(), 5)
    c.stop()
    await asyncio.wait_for(task, 5)
    assert finished == [1]
    assert await pending(bus) == 0


async def test_stop_hands_back_work_that_outlives_the_grace(settings: Settings) -> None:
    slow_settings = fast(settings, shutdown_grace_s=0.1, claim_idle_ms=60_000)
    async with Bus(slow_settings) as bus:
        started = asyncio.Event()

        async def slow(msg: Ping, d: Delivery) -> None:
            started.set()
            await asyncio.sleep(30)

        c = Consumer(bus, "turns", "judge", Ping, slow, name="leaving")
        task = asyncio.create_task(c.run())
        await bus.publish("turns", Ping(n=5))
        await asyncio.wait_for(started.wait(), 5)
        c.stop()
        await asyncio.wait_for(task, 5)
        assert await pending(bus) == 1
        got: list[int] = []

        async def handle(msg: Ping, d: Delivery) -> None:
            got.append(msg.n)

        # claim_idle is a minute, yet the handed-back entry is taken at once.
        other = Consumer(bus, "turns", "judge", Ping, handle, name="staying")
        t2 = asyncio.create_task(other.run())
        await eventually(lambda: got == [5], 5, "handed-back entry handled")
        other.stop()
        await t2


async def test_trim_keeps_unconsumed_and_newest(bus: Bus) -> None:
    await bus.ensure_group("turns", "judge")
    for i in range(20):
        await bus.publish("turns", Ping(n=i))
    key = bus.keys.turns
    read = await bus.redis.xreadgroup("judge", "c", {key: ">"}, count=15)
    ids = [eid for eid, _ in read[0][1]]
    await bus.redis.xack(key, "judge", *ids[:10])  # 10 acked, 5 pending, 5 unread
    assert await bus.trim_consumed("turns", retain=3, slack=20) == 0  # not worth a pass yet
    removed = await bus.trim_consumed("turns", retain=3, slack=0)
    assert removed == 10
    assert await bus.redis.xlen(key) == 10
    assert await bus.trim_consumed("turns", retain=5, slack=0) == 0
