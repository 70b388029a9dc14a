"""Chat groups (the n choices of one completion) in the buffer: real Redis, the real buffer app.

raw (the default): every member an ordinary turn. group_norm / group_mean: the judged
members wait until every member came, then each trains on its reward normalized over the
group's judged rewards (against hand-computed values); unjudged members (unchosen with no
next state) count as arrived and are excluded as usual; too small and partial groups;
opd mode leaves groups alone; a late member uses the fixed statistics.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable
from typing import Any

import pytest

from shared import keys as K
from shared.schemas import SamplingParams, ScoredTurn, TrainSample, Turn
from shared.streams import Bus
from tests.integration import test_buffer
from tests.integration.test_buffer import StartApp, group_done, more_sweeps, samples
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

bus = test_buffer.bus
start = test_buffer.start

EPS = 1e-6
REPLY = [{"role": "user", "content": "that one, thanks"}]


def member(gid: str, index: int, size: int, reward: float = 1.0, *, judged: bool = True,
           session: str = "s", teacher: bool = False) -> ScoredTurn:  # fmt: skip
    """Choice `index` of a completion with n = `size`, as the judge publishes it. Not
    `judged`: an unchosen choice under GROUP_UNCHOSEN=keep (no next state)."""
    ids = [100 + index, 101 + index, 102]
    turn = Turn(
        session_id=session, turn_index=0, messages=[{"role": "user", "content": "q"}],
        response={"role": "assistant", "content": f"a{index}"}, prompt_ids=[1, 2, 3],
        response_ids=ids, response_logprobs=[-0.3] * 3, sampling=SamplingParams(temperature=1.0),
        next_state=REPLY if judged else None, closed_by="next_request" if index == 0 else "unchosen",
        completion_id=gid, group_id=gid, group_index=index, group_size=size,
    )  # fmt: skip
    return ScoredTurn(id=turn.id, turn=turn, reward=reward if judged else 0, judged=judged,
                      teacher_logprobs=[-0.1] * 3 if teacher else None)  # fmt: skip


async def counts(bus: Bus) -> dict[str, int]:
    return {k: int(v) for k, v in (await bus.redis.hgetall(bus.keys.buffer_counts)).items()}


async def publish(bus: Bus, *msgs: ScoredTurn) -> None:
    for m in msgs:
        await bus.publish(K.SCORED, m)


def by_choice(got: list[TrainSample], members: list[ScoredTurn]) -> dict[int, float]:
    index = {m.turn.id: m.turn.group_index for m in members}
    return {index[s.id]: s.reward for s in got}


async def nothing_held(bus: Bus) -> bool:
    return int(await bus.redis.zcard(bus.keys.chat_groups)) == 0


async def test_raw_trains_every_member_on_its_own_reward_at_once(start: StartApp, bus: Bus) -> None:
    await start(batch_size=2, max_wait_s=60)  # GROUP_ADVANTAGE raw, the default
    members = [member("g-raw", i, 3, r) for i, r in enumerate((1.0, -1.0, 1.0))]
    await publish(bus, *members[:2])  # the third never comes: raw does not wait for it
    got = await eventually(lambda: _at_least(samples(bus), 2), what="a batch of the two")
    assert by_choice(got, members) == {0: 1.0, 1: -1.0}
    assert {s.group_id for s in got} == {"g-raw"}
    assert await bus.redis.exists(bus.keys.chat_group("g-raw")) == 0  # nothing held


async def test_group_norm_waits_for_the_group_then_normalizes(start: StartApp, bus: Bus) -> None:
    client = await start(batch_size=16, max_wait_s=0.2, group_advantage="group_norm")
    members = [member("g-norm", i, 3, r) for i, r in enumerate((1.0, -1.0, 1.0))]
    await publish(bus, *members[:2])
    await eventually(lambda: group_done(bus), what="two members held, their entries acked")
    assert await bus.redis.hlen(bus.keys.chat_group_turns("g-norm")) == 2
    # Nothing until the group came: two sweeps later the group is still where holding put
    # it (a claim would have moved its score) and nothing is decided.
    held = await bus.redis.zrange(bus.keys.chat_groups, 0, -1, withscores=True)
    await more_sweeps(client, "group")
    assert await bus.redis.zrange(bus.keys.chat_groups, 0, -1, withscores=True) == held
    assert await counts(bus) == {} and await samples(bus) == []
    await publish(bus, members[2])
    got = await eventually(lambda: _at_least(samples(bus), 3), what="the group's 3 samples")
    # [1, -1, 1]: mean 1/3, std sqrt(((2/3)^2 * 2 + (4/3)^2) / 2) = sqrt(4/3).
    std = math.sqrt(4 / 3)
    want = {0: (2 / 3) / (std + EPS), 1: (-4 / 3) / (std + EPS), 2: (2 / 3) / (std + EPS)}
    assert by_choice(got, members) == pytest.approx(want, rel=1e-9)
    assert {s.group_id for s in got} == {"g-norm"} and not any(s.forced for s in got)
    await eventually(lambda: nothing_held(bus), what="released")
    assert await bus.redis.exists(bus.keys.chat_group_turns("g-norm")) == 0
    assert await counts(bus) == {"kept": 3}


async def test_group_mean_with_unjudged_members_arrived_but_not_compared(start: StartApp, bus: Bus) -> None:
    await start(batch_size=16, max_wait_s=0.2, group_advantage="group_mean")
    members = [member("g-mean", 0, 4, 1.0), member("g-mean", 1, 4, judged=False),
               member("g-mean", 2, 4, -0.5), member("g-mean", 3, 4, 0.5)]  # fmt: skip
    await publish(bus, *members)
    got = await eventually(lambda: _at_least(samples(bus), 3), what="the 3 judged members")
    # The judged rewards [1, -0.5, 0.5]: mean 1/3; the unjudged one is in no statistic.
    assert by_choice(got, members) == pytest.approx({0: 2 / 3, 2: -5 / 6, 3: 1 / 6})
    await eventually(lambda: _eq(counts(bus), {"kept": 3, "no_next_state": 1}), what="all decided")


async def test_only_the_chosen_member_judged_is_too_small(start: StartApp, bus: Bus) -> None:
    """GROUP_UNCHOSEN=keep with a group advantage: one judged member, nothing to compare it with."""
    await start(batch_size=16, max_wait_s=0.2, group_advantage="group_norm")
    members = [member("g-keep", 0, 3, 1.0), member("g-keep", 1, 3, judged=False),
               member("g-keep", 2, 3, judged=False)]  # fmt: skip
    await publish(bus, *members)
    await eventually(lambda: _eq(counts(bus), {"group_too_small": 1, "no_next_state": 2}),
                     what="the chosen one dropped, the others excluded")  # fmt: skip
    await eventually(lambda: nothing_held(bus), what="released")
    assert await samples(bus) == []  # unchosen members are no session's final turn: none forced


async def test_a_partial_group_after_its_wait_and_a_late_member(start: StartApp, bus: Bus) -> None:
    await start(batch_size=16, max_wait_s=0.2, group_advantage="group_norm", outcome_wait_s=2.0)
    members = [member("g-part", i, 4, r) for i, r in enumerate((1.0, -1.0, -1.0))]  # of 4
    await publish(bus, *members[:2])
    got = await eventually(lambda: _at_least(samples(bus), 2), timeout=10, what="the partial group")
    # [1, -1]: mean 0, std sqrt(2).
    want = {0: 1 / (math.sqrt(2) + EPS), 1: -1 / (math.sqrt(2) + EPS)}
    assert by_choice(got, members) == pytest.approx(want, rel=1e-9)
    assert (await counts(bus))["chat_group_partial"] == 1
    # The third comes late (the fourth never does): the statistics are fixed, so it is
    # decided at once against them (well within another wait of 2 s).
    await publish(bus, members[2])
    got = await eventually(lambda: _at_least(samples(bus), 3), timeout=1.2, what="the late member")
    assert by_choice(got, members)[2] == pytest.approx(-1 / (math.sqrt(2) + EPS), rel=1e-9)
    await eventually(lambda: nothing_held(bus), what="released")


async def test_equal_rewards_teach_nothing_in_rl(start: StartApp, bus: Bus) -> None:
    await start(batch_size=16, max_wait_s=0.2, group_advantage="group_norm")
    await publish(bus, *(member("g-same", i, 2, 1.0) for i in range(2)))
    await eventually(lambda: _eq(counts(bus), {"zero_reward": 2}), what="A = 0 for both")
    assert await samples(bus) == []


async def test_opd_leaves_groups_alone(start: StartApp, bus: Bus) -> None:
    await start(batch_size=2, max_wait_s=60, mode="opd", group_advantage="group_norm")
    members = [member("g-opd", i, 3, 0.0, teacher=True) for i in range(2)]
    await publish(bus, *members)
    got = await eventually(lambda: _at_least(samples(bus), 2), what="both at once")
    assert all(s.reward == 0.0 and s.teacher_logprobs for s in got)
    assert await bus.redis.exists(bus.keys.chat_group("g-opd")) == 0


async def _eq(got: Awaitable[Any], want: Any) -> bool:
    return bool(await got == want)


async def _at_least(got: Awaitable[list[Any]], n: int) -> list[Any] | None:
    items = await got
    return items if len(items) >= n else None
