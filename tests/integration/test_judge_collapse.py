"""The reward-collapse alarm against real Redis and real judge processes.

The window script (services/judge/collapse.py): eviction, a turn counted once however
often it is judged, hysteresis, and two replicas sharing one window (one raise, logged
once). Then `python -m services.judge` with the scripted stand-in judge: a judge model that
always votes the same raises the alarm in `nextstate status`, in the metrics and in the
log; one that always ties raises `undecided`; healthy votes over more turns than the
window never raise it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import pytest

from services.judge import metrics
from services.judge.collapse import RewardWindow
from services.judge.settings import JudgeConfig
from shared.schemas import ScoredTurn, Turn, Vote
from shared.settings import Settings
from shared.streams import Bus
from tests.integration.test_judge_service import (
    all_acked,
    get,
    make_turn,
    metric,
    scored,
    start_judge,
)
from tests.support.judge_standin import StandinThread
from tests.support.servers import REPO, free_port
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

NEXTSTATE = os.path.join(os.path.dirname(sys.executable), "nextstate")
SMALL = {"collapse_window": "20", "collapse_min_turns": "10"}


@pytest.fixture
def standin() -> Iterator[StandinThread]:
    with StandinThread(free_port()) as s:
        yield s


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[Bus]:
    async with Bus(settings) as b:
        yield b


def judged(i: int, reward: float, scores: list[float | None]) -> ScoredTurn:
    t = make_turn(f"s{i}", "thanks", turn_index=i)
    return ScoredTurn(id=t.id, turn=t, reward=reward, votes=[Vote(score=s) for s in scores])


CFG = JudgeConfig(collapse_window=10, collapse_min_turns=5, collapse_value_share=0.8,
                  collapse_undecided_share=0.5)


async def test_the_window_slides_counts_each_turn_once_and_does_not_flap(
    bus: Bus, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "services.judge.collapse")
    window = RewardWindow(bus, CFG)
    turns = [judged(i, 1, [1, 1, 1]) for i in range(4)]
    for t in turns:
        s = await window.add(t)
        assert s is not None and s.alarm == ()  # fewer than collapse_min_turns: not judged yet
    again = await window.add(turns[0])  # a redelivered turn, judged twice: counted once
    assert again is not None and again.turns == 4
    s = await window.add(judged(4, 1, [1, 1, 1]))
    assert s is not None and s.alarm == ("one-value",) and s.before == ()  # 5 of 5 are 1
    assert metrics.COLLAPSE.labels("one-value")._value.get() == 1
    # other values come in: 8/10 still holds (>= 0.8); raised alarms clear only below 0.75
    for i in range(5, 15):
        s = await window.add(judged(i, 1 if i % 5 else -1, [1, 1, 1] if i % 5 else [-1, -1, 1]))
    assert s is not None and s.turns == 10 and s.top_count == 8 and s.alarm == ("one-value",)
    for i in range(15, 25):  # 1 -1 1 -1 ...: 5 of 10 -> cleared
        s = await window.add(judged(i, 1 if i % 2 else -1, [1, 1, 1] if i % 2 else [-1, -1, -1]))
    assert s is not None and s.alarm == () and s.top_count == 5
    fields = await bus.redis.hgetall(bus.keys.reward_alarm)
    assert fields["turns"] == "10" and int(fields["v:1"]) + int(fields["v:-1"]) == 10 and "v:0" not in fields
    assert await bus.redis.llen(bus.keys.reward_window) == 10
    assert await bus.redis.hlen(bus.keys.reward_window_turns) == 10  # evicted turns are forgotten
    raised = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(raised) == 1 and "reward collapse" in raised[0].getMessage()
    assert "(1) holds 100%" in raised[0].getMessage() and "thanks" not in raised[0].getMessage()
    assert sum("cleared" in r.getMessage() for r in caplog.records) == 1
    # ties: undecided; turns without a judged reward are not counted
    for i in range(25, 35):
        s = await window.add(judged(i, 0, [1, -1, None]))
    assert s is not None and s.alarm == ("one-value", "undecided") and s.undecided == 10
    t = make_turn("ended", None)
    assert await window.add(ScoredTurn(id=t.id, turn=t, reward=0, judged=False)) is None
    assert await window.add(ScoredTurn(id=t.id, turn=t, reward=0, mode="opd", votes=[Vote(score=1)])) is None


async def test_replicas_share_one_window(settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    """Two judges each see half the turns; the window holds all of them and the alarm is
    raised once, by the replica whose turn crossed the threshold."""
    caplog.set_level(logging.WARNING, "services.judge.collapse")
    async with Bus(settings) as a, Bus(settings) as b:
        wa, wb = RewardWindow(a, CFG), RewardWindow(b, CFG)
        states = await asyncio.gather(*((wa if i % 2 else wb).add(judged(i, -1, [-1, -1, 0])) for i in range(10)))
        assert max(s.turns for s in states if s is not None) == 10
        assert sum(bool(s.alarm) and not s.before for s in states if s is not None) == 1
        assert len([r for r in caplog.records if "reward collapse" in r.getMessage()]) == 1
        assert (await a.redis.hgetall(a.keys.reward_alarm))["v:-1"] == "10"


def gauge(text: str, name: str) -> float:
    """An unlabelled metric's value in a /metrics page."""
    (value,) = [line.split()[1] for line in text.splitlines() if line.startswith(f"{name} ")]
    return float(value)


def status_json(env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([NEXTSTATE, "status", "--json", "--window", "0"], env={**os.environ, **env},
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got: dict[str, object] = json.loads(out.stdout)
    return got


async def judge_all(bus: Bus, env: dict[str, str], standin: StandinThread, unique: str,
                    votes: list[str], name: str) -> tuple[str, str]:
    """Judge one turn per vote directive with a real judge process; its /metrics and log."""
    turns: list[Turn] = [make_turn(f"{unique}-{i}", f"ok <<standin votes={v}>>", turn_index=i)
                         for i, v in enumerate(votes)]
    for t in turns:
        await bus.publish("turns", t)
    judge = start_judge(env, standin.url, name, **SMALL)
    try:
        await eventually(lambda: all_acked(bus), 60, "every turn judged")
        assert len(await scored(bus)) == len(turns)
        text = (await get(f"{judge.ops}/metrics")).text
        logs = judge.logs(200_000)
    finally:
        assert judge.stop() == 0
    return text, logs


async def test_a_judge_that_always_votes_the_same_raises_the_alarm(
    bus: Bus, env: dict[str, str], standin: StandinThread, unique: str,
) -> None:
    text, logs = await judge_all(bus, env, standin, unique, ["1,1,1"] * 12, "same")
    status = status_json(env)
    rewards = status["rewards"]
    assert isinstance(rewards, dict)
    assert rewards["alarm"] == ["one-value"] and rewards["values"] == {"1": 1.0} and rewards["turns"] == 12
    assert metric(text, "nextstate_judge_reward_collapse", reason="one-value") == 1
    assert metric(text, "nextstate_judge_reward_collapse_alarms_total", reason="one-value") == 1
    assert gauge(text, "nextstate_judge_window_top_share") == 1 and gauge(text, "nextstate_judge_window_turns") == 12
    assert logs.count("reward collapse: the judge's votes stop discriminating") == 1
    shown = subprocess.run([NEXTSTATE, "status", "--window", "0"], env={**os.environ, **env}, cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert "REWARD COLLAPSE" in shown.stdout and "one value (1) holds 100%" in shown.stdout, shown.stdout


async def test_a_judge_that_never_decides_raises_undecided(
    bus: Bus, env: dict[str, str], standin: StandinThread, unique: str,
) -> None:
    # ties (1 against -1, the third unreadable) and answers with no readable box at all
    text, logs = await judge_all(bus, env, standin, unique, ["1,-1,x", "x"] * 6, "ties")
    rewards = status_json(env)["rewards"]
    assert isinstance(rewards, dict)
    assert "undecided" in rewards["alarm"] and rewards["undecided"] == 1.0  # type: ignore[operator]
    assert metric(text, "nextstate_judge_reward_collapse", reason="undecided") == 1
    assert gauge(text, "nextstate_judge_window_undecided_share") == 1
    assert "100% were undecided (a tie or no readable vote)" in logs


async def test_healthy_votes_never_raise_it(
    bus: Bus, env: dict[str, str], standin: StandinThread, unique: str,
) -> None:
    # 40 turns through a window of 20: 1, -1, 0 (decided by two of three) and a tie now and then
    pattern = ["1,1,-1", "-1,-1,1", "1,1,1", "0,0,1", "-1,-1,-1", "1,-1,0", "1,1,x", "-1,x,x"]
    text, logs = await judge_all(bus, env, standin, unique, (pattern * 5)[:40], "healthy")
    rewards = status_json(env)["rewards"]
    assert isinstance(rewards, dict)
    assert rewards["alarm"] == [] and rewards["turns"] == 20
    assert metric(text, "nextstate_judge_reward_collapse_alarms_total", reason="one-value") == 0
    assert metric(text, "nextstate_judge_reward_collapse_alarms_total", reason="undecided") == 0
    assert metric(text, "nextstate_judge_reward_collapse", reason="one-value") == 0
    assert "reward collapse" not in logs
