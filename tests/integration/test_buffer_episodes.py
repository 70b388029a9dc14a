"""Environment episodes' turns joined with their Outcome: real Redis, the real buffer app.

Turns first or the Outcome first; each reward and advantage mode; a failed episode, a
missing outcome, partial and too-small groups; staleness; every decision counted once.
A buffer killed while it holds turns is in test_buffer_service.py.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any

import pytest

from services.buffer.episode_store import HELD, EpisodeStore
from shared import keys as K
from shared.schemas import Outcome, ScoredTurn
from shared.streams import Bus
from tests.integration import test_buffer
from tests.integration.test_buffer import StartApp, group_done, more_sweeps, samples, scored_turn
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

bus = test_buffer.bus
start = test_buffer.start


def outcome(session: str, reward: float, *, group: str = "g", index: int = 0, size: int = 1,
            error: str | None = None) -> Outcome:
    return Outcome(id=f"episode.{session}", run="r", env="echo", task_id="t", session_id=session,
                   group=group, group_index=index, group_size=size, reward=reward,
                   passed=reward > 0, error=error)


def episode(session: str, *scores: int) -> list[ScoredTurn]:
    """An episode's turns judged `scores`, then its closing request (the env worker's
    `X-Session-Done`: no next state, never trained)."""
    turns = [scored_turn(session, i, reward=s) for i, s in enumerate(scores)]
    return [*turns, scored_turn(session, len(scores), final=True)]


async def counts(bus: Bus) -> dict[str, int]:
    return {k: int(v) for k, v in (await bus.redis.hgetall(bus.keys.buffer_counts)).items()}


async def nothing_held(bus: Bus) -> bool:
    return int(await bus.redis.zcard(bus.keys.episode_sessions)) == 0


async def publish(bus: Bus, *msgs: Any) -> None:
    for m in msgs:
        await bus.publish(K.OUTCOMES if isinstance(m, Outcome) else K.SCORED, m)


def rewards(got: list[Any]) -> dict[tuple[str, int], float]:
    return {(s.session_id, s.turn_index): s.reward for s in got}


async def test_turns_first_then_the_outcome_rewards_every_turn(start: StartApp, bus: Bus) -> None:
    client = await start(batch_size=16, max_wait_s=0.2)
    turns = episode("env:a", 1, -1)
    side = scored_turn("env:a", 5, reward=1)
    side = side.model_copy(update={"turn": side.turn.model_copy(update={"turn_type": "side"})})
    await publish(bus, *turns, side)
    await eventually(lambda: group_done(bus), what="the turns held, their entries acked")
    assert await bus.redis.hlen(bus.keys.episode_turns("env:a")) == 3
    # Nothing without the outcome: two sweeps later the session is still where holding put
    # it (a claim would have moved its score) and only the side turn is decided.
    held = await bus.redis.zrange(bus.keys.episode_sessions, 0, -1, withscores=True)
    await more_sweeps(client, "episode")
    assert await bus.redis.zrange(bus.keys.episode_sessions, 0, -1, withscores=True) == held
    assert await counts(bus) == {"side": 1} and await samples(bus) == []
    await publish(bus, outcome("env:a", 0.75))
    got = await eventually(lambda: _at_least(samples(bus), 2), what="the episode's 2 samples")
    # The outcome on every main turn with a next state, whatever the judge said.
    assert rewards(got) == {("env:a", 0): 0.75, ("env:a", 1): 0.75}
    assert not any(s.forced for s in got)
    await eventually(lambda: nothing_held(bus), what="released")
    assert await bus.redis.exists(bus.keys.episode_turns("env:a")) == 0
    assert await counts(bus) == {"kept": 2, "side": 1, "no_next_state": 1}
    await eventually(lambda: group_done(bus, K.OUTCOMES, K.GROUP_OUTCOMES), what="the outcome acked")


async def test_outcome_first_then_the_turns(start: StartApp, bus: Bus) -> None:
    await start(batch_size=16, max_wait_s=0.2)
    await publish(bus, outcome("env:b", -1.0))
    await eventually(lambda: group_done(bus, K.OUTCOMES, K.GROUP_OUTCOMES), what="the outcome kept")
    assert await bus.redis.ttl(bus.keys.episode_outcome("env:b")) > 0
    turns = episode("env:b", 1)
    await publish(bus, *turns)
    got = await eventually(lambda: _at_least(samples(bus), 1), what="the sample")
    assert rewards(got) == {("env:b", 0): -1.0}
    # A turn redelivered after its batch, and one more turn that comes late (within the bound).
    late = scored_turn("env:b", 2, reward=0)
    await publish(bus, turns[0], late)
    await eventually(lambda: _at_least(samples(bus), 2), what="the late turn's sample")
    # Every entry handled (held or decided), then every held turn decided and its batch
    # published: nothing is left that could make another sample.
    await eventually(lambda: group_done(bus), what="the copy and the late turn handled")
    await eventually(lambda: nothing_held(bus))
    assert sorted(s.turn_index for s in await samples(bus)) == [0, 2]
    assert await counts(bus) == {"kept": 2, "no_next_state": 1}


async def test_outcome_plus_prm_with_group_mean_waits_for_the_group(start: StartApp, bus: Bus) -> None:
    await start(batch_size=16, max_wait_s=0.2, outcome_mode="outcome+prm", prm_weight=0.5,
                group_advantage="group_mean")
    await publish(bus, *episode("env:x", 1), outcome("env:x", 1.0, group="t1", index=0, size=2))
    await eventually(lambda: group_done(bus, K.OUTCOMES, K.GROUP_OUTCOMES))
    await eventually(lambda: group_done(bus))

    async def waits_for_its_group() -> bool:  # its outcome made it due; the sweep put it back
        score = await bus.redis.zscore(bus.keys.episode_sessions, "env:x")
        return score is not None and score > time.time() + 300  # the group's deadline (600 s)

    await eventually(waits_for_its_group, what="the sweep looked at env:x and chose to wait")
    # one outcome of two: the group's mean is not known yet, nothing is decided
    assert await counts(bus) == {} and await samples(bus) == []
    await publish(bus, outcome("env:y", -0.5, group="t1", index=1, size=2), *episode("env:y", -1, 0))
    got = await eventually(lambda: _at_least(samples(bus), 3), what="both episodes' samples")
    # mean 0.25; x: A = 0.75, y: A = -0.75; + 0.5 x the judge's score of the turn.
    assert rewards(got) == pytest.approx({("env:x", 0): 1.25, ("env:y", 0): -1.25, ("env:y", 1): -0.75})
    assert await counts(bus) == {"kept": 3, "no_next_state": 2}


async def test_group_norm_partial_group_after_its_wait(start: StartApp, bus: Bus) -> None:
    await start(batch_size=16, max_wait_s=0.2, group_advantage="group_norm", outcome_wait_s=1.0)
    began = time.monotonic()
    await publish(bus, outcome("env:p0", 1.0, group="t2", index=0, size=3), *episode("env:p0", 1),
                  outcome("env:p1", 0.0, group="t2", index=1, size=3), *episode("env:p1", 1))
    got = await eventually(lambda: _at_least(samples(bus), 1), timeout=10, what="the partial group's")
    assert time.monotonic() - began >= 1.0
    await eventually(lambda: nothing_held(bus))
    # [1, 0]: mean 0.5, std sqrt(0.5); p0: 0.5 / 0.7071 = 0.7071; p1's -0.7071.
    got = await samples(bus)
    assert rewards(got) == pytest.approx({("env:p0", 0): 2 ** -0.5, ("env:p1", 0): -(2 ** -0.5)}, rel=1e-5)
    assert await counts(bus) == {"kept": 2, "group_partial": 1, "no_next_state": 2}


async def test_failed_episode_missing_outcome_and_too_small_group_are_dropped(
    start: StartApp, bus: Bus,
) -> None:
    await start(batch_size=16, max_wait_s=0.2, group_advantage="group_mean", outcome_wait_s=1.0)
    began = time.monotonic()
    await publish(
        bus,
        *episode("env:failed", 1), outcome("env:failed", 0.0, group="t3", index=0, size=2,
                                            error="the policy did not answer"),
        *episode("env:lonely", 1), outcome("env:lonely", 1.0, group="t4", index=0, size=2),
        *episode("env:lost", 1, 1))  # its outcome never comes
    # Every entry handled (the turns held), then every session decided: nothing is left
    # that could make a sample.
    await eventually(lambda: group_done(bus), what="every turn held")
    await eventually(lambda: group_done(bus, K.OUTCOMES, K.GROUP_OUTCOMES), what="both outcomes kept")
    await eventually(lambda: nothing_held(bus), timeout=10, what="every session decided")
    assert time.monotonic() - began >= 1.0
    assert await samples(bus) == []  # never a made-up reward
    assert await counts(bus) == {"episode_failed": 2, "group_too_small": 2, "outcome_missing": 3}


async def test_stale_episode_turns_are_counted_not_anchored(start: StartApp, bus: Bus) -> None:
    await start(batch_size=16, max_wait_s=0.2, max_staleness=2)
    await bus.redis.set(bus.keys.trainer_version, 10)
    await publish(bus, scored_turn("env:s", 0, reward=1, policy_version=3),
                  scored_turn("env:s", 1, reward=-1, policy_version=9), outcome("env:s", 1.0))
    got = await eventually(lambda: samples(bus), what="the fresh turn's sample")
    await eventually(lambda: nothing_held(bus))
    assert [(s.turn_index, s.reward, s.forced) for s in got] == [(1, 1.0, False)]
    assert await counts(bus) == {"stale": 1, "kept": 1}


async def test_zero_reward_teaches_nothing_in_rl(start: StartApp, bus: Bus) -> None:
    await start(batch_size=16, max_wait_s=0.2)
    await publish(bus, *episode("env:z", 1), outcome("env:z", 0.0))
    await eventually(lambda: nothing_held(bus))
    await eventually(lambda: _eq(counts(bus), {"zero_reward": 1, "no_next_state": 1}), what="both excluded")
    assert await samples(bus) == []


async def test_a_claim_is_a_lease_another_buffer_takes_over(start: StartApp, bus: Bus) -> None:
    """A buffer that claimed a session and died: once its lease ends the session is decided."""
    store = EpisodeStore(bus, held_ttl_s=600, outcome_ttl_s=600)
    turn = scored_turn("env:c", 0, reward=1)
    now = time.time()
    assert await store.hold(turn, now + 60, now) == HELD
    await store.put_outcome(outcome("env:c", 1.0), now)
    [(session, score)] = await store.due(time.time(), 10)
    assert session == "env:c" and score == now  # due at once: its outcome is there
    assert await store.move(session, score, time.time() + 1.0)  # the claim of the one that dies
    assert not await store.move(session, score, time.time() + 1.0)  # one claimer wins
    began = time.monotonic()
    await start(batch_size=16, max_wait_s=0.2)
    got = await eventually(lambda: samples(bus), timeout=10, what="decided after the lease")
    assert time.monotonic() - began >= 0.5
    assert [(s.id, s.reward) for s in got] == [(turn.turn.id, 1.0)]
    await eventually(lambda: nothing_held(bus))


async def _eq(got: Awaitable[Any], want: Any) -> bool:
    return bool(await got == want)


async def _at_least(got: Awaitable[list[Any]], n: int) -> list[Any] | None:
    items = await got
    return items if len(items) >= n else None
