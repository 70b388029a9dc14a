"""The buffer's rules against a real Redis, through its real app (lifespan + consumer + HTTP).

The app runs in the test's own event loop (ASGI transport): the same code as
`python -m services.buffer`, started in milliseconds. Process-level behaviour (crash
and restart, archive, pull API) is in test_buffer_service.py.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from services.buffer.app import build_app
from services.buffer.ledger import FORCED, KEPT, NOT_KEPT, Ledger
from services.buffer.rules import build_sample
from services.buffer.settings import BufferSettings
from shared import keys as K
from shared.schemas import Mode, SamplingParams, ScoredTurn, TrainBatch, TrainSample, Turn
from shared.settings import Settings
from shared.streams import Bus
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

FAST_STREAMS = {"claim_idle_ms": 500, "retry_delay_ms": 50, "block_ms": 100, "shutdown_grace_s": 3.0}


# -- helpers (also used by test_buffer_service.py and test_import.py) ------------------------
def scored_turn(
    session: str, index: int, reward: int = 1, *, final: bool = False, teacher: bool = False,
    policy_version: int = 0, logprobs: bool = True, n: int = 3,
) -> ScoredTurn:
    """A scored turn as the judge publishes it (its id is the turn id). `final`: no next state."""
    ids = list(range(100 + index, 100 + index + n))
    turn = Turn(
        session_id=session, turn_index=index,
        messages=[{"role": "user", "content": "q"}], response={"role": "assistant", "content": "a"},
        prompt_ids=[1, 2, 3], response_ids=ids,
        response_logprobs=[-0.3] * n if logprobs else None,
        sampling=SamplingParams(temperature=0.8), policy_version=policy_version,
        weight_version=str(policy_version),
        next_state=None if final else [{"role": "user", "content": "thanks"}],
        closed_by="ttl" if final else "next_request",
    )
    return ScoredTurn(
        id=turn.id, turn=turn, reward=0 if final else reward, judged=not final,
        teacher_logprobs=[-0.1] * n if teacher else None,
    )


async def batches(bus: Bus) -> list[TrainBatch]:
    return [TrainBatch.from_json(f[K.FIELD]) for _, f in await bus.redis.xrange(bus.keys.batches)]


async def samples(bus: Bus) -> list[TrainSample]:
    return [s for b in await batches(bus) for s in b.samples]


async def group_done(bus: Bus, stream: str = K.SCORED, group: str = K.GROUP_BUFFER) -> bool:
    """Every entry of `stream` delivered to `group` and acknowledged."""
    try:
        groups = await bus.redis.xinfo_groups(bus.keys.stream(stream))
    except Exception:
        return False
    g = next((g for g in groups if g["name"] == group), None)
    return g is not None and int(g["pending"]) == 0 and g["lag"] == 0


async def pending(bus: Bus, stream: str = K.SCORED, group: str = K.GROUP_BUFFER) -> int:
    try:
        return int((await bus.redis.xpending(bus.keys.stream(stream), group))["pending"])
    except Exception:
        return 0


def metric(text: str, name: str, **labels: str) -> float:
    """A sample's value in a Prometheus text exposition (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = rf"^{re.escape(name)}{re.escape('{' + want + '}') if want else ''} (\S+)$"
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else 0.0


async def sweeps(client: httpx.AsyncClient, kind: str) -> float:
    """How many sweeps of `kind` (final, episode, group) the buffer completed, from /metrics."""
    return metric((await client.get("/metrics")).text, "nextstate_buffer_sweeps_total", kind=kind)


async def more_sweeps(client: httpx.AsyncClient, kind: str, n: int = 2) -> None:
    """Return once `n` more sweeps of `kind` completed: the first may have begun before the
    call, every later one looked at what Redis held then."""
    since = await sweeps(client, kind)

    async def done() -> bool:
        return await sweeps(client, kind) >= since + n

    await eventually(done, what=f"{n} more {kind} sweeps")


def buffer_settings(settings: Settings, **buffer: Any) -> BufferSettings:
    data = settings.model_dump()
    data["streams"] = {**data["streams"], **FAST_STREAMS}
    data["buffer"] = {"archive": False, **buffer}
    return BufferSettings(**data)


# -- fixtures -------------------------------------------------------------------------------
Start = Callable[..., Any]


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[Bus]:
    async with Bus(settings) as b:
        yield b


@asynccontextmanager
async def running(bs: BufferSettings) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(bs)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://buffer", timeout=10) as c:
            yield c


@pytest.fixture
async def start(settings: Settings) -> AsyncIterator[Callable[..., Awaitable[httpx.AsyncClient]]]:
    """`await start(batch_size=4, ...)`: the buffer app with these settings, stopped at the end."""
    stack: list[Any] = []

    async def go(**buffer: Any) -> httpx.AsyncClient:
        cm = running(buffer_settings(settings, **buffer))
        client = await cm.__aenter__()
        stack.append(cm)
        return client

    yield go
    for cm in reversed(stack):
        await cm.__aexit__(None, None, None)


StartApp = Callable[..., Awaitable[httpx.AsyncClient]]


# -- batching --------------------------------------------------------------------------------
async def test_batches_of_b_and_ack_only_once_published(start: StartApp, bus: Bus) -> None:
    await start(batch_size=4, max_wait_s=60)
    turns = [scored_turn(f"s{i}", 0) for i in range(7)]
    for t in turns[:3]:
        await bus.publish(K.SCORED, t)
    await eventually(lambda: pending(bus), what="3 delivered")
    await eventually(lambda: _eq(pending(bus), 3), what="3 waiting for their batch")
    assert await batches(bus) == []  # B not reached, max wait far away: nothing, nothing acked
    for t in turns[3:]:
        await bus.publish(K.SCORED, t)
    got = await eventually(lambda: _len_at_least(batches(bus), 1), what="one batch")
    assert [len(b.samples) for b in got] == [4]
    batched = {s.id for s in got[0].samples}
    assert {t.turn.id for t in turns[:3]} < batched < {t.turn.id for t in turns}  # the 3 waiting + 1
    await eventually(lambda: _eq(pending(bus), 3), what="the batched 4 acked, 3 waiting")
    assert len(await batches(bus)) == 1


async def test_partial_batch_after_max_wait(start: StartApp, bus: Bus) -> None:
    await start(batch_size=16, max_wait_s=0.5)
    loop = asyncio.get_running_loop()
    began = loop.time()
    for i in range(3):
        await bus.publish(K.SCORED, scored_turn(f"s{i}", 0))
    got = await eventually(lambda: batches(bus), what="a partial batch")
    assert 0.5 <= loop.time() - began < 5
    assert [len(b.samples) for b in got] == [3]
    await eventually(lambda: group_done(bus), what="all acked")


async def test_sample_fields(start: StartApp, bus: Bus, settings: Settings) -> None:
    await start(batch_size=1, mode="combine")
    st = scored_turn("s", 4, reward=-1, teacher=True, policy_version=2)
    await bus.publish(K.SCORED, st)
    (batch,) = await eventually(lambda: batches(bus), what="the batch")
    assert batch.run == settings.run
    (s,) = batch.samples
    assert s.id == st.turn.id and s.session_id == "s" and s.turn_index == 4
    assert s.tokens == st.turn.prompt_ids + st.turn.response_ids
    assert s.response_length == 3 and s.loss_mask == [1, 1, 1]
    assert s.reward == -1 and s.rollout_logprobs == [-0.3] * 3 and s.teacher_logprobs == [-0.1] * 3
    assert (s.policy_version, s.weight_version, s.temperature, s.mode) == (2, "2", 0.8, "combine")
    assert not s.forced


# -- inclusion -----------------------------------------------------------------------------------
CASES = {  # name: (reward, teacher)
    "pos": (1, False), "neg": (-1, False), "zero": (0, False),
    "zero_teacher": (0, True), "pos_teacher": (1, True),
}
EXPECTED = {
    "rl": {"pos", "neg", "pos_teacher"},
    "opd": {"zero_teacher", "pos_teacher"},
    "combine": {"pos", "neg", "zero_teacher", "pos_teacher"},
}


@pytest.mark.parametrize("mode", ["rl", "opd", "combine"])
async def test_inclusion_by_mode(start: StartApp, bus: Bus, mode: Mode) -> None:
    client = await start(batch_size=16, max_wait_s=0.2, mode=mode, min_samples_per_session=0)
    turns = {name: scored_turn(name, 0, r, teacher=t) for name, (r, t) in CASES.items()}
    turns["no_next_state"] = scored_turn("no_next_state", 0, final=True, teacher=True)
    for t in turns.values():
        await bus.publish(K.SCORED, t)
    await eventually(lambda: group_done(bus), what="all handled and acked")
    kept = {s.session_id for s in await samples(bus)}
    assert kept == EXPECTED[mode]
    assert all(s.mode == mode for s in await samples(bus))
    text = (await client.get("/metrics")).text
    assert metric(text, "nextstate_buffer_excluded_total", reason="no_next_state") >= 1


# -- at least one sample per session ----------------------------------------------------------
async def test_at_least_one_sample_per_session(start: StartApp, bus: Bus) -> None:
    await start(batch_size=16, max_wait_s=0.2)
    # A: nothing trainable (r = 0), then the final turn → the final turn is forced.
    # B: one positive turn, then the final turn → nothing forced.
    # C: a single turn that expired → forced.
    for t in [scored_turn("A", 0, 0), scored_turn("A", 1, final=True),
              scored_turn("B", 0, 1), scored_turn("B", 1, final=True),
              scored_turn("C", 0, final=True)]:
        await bus.publish(K.SCORED, t)
        await eventually(lambda: group_done(bus), what="handled in order")
    await eventually(lambda: _len_at_least(samples(bus), 3), what="3 samples")
    got = {(s.session_id, s.turn_index): s for s in await samples(bus)}
    assert set(got) == {("A", 1), ("B", 0), ("C", 0)}
    forced = got[("A", 1)]
    assert forced.forced and forced.reward == 0 and forced.loss_mask == [1, 1, 1]
    assert not got[("B", 0)].forced and got[("C", 0)].forced
    for session, n in (("A", 1), ("B", 1), ("C", 1)):
        assert await bus.redis.scard(bus.keys.session_samples(session)) == n
        assert 0 < await bus.redis.ttl(bus.keys.session_samples(session)) <= 24 * 3600


async def test_at_least_one_can_be_turned_off(start: StartApp, bus: Bus) -> None:
    await start(batch_size=16, max_wait_s=0.2, min_samples_per_session=0)
    await bus.publish(K.SCORED, scored_turn("C", 0, final=True))
    await bus.publish(K.SCORED, scored_turn("D", 0, 1))
    await eventually(lambda: _len_at_least(samples(bus), 1), what="D's sample")
    await eventually(lambda: group_done(bus))
    assert [s.session_id for s in await samples(bus)] == ["D"]


# -- staleness --------------------------------------------------------------------------------------
async def test_stale_samples_are_dropped_and_counted(start: StartApp, bus: Bus) -> None:
    client = await start(batch_size=16, max_wait_s=0.2, max_staleness=2)
    before = metric((await client.get("/metrics")).text, "nextstate_buffer_stale_dropped_total")
    await bus.redis.set(bus.keys.trainer_version, 5)
    for v in (1, 2, 3, 5):  # 5-1 = 4 and 5-2 = 3 are over the bound; 5-3 = 2 is not
        await bus.publish(K.SCORED, scored_turn(f"v{v}", 0, policy_version=v))
    await bus.publish(K.SCORED, scored_turn("imported", 0, policy_version=0, logprobs=False))
    await eventually(lambda: group_done(bus))
    await eventually(lambda: _len_at_least(samples(bus), 3), what="3 fresh samples")
    assert sorted(s.session_id for s in await samples(bus)) == ["imported", "v3", "v5"]
    after = metric((await client.get("/metrics")).text, "nextstate_buffer_stale_dropped_total")
    assert after - before == 2


# -- dedupe ----------------------------------------------------------------------------------------
async def test_redelivered_scored_turn_yields_one_sample(start: StartApp, bus: Bus) -> None:
    await start(batch_size=3, max_wait_s=60)
    a, b, c = (scored_turn(f"s{i}", 0) for i in range(3))
    again = a.model_copy(update={"id": "another-message-id"})  # same turn, judged twice
    await bus.publish(K.SCORED, a)
    await bus.publish(K.SCORED, a)  # same message while the first waits for its batch
    await bus.publish(K.SCORED, again)
    await bus.publish(K.SCORED, b)
    await eventually(lambda: _eq(pending(bus), 4), what="4 entries waiting for 2 samples")
    await bus.publish(K.SCORED, c)
    await eventually(lambda: group_done(bus), what="every entry acked")
    assert [sorted(s.id for s in x.samples) for x in await batches(bus)] == [
        sorted(t.turn.id for t in (a, b, c))]
    # After the batch: the same message, and the same turn under a new message id.
    await bus.publish(K.SCORED, a)
    await bus.publish(K.SCORED, a.model_copy(update={"id": "third-message-id"}))
    await eventually(lambda: group_done(bus), what="redeliveries acked")
    assert len(await batches(bus)) == 1


async def test_ledger_never_batches_a_turn_twice(bus: Bus, settings: Settings) -> None:
    """The publish script itself refuses turns already batched (replicas racing, redeliveries)."""
    ledger = Ledger(bus, buffer_settings(settings), session_ttl_s=60)
    s0, s1 = (build_sample(scored_turn(f"s{i}", 0), "rl") for i in range(2))
    first = await ledger.publish_batch([s0])
    assert first.batch is not None and not first.already_batched
    second = await ledger.publish_batch([s1, s0])
    assert second.batch is None and second.already_batched == {s0.id}
    third = await ledger.publish_batch([s1])
    assert third.batch is not None
    assert [[s.id for s in b.samples] for b in await batches(bus)] == [[s0.id], [s1.id]]


async def test_session_record_is_idempotent(bus: Bus, settings: Settings) -> None:
    ledger = Ledger(bus, buffer_settings(settings), session_ttl_s=60)
    # A forced final turn redelivered is forced again (it does not count itself) ...
    assert await ledger.record("S", "final", eligible=False, minimum=1) == FORCED
    assert await ledger.record("S", "final", eligible=False, minimum=1) == FORCED
    # ... an eligible turn recorded twice counts once ...
    assert await ledger.record("T", "t0", eligible=True, minimum=1) == KEPT
    assert await ledger.record("T", "t0", eligible=True, minimum=1) == KEPT
    assert await ledger.session_count("T") == 1
    # ... and a session that has its sample does not force another one.
    assert await ledger.record("T", "final", eligible=False, minimum=1) == NOT_KEPT
    assert await ledger.record("T", "final", eligible=False, minimum=2) == FORCED


# -- HTTP -------------------------------------------------------------------------------------------
async def test_receive_without_a_tokenizer_is_refused(start: StartApp, bus: Bus) -> None:
    client = await start()
    resp = await client.post("/receive", json={"session_id": "s", "turns": [{"prompt": "p", "response": "r"}]})
    assert resp.status_code == 503
    assert "NEXTSTATE_BUFFER__TOKENIZER" in resp.json()["error"]["message"]
    ready = await client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"] == {"redis": "ok", "consumer": "ok"}


async def _eq(got: Awaitable[Any], want: Any) -> bool:
    return bool(await got == want)


async def _len_at_least(got: Awaitable[list[Any]], n: int) -> list[Any] | None:
    items = await got
    return items if len(items) >= n else None
