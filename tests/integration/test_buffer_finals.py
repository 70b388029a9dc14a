"""The at-least-one rule after staleness, race-free per session, and exact per-rule counts.

A session's final turn often reaches the buffer before its earlier turns (it skips the
judge); the rule must wait for them instead of forcing it in. A stale final turn may
still be the session's one sample, as an anchor (A = 0). Every decision is counted
once in `keys.buffer_counts`, whatever is redelivered. Real Redis, the real app.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

import pytest

from services.buffer.batcher import Batcher
from services.buffer.finals import Finals
from services.buffer.intake import park_data
from services.buffer.ledger import Ledger
from services.buffer.settings import BufferConfig
from shared import keys as K
from shared.settings import Settings
from shared.streams import Bus
from tests.integration import test_buffer
from tests.integration.test_buffer import (
    StartApp,
    buffer_settings,
    group_done,
    more_sweeps,
    samples,
    scored_turn,
)
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

# The buffer app and a bus on this test's prefix: test_buffer.py's fixtures.
bus = test_buffer.bus
start = test_buffer.start


async def counts(bus: Bus) -> dict[str, int]:
    return {k: int(v) for k, v in (await bus.redis.hgetall(bus.keys.buffer_counts)).items()}


async def no_candidates(bus: Bus) -> bool:
    return int(await bus.redis.zcard(bus.keys.force_candidates)) == 0


async def test_final_turn_waits_for_its_earlier_turns(start: StartApp, bus: Bus) -> None:
    """The final turn arrives first; the earlier positive turn is batched; nothing is forced."""
    client = await start(batch_size=16, max_wait_s=0.2, force_settle_s=60)
    await bus.publish(K.SCORED, scored_turn("S", 2, final=True))
    await eventually(lambda: group_done(bus), what="the final turn handled (parked)")
    assert await bus.redis.zcard(bus.keys.force_candidates) == 1
    await bus.publish(K.SCORED, scored_turn("S", 0, reward=0))  # excluded: zero reward
    await eventually(lambda: group_done(bus), what="turn 0 decided")
    # Two sweeps after turn 0 was decided, index 1 is still missing: the final turn is still
    # parked where the intake put it (a claim would have moved its score), nothing forced.
    parked = await bus.redis.zrange(bus.keys.force_candidates, 0, -1, withscores=True)
    await more_sweeps(client, "final")
    assert await bus.redis.zrange(bus.keys.force_candidates, 0, -1, withscores=True) == parked
    assert await counts(bus) == {"zero_reward": 1} and await samples(bus) == []
    await bus.publish(K.SCORED, scored_turn("S", 1, reward=1))
    await eventually(lambda: no_candidates(bus), what="the final turn decided once 0 and 1 are")
    await eventually(lambda: group_done(bus))
    got = await samples(bus)
    assert [(s.turn_index, s.forced) for s in got] == [(1, False)]
    assert await counts(bus) == {"kept": 1, "zero_reward": 1, "no_next_state": 1}


async def test_final_turn_is_forced_when_the_session_has_nothing_else(start: StartApp, bus: Bus) -> None:
    await start(batch_size=16, max_wait_s=0.2, force_settle_s=60)
    await bus.publish(K.SCORED, scored_turn("S", 1, final=True))
    await bus.publish(K.SCORED, scored_turn("S", 0, reward=0))
    await eventually(lambda: no_candidates(bus), what="decided")
    got = await eventually(lambda: samples(bus), what="the forced sample")
    assert [(s.turn_index, s.forced, s.reward) for s in got] == [(1, True, 0.0)]
    assert await counts(bus) == {"forced": 1, "zero_reward": 1}


async def test_a_lost_earlier_turn_delays_the_rule_only_until_the_deadline(
    start: StartApp, bus: Bus
) -> None:
    await start(batch_size=16, max_wait_s=0.2, force_settle_s=1.0)
    began = time.monotonic()
    await bus.publish(K.SCORED, scored_turn("S", 3, final=True))  # turns 0..2 never arrive
    got = await eventually(lambda: samples(bus), timeout=10, what="forced at the deadline")
    assert time.monotonic() - began >= 1.0
    assert [(s.turn_index, s.forced) for s in got] == [(3, True)]


async def test_stale_turns_are_counted_and_a_stale_final_is_an_anchor(start: StartApp, bus: Bus) -> None:
    await start(batch_size=16, max_wait_s=0.2, max_staleness=2, force_settle_s=60)
    await bus.redis.set(bus.keys.trainer_version, 10)
    stale_final = scored_turn("S", 1, reward=1, policy_version=3, teacher=True)
    stale_final = stale_final.model_copy(
        update={"turn": stale_final.turn.model_copy(update={"closed_by": "session_done"})})
    await bus.publish(K.SCORED, scored_turn("S", 0, reward=-1, policy_version=4))  # stale, not final
    await bus.publish(K.SCORED, stale_final)
    await bus.publish(K.SCORED, scored_turn("T", 0, reward=1, policy_version=9))  # fresh
    await eventually(lambda: no_candidates(bus), what="the stale final decided")
    got = {s.session_id: s for s in await eventually(lambda: _at_least(samples(bus), 2), what="2 samples")}
    anchor = got["S"]
    assert anchor.forced and anchor.turn_index == 1
    assert anchor.reward == 0.0 and anchor.teacher_logprobs is None  # A = 0: no stale gradient
    assert not got["T"].forced and got["T"].reward == 1.0
    assert await counts(bus) == {"stale": 1, "forced": 1, "kept": 1}


async def test_redelivered_turns_are_counted_once(start: StartApp, bus: Bus) -> None:
    await start(batch_size=16, max_wait_s=0.2, force_settle_s=60)
    turns = [scored_turn("S", 0, reward=0), scored_turn("S", 1, reward=1), scored_turn("S", 2, final=True)]
    for t in turns + turns + [t.model_copy(update={"id": f"again-{i}"}) for i, t in enumerate(turns)]:
        await bus.publish(K.SCORED, t)
    # Every entry handled (decided, or the final turn parked; a kept sample's entry is acked
    # only once its batch is published), then the parked turn decided (and unparked only
    # after its batch, if any, is published): no duplicate is left to show up later.
    await eventually(lambda: group_done(bus))
    await eventually(lambda: no_candidates(bus))
    assert [s.turn_index for s in await samples(bus)] == [1]
    assert await counts(bus) == {"zero_reward": 1, "kept": 1, "no_next_state": 1}


async def test_a_claim_is_a_lease_another_buffer_takes_over(bus: Bus, settings: Settings) -> None:
    """A buffer that claimed a final turn and died: after the lease another one decides it."""
    cfg = buffer_settings(settings, batch_size=1, max_wait_s=0.1, force_lease=0.5).buffer
    ledger = Ledger(bus, buffer_settings(settings), session_ttl_s=60)
    final = scored_turn("S", 0, final=True)
    assert await ledger.park("S", final.turn.id, park_data(final, "no_next_state"), time.time())
    (turn_id, score), = await ledger.candidates(10)
    assert await ledger.claim(turn_id, score, -(time.time() + 0.5)) is not None  # the one that "dies"
    assert await ledger.claim(turn_id, score, -(time.time() + 0.5)) is None  # one claimer wins
    batcher = Batcher(ledger.publish_batch, size=1, max_wait_s=0.1)
    task = asyncio.create_task(batcher.run())
    finals = Finals(ledger, batcher, BufferConfig(**cfg.model_dump()))
    assert await finals.sweep() == 0  # still leased
    await eventually(lambda: _started(finals), timeout=5, what="taken over after the lease")
    await eventually(lambda: no_candidates(bus), what="decided")
    got = await samples(bus)
    assert [(s.id, s.forced) for s in got] == [(final.turn.id, True)]
    batcher.stop()
    await task


async def _started(finals: Finals) -> bool:
    return await finals.sweep() > 0


async def _at_least(got: Awaitable[list[Any]], n: int) -> list[Any] | None:
    items = await got
    return items if len(items) >= n else None
