"""`python -m services.buffer` as a process: crash and restart, graceful stop, archive, /get_data."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from services.buffer.archive import decode
from services.ctl.infra import free_port
from shared import keys as K
from shared.checkpoints import samples_prefix
from shared.schemas import Outcome, TrainBatch, TrainSample
from shared.settings import Settings
from shared.store import Bucket
from shared.streams import Bus
from tests.integration.test_buffer import (
    FAST_STREAMS,
    batches,
    eventually,
    group_done,
    metric,
    pending,
    samples,
    scored_turn,
)
from tests.integration.test_ctl import run as run_ctl
from tests.support.servers import ServiceProcess

pytestmark = pytest.mark.integration


def process_env(env: dict[str, str], **buffer: Any) -> tuple[dict[str, str], str]:
    port = free_port()
    out = dict(env)
    out.update({f"NEXTSTATE_STREAMS__{k.upper()}": str(v) for k, v in FAST_STREAMS.items()})
    out.update({"NEXTSTATE_BUFFER__PORT": str(port), "NEXTSTATE_BUFFER__ARCHIVE": "false"})
    out.update({f"NEXTSTATE_BUFFER__{k.upper()}": str(v).lower() if isinstance(v, bool) else str(v)
                for k, v in buffer.items()})
    return out, f"http://127.0.0.1:{port}"


@pytest.fixture
def procs() -> Iterator[list[ServiceProcess]]:
    started: list[ServiceProcess] = []
    yield started
    for p in started:
        p.stop()


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[Bus]:
    async with Bus(settings) as b:
        yield b


def start(procs: list[ServiceProcess], env: dict[str, str], url: str, ready: bool = True) -> ServiceProcess:
    p = ServiceProcess("buffer", env).start()
    procs.append(p)
    return p.wait_http(f"{url}/readyz" if ready else f"{url}/healthz", timeout=30)


@pytest.mark.parametrize("consumer_name", ["buffer-stable", None], ids=["same-name", "new-name"])
async def test_killed_mid_batch_and_restarted_every_sample_once(
    env: dict[str, str], bus: Bus, procs: list[ServiceProcess], consumer_name: str | None,
) -> None:
    extra = {"consumer_name": consumer_name} if consumer_name else {}
    penv, url = process_env(env, batch_size=8, max_wait_s=60, **extra)
    first = start(procs, penv, url)
    turns = [scored_turn(f"s{i}", 0) for i in range(8)]
    for t in turns[:5]:
        await bus.publish(K.SCORED, t)
    await eventually(lambda: _is(pending(bus), 5), what="5 samples waiting in the open batch")
    first.kill()  # SIGKILL mid-batch: nothing published, nothing acked
    assert await batches(bus) == []
    await bus.publish(K.SCORED, turns[0])  # a redelivered copy on top
    for t in turns[5:]:
        await bus.publish(K.SCORED, t)
    start(procs, penv, url)
    await eventually(lambda: group_done(bus), timeout=20, what="every entry handled and acked")
    got = await batches(bus)
    ids = [s.id for b in got for s in b.samples]
    assert sorted(ids) == sorted(t.turn.id for t in turns)  # each sample in exactly one batch
    assert [len(b.samples) for b in got] == [8]


async def test_killed_while_holding_episode_turns_the_batch_comes_out_once(
    env: dict[str, str], bus: Bus, procs: list[ServiceProcess],
) -> None:
    """Held turns live in Redis: a buffer SIGKILLed while they wait for their Outcome
    loses none, and after the restart the episode is batched once."""
    penv, url = process_env(env, batch_size=8, max_wait_s=0.3, consumer_name="buffer-stable")
    first = start(procs, penv, url)
    turns = [scored_turn("env:k", 0, reward=1), scored_turn("env:k", 1, reward=-1),
             scored_turn("env:k", 2, final=True)]
    for t in turns:
        await bus.publish(K.SCORED, t)
    await eventually(lambda: group_done(bus), what="the turns held and acked")
    assert await bus.redis.hlen(bus.keys.episode_turns("env:k")) == 3
    first.kill()
    outcome = Outcome(id="episode.k", run="r", env="echo", task_id="t", session_id="env:k",
                      group="g", reward=0.5)
    await bus.publish(K.OUTCOMES, outcome)
    await bus.publish(K.SCORED, turns[1])  # a redelivered copy on top
    start(procs, penv, url)
    got = await eventually(lambda: _len(samples(bus), 2), timeout=20, what="the episode batched")
    await eventually(lambda: group_done(bus), what="the copy handled")
    await eventually(lambda: group_done(bus, K.OUTCOMES, K.GROUP_OUTCOMES), what="the outcome handled")
    # Every entry handled, and the session released (only once its decided turns' batch was
    # published): nothing is held that could make a second batch.
    await eventually(lambda: _is(bus.redis.zcard(bus.keys.episode_sessions), 0), what="the session released")
    got = await samples(bus)
    assert sorted((s.turn_index, s.reward) for s in got) == [(0, 0.5), (1, 0.5)]  # not the closing turn
    assert len(await batches(bus)) == 1
    assert await bus.redis.zcard(bus.keys.episode_sessions) == 0


async def test_sigterm_publishes_the_open_batch_then_exits(
    env: dict[str, str], bus: Bus, procs: list[ServiceProcess],
) -> None:
    penv, url = process_env(env, batch_size=16, max_wait_s=60)
    p = start(procs, penv, url)
    for i in range(3):
        await bus.publish(K.SCORED, scored_turn(f"s{i}", 0))
    await eventually(lambda: _is(pending(bus), 3), what="3 waiting")
    assert p.proc is not None
    p.proc.send_signal(signal.SIGTERM)
    rc = await asyncio.to_thread(p.proc.wait, 20)
    assert rc == 0, p.logs()
    assert [len(b.samples) for b in await batches(bus)] == [3]
    assert await group_done(bus)


async def test_archive_holds_every_published_sample(
    s3_env: dict[str, str], s3_settings: Settings, bus: Bus, procs: list[ServiceProcess],
) -> None:
    penv, url = process_env(s3_env, batch_size=2, max_wait_s=60, archive=True,
                            archive_roll_samples=4, archive_roll_s=1.0)
    start(procs, penv, url)
    for i in range(6):
        await bus.publish(K.SCORED, scored_turn(f"s{i}", 0, reward=1 if i % 2 else -1))
    await eventually(lambda: group_done(bus), what="6 samples batched")
    published = await samples(bus)
    assert len(published) == 6
    prefix = samples_prefix(s3_settings.run)
    with Bucket(s3_settings.bucket) as bucket:

        def archived() -> list[TrainSample] | None:
            keys = [o.key for o in bucket.list(prefix)]
            out = [s for k in keys for s in decode(bucket.get_bytes(k))]
            return out if len(out) >= 6 else None

        got = await eventually(lambda: asyncio.to_thread(archived), timeout=20, what="archive objects")
        keys = [o.key for o in bucket.list(prefix)]
    assert sorted(got, key=lambda s: s.id) == sorted(published, key=lambda s: s.id)
    assert len(keys) == 2  # a roll of 4 (by count), then one of 2 (by age)
    assert all(k.startswith(prefix) and k.endswith(".jsonl.gz") for k in keys)
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(f"{url}/metrics")).text
    assert metric(text, "nextstate_buffer_archived_samples_total") == 6
    assert metric(text, "nextstate_buffer_archive_uploads_total") == 2

    async def reported() -> dict[str, Any] | None:  # what it holds now: nothing; the last object
        states = [json.loads(v) for v in (await bus.redis.hgetall(bus.keys.archive_state)).values()]
        return states[0] if states and states[0]["held_since"] is None and states[0]["last_key"] else None

    state = await eventually(reported, what="the archive's state after its uploads")
    assert state["last_key"] in keys and state["uploaded_at"] > 0 and state["roll_s"] == 1.0


async def test_a_killed_buffer_loses_nothing_from_the_archive(
    s3_env: dict[str, str], s3_settings: Settings, bus: Bus, procs: list[ServiceProcess],
) -> None:
    """The open roll dies with the process; its batches stay pending in the `archive`
    group and the restarted buffer (same name) archives them."""
    penv, url = process_env(s3_env, batch_size=2, max_wait_s=60, archive=True,
                            archive_roll_samples=1000, archive_roll_s=3600, consumer_name="buffer")
    first = start(procs, penv, url)
    for i in range(6):
        await bus.publish(K.SCORED, scored_turn(f"s{i}", 0))
    await eventually(lambda: group_done(bus), what="6 samples batched")
    await eventually(lambda: _is(pending(bus, K.BATCHES, K.GROUP_ARCHIVE), 3),
                     what="3 batches held by the open roll")
    first.kill()
    prefix = samples_prefix(s3_settings.run)
    with Bucket(s3_settings.bucket) as bucket:
        assert list(bucket.list(prefix)) == []  # the roll never reached the bucket
        penv["NEXTSTATE_BUFFER__ARCHIVE_ROLL_S"] = "0.5"
        start(procs, penv, url)
        await eventually(lambda: group_done(bus, K.BATCHES, K.GROUP_ARCHIVE), timeout=20,
                         what="the archive group caught up")
        got = [s for o in bucket.list(prefix) for s in decode(bucket.get_bytes(o.key))]
    assert sorted(s.id for s in got) == sorted(s.id for s in await samples(bus))


async def test_unreachable_bucket_never_blocks_batching(
    env: dict[str, str], bus: Bus, procs: list[ServiceProcess],
) -> None:
    penv, url = process_env(env, batch_size=2, max_wait_s=60, archive=True,
                            archive_roll_samples=2, archive_retry_max_s=0.5)
    penv.update({"NEXTSTATE_BUCKET__ENDPOINT": f"127.0.0.1:{free_port()}", "NEXTSTATE_BUCKET__TIMEOUT": "1"})
    start(procs, penv, url, ready=False)
    async with httpx.AsyncClient(timeout=10) as client:
        ready = await client.get(f"{url}/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["bucket"] != "ok"
    for i in range(4):
        await bus.publish(K.SCORED, scored_turn(f"s{i}", 0))
    await eventually(lambda: group_done(bus), what="batched without the bucket")
    assert [len(b.samples) for b in await batches(bus)] == [2, 2]

    def failures() -> float:
        return metric(httpx.get(f"{url}/metrics", timeout=5).text,
                      "nextstate_buffer_archive_upload_failures_total")

    assert await eventually(lambda: asyncio.to_thread(failures), timeout=20, what="failed uploads counted") >= 1


async def test_get_data_returns_and_acknowledges_batches(
    env: dict[str, str], bus: Bus, procs: list[ServiceProcess],
) -> None:
    penv, url = process_env(env, batch_size=2, max_wait_s=60)
    start(procs, penv, url)
    async with httpx.AsyncClient(base_url=url, timeout=15) as client:
        empty = (await client.get("/get_data", params={"n": 3})).json()
        assert empty == {"count": 0, "batches": []}
        for i in range(4):
            await bus.publish(K.SCORED, scored_turn(f"s{i}", 0))
        await eventually(lambda: _len(batches(bus), 2), what="2 batches")
        in_stream = await batches(bus)
        body = (await client.get("/get_data", params={"n": 5})).json()
        assert body["count"] == 2
        assert [TrainBatch.model_validate(b) for b in body["batches"]] == in_stream
        # Acknowledged in the trainer group, with the group's done marks: the built-in
        # trainer would neither receive them nor train them twice.
        assert await group_done(bus, K.BATCHES, K.GROUP_TRAINER)
        for b in in_stream:
            assert await bus.redis.exists(bus.keys.done(K.GROUP_TRAINER, b.id))
        assert (await client.get("/get_data")).json()["count"] == 0
        # A long poll returns as soon as a batch is there.
        loop = asyncio.get_running_loop()
        began = loop.time()
        waiting = asyncio.create_task(client.get("/get_data", params={"n": 1, "wait": 10}))
        for i in range(4, 6):
            await bus.publish(K.SCORED, scored_turn(f"s{i}", 0))
        late = (await waiting).json()
        assert late["count"] == 1 and loop.time() - began < 8
        bad = await client.get("/get_data", params={"n": 0})
        assert bad.status_code == 400
        assert bad.json()["error"]["message"] == "query.n: Input should be greater than or equal to 1"


async def _is(got: Any, want: Any) -> bool:
    return bool(await got == want)


async def _len(got: Any, n: int) -> Any:
    items = await got
    return items if len(items) >= n else None


async def test_status_shows_the_archive_holding_its_roll_not_stalled(
    s3_env: dict[str, str], bus: Bus, procs: list[ServiceProcess],
) -> None:
    """The archive acknowledges a batch only once the object holding it is uploaded, so it
    holds its open roll's batches (for up to roll_s) with no acks: `nextstate status`
    used to flag that STALLED. The archiver says what it holds; status shows it holding,
    with when the roll uploads."""
    penv, url = process_env(s3_env, batch_size=2, max_wait_s=60, archive=True,
                            archive_roll_samples=1000, archive_roll_s=120)  # fmt: skip
    start(procs, penv, url)
    for i in range(2):
        await bus.publish(K.SCORED, scored_turn(f"s{i}", 0, reward=1 if i else -1))

    async def held() -> dict[str, Any] | None:
        groups = {g["name"]: g for g in await bus.redis.xinfo_groups(bus.keys.batches)}
        states = await bus.redis.hgetall(bus.keys.archive_state)
        state = json.loads(next(iter(states.values()))) if states else {}
        archive = groups.get(K.GROUP_ARCHIVE)
        return state if archive and int(archive["pending"]) == 1 and state.get("held_since") else None

    state = await eventually(held, what="the archive holding the batch")
    assert (state["roll_s"], state["uploaded_at"]) == (120.0, None) and state["grace_s"] >= 60
    out = await asyncio.to_thread(run_ctl, penv, "status", "--json", "--window", "1")
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    stream = next(s for s in snap["streams"] if s["stream"] == K.BATCHES)
    archive = next(g for g in stream["groups"] if g["name"] == K.GROUP_ARCHIVE)
    assert archive["pending"] == 1 and archive["acked_in_window"] == 0
    assert archive["stalled"] is False and f"{K.BATCHES}/{K.GROUP_ARCHIVE}" not in snap["stalled"]
    assert 0 < archive["archive_hold"]["upload_in_s"] <= 120
    text = await asyncio.to_thread(run_ctl, penv, "status", "--window", "1")
    assert "holding the archive roll (uploads in " in text.stdout and "STALLED" not in text.stdout
