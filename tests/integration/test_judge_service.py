"""`python -m services.judge` as real processes: real Redis, the scripted stand-in judge over HTTP.

Covers: rewards and audit fields for agreement, disagreement, unparsable and slow votes;
no next state; side turns; a judge that stays down (retried, then dead-lettered, never
scored 0); a worker SIGKILLed mid-work (its turns are reclaimed and scored by another);
three workers on one stream (each turn scored exactly once); plugins; graded votes.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from shared.schemas import DeadLetter, ScoredTurn, Turn
from shared.settings import Settings
from shared.streams import Bus
from tests.support.judge_standin import StandinThread
from tests.support.servers import REPO, ServiceProcess, free_port
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

FAST_STREAMS = {
    "NEXTSTATE_STREAMS__CLAIM_IDLE_MS": "1000",
    "NEXTSTATE_STREAMS__RETRY_DELAY_MS": "50",
    "NEXTSTATE_STREAMS__BLOCK_MS": "100",
    "NEXTSTATE_STREAMS__MAX_DELIVERIES": "3",
    "NEXTSTATE_STREAMS__SHUTDOWN_GRACE_S": "2",
}


@pytest.fixture
def standin() -> Iterator[StandinThread]:
    with StandinThread(free_port()) as s:
        yield s


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[Bus]:
    async with Bus(settings) as b:
        yield b


def judge_env(env: dict[str, str], standin_url: str, **judge: str) -> dict[str, str]:
    out = {**env, **FAST_STREAMS, "NEXTSTATE_JUDGE__URL": standin_url,
           "NEXTSTATE_JUDGE__MODEL": "standin-judge", "NEXTSTATE_JUDGE__TIMEOUT_S": "0.5",
           "NEXTSTATE_JUDGE__RETRIES": "1", "NEXTSTATE_JUDGE__BACKOFF_S": "0.01",
           "NEXTSTATE_JUDGE__CONCURRENCY": "64"}
    out.update({f"NEXTSTATE_JUDGE__{k.upper()}": v for k, v in judge.items()})
    return out


class Judge(ServiceProcess):
    @property
    def ops(self) -> str:
        return f"http://127.0.0.1:{self.env['NEXTSTATE_JUDGE__PORT']}"


def start_judge(
    env: dict[str, str], standin_url: str, name: str, *, claim_idle_ms: int = 1000,
    read_count: int = 64, **judge: str,
) -> Judge:  # fmt: skip
    port = str(free_port())
    proc_env = judge_env(env, standin_url, port=port, consumer_name=name, **judge)
    proc_env["NEXTSTATE_STREAMS__CLAIM_IDLE_MS"] = str(claim_idle_ms)
    proc_env["NEXTSTATE_STREAMS__READ_COUNT"] = str(read_count)
    proc = Judge("judge", proc_env)
    try:
        proc.start().wait_http(f"http://127.0.0.1:{port}/healthz", timeout=60)
    except Exception:
        proc.stop()
        raise
    return proc


def make_turn(session: str, reply: str | None, *, role: str = "user", **kw: Any) -> Turn:
    return Turn(
        session_id=session,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        response={"role": "assistant", "content": f"It is sunny in Paris ({session})."},
        prompt_ids=[1, 2, 3], response_ids=[4, 5], response_logprobs=[-0.1, -0.2],
        next_state=None if reply is None else [{"role": role, "content": reply}],
        **kw,
    )


async def scored(bus: Bus) -> list[ScoredTurn]:
    return [ScoredTurn.from_json(f["data"]) for _, f in await bus.redis.xrange(bus.keys.scored)]


async def all_acked(bus: Bus) -> bool:
    groups = await bus.redis.xinfo_groups(bus.keys.turns)
    return bool(groups) and int(groups[0]["pending"]) == 0 and groups[0]["lag"] == 0


async def get(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5) as client:
        return await client.get(url)


def standin_total(s: StandinThread) -> int:
    return int(httpx.get(f"{s.url}/stats", timeout=5).json()["total"])


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    assert want is not None
    return total


async def test_turns_in_scored_turns_out(bus: Bus, env: dict[str, str], standin: StandinThread, unique: str) -> None:
    cases: dict[str, tuple[int, list[int | None], int]] = {  # directive in the next state -> (reward, scores of answered votes, errored votes)
        "votes=1,1,1": (1, [1, 1, 1], 0),
        "votes=1,-1,-1": (-1, [-1, -1, 1], 0),
        "votes=1,-1,0": (0, [-1, 0, 1], 0),
        "votes=x,x,1": (1, [None, None, 1], 0),
        "votes=x": (0, [None, None, None], 0),
        "votes=-1; delays=0,0,9": (-1, [-1, -1], 1),  # one call times out twice
        "votes=1; fail=1; status=500": (1, [1, 1, 1], 0),  # a 500, retried
    }
    turns = {d: make_turn(f"{unique}-{i}", f"ok. <<standin {d}>>", turn_index=i) for i, d in enumerate(cases)}
    tool_turn = make_turn(f"{unique}-tool", "exit 0 <<standin votes=1,1,-1>>", role="tool")
    ended = make_turn(f"{unique}-ended", None, closed_by="ttl")
    side = make_turn(f"{unique}-side", "thanks <<standin votes=1>>", turn_type="side")
    down = make_turn(f"{unique}-down", "hm <<standin fail=1000; status=500>>")
    for t in [*turns.values(), tool_turn, ended, side, down]:
        await bus.publish("turns", t)

    judge = start_judge(env, standin.url, "judge-1")
    try:
        await eventually(lambda: bus.redis.xlen(bus.keys.dead), what="the down turn dead-lettered")
        await eventually(lambda: all_acked(bus), what="every turn acked")
        out = {s.id: s for s in await scored(bus)}
        assert set(out) == {t.id for t in [*turns.values(), tool_turn, ended]}  # side: nothing; down: dead
        for directive, (reward, scores, errors) in cases.items():
            s = out[turns[directive].id]
            assert s.reward == reward, directive
            assert sorted([v.score for v in s.votes if v.error is None], key=str) == sorted(scores, key=str), directive
            assert sum(v.error is not None for v in s.votes) == errors, directive
            assert len(s.votes) == 3 and s.judged and s.mode == "rl"
            assert (s.judge, s.judge_model, s.prompt_version) == ("prm", "standin-judge", "prm-v1")
            assert s.turn == turns[directive]
            assert all(v.text for v in s.votes if v.error is None)
        slow = out[turns["votes=-1; delays=0,0,9"].id]
        (err,) = [v for v in slow.votes if v.error]
        assert "within 0.5s" in err.error and err.latency_s >= 1.0  # type: ignore[operator]
        assert out[tool_turn.id].reward == 1
        e = out[ended.id]
        assert (e.judged, e.reward, e.votes) == (False, 0, [])

        (letter,) = [DeadLetter.from_json(f["data"]) for _, f in await bus.redis.xrange(bus.keys.dead)]
        assert Turn.from_json(letter.data).id == down.id and letter.deliveries == 3
        assert "only 0 of 3 calls answered (need 2)" in letter.error and "500" in letter.error

        # Calls: 3 per judged turn, +1 per retried call; none for the ended or side turn;
        # the down turn: 3 deliveries x 3 calls x 2 attempts.
        assert standin_total(standin) == 3 * 8 + 2 + 18

        ready = await get(f"{judge.ops}/readyz")
        assert ready.status_code == 200 and ready.json()["checks"] == {"redis": "ok", "judge": "ok"}
        text = (await get(f"{judge.ops}/metrics")).text
        assert metric(text, "nextstate_judge_votes_total", kind="prm", outcome="unparsable") == 5
        assert metric(text, "nextstate_judge_disagreement_total", kind="prm") == 3
        assert metric(text, "nextstate_judge_turns_total", outcome="side") == 1
        assert metric(text, "nextstate_judge_turns_total", outcome="unjudged") == 1
        assert metric(text, "nextstate_judge_turns_total", outcome="failed") == 3
        assert metric(text, "nextstate_judge_rewards_total", judge="prm", reward="-1") == 2
        assert metric(text, "nextstate_judge_call_seconds_count", kind="prm", outcome="timeout") == 2
        assert "sunny in Paris" not in judge.logs()  # no conversation text in logs at INFO
    finally:
        assert judge.stop() == 0


async def test_graded_votes_are_averaged(bus: Bus, env: dict[str, str], standin: StandinThread, unique: str) -> None:
    """SCORES=probability: each vote's p becomes 2p - 1, the reward is their mean, every raw
    answer is kept on its vote."""
    cases = {  # directive -> (reward, the votes' scores)
        "votes=0.9,0.7,0.8": (0.6, [0.8, 0.4, 0.6]),
        "votes=1,0.5,x": (0.5, [1.0, 0.0, None]),
        "votes=0.2": (-0.6, [-0.6, -0.6, -0.6]),
        "votes=1.7,0.25,x": (-0.5, [None, -0.5, None]),  # 1.7 is no probability: unparsable
    }
    turns = {d: make_turn(f"{unique}-{i}", f"ok. <<standin {d}>>", turn_index=i) for i, d in enumerate(cases)}
    for t in turns.values():
        await bus.publish("turns", t)
    judge = start_judge(env, standin.url, "graded", scores="probability")
    try:
        await eventually(lambda: all_acked(bus), what="every turn acked")
        out = {s.id: s for s in await scored(bus)}
        for directive, (reward, scores) in cases.items():
            s = out[turns[directive].id]
            assert s.reward == pytest.approx(reward), directive
            got = sorted((v.score for v in s.votes), key=lambda x: (x is None, x or 0.0))
            want = sorted(scores, key=lambda x: (x is None, x or 0.0))
            assert got == pytest.approx(want), directive
            assert s.prompt_version == "prm-prob-v1"
            first = directive.split("=")[1].split(",")
            for v in s.votes:  # the whole raw answer, decoy box included
                assert v.text.startswith("At first glance \\boxed{0}") or v.text.startswith("I cannot tell"), v.text
            assert any(f"\\boxed{{{first[0]}}}" in v.text for v in s.votes) or first[0] == "x", directive
        text = (await get(f"{judge.ops}/metrics")).text
        assert metric(text, "nextstate_judge_rewards_total", judge="prm", reward="(0,1)") == 2
        assert metric(text, "nextstate_judge_rewards_total", judge="prm", reward="(-1,0)") == 2
        assert metric(text, "nextstate_judge_votes_total", kind="prm", outcome="unparsable") == 3
    finally:
        assert judge.stop() == 0


async def test_killed_worker_loses_nothing(bus: Bus, env: dict[str, str], standin: StandinThread, unique: str) -> None:
    turns = [make_turn(f"{unique}-{i}", f"<<standin votes=1; delays=2>> {i}") for i in range(30)]
    doomed = start_judge(env, standin.url, "doomed", timeout_s="10")
    try:
        for t in turns:
            await bus.publish("turns", t)
        await eventually(lambda: standin_total(standin) >= 90, 20, "the doomed worker judging every turn")
        assert doomed.proc is not None
        doomed.proc.send_signal(signal.SIGKILL)
        doomed.proc.wait(5)
    finally:
        doomed.stop()  # already dead after SIGKILL: this only closes its log
    assert await scored(bus) == []  # killed mid-work: nothing was published
    rescuer = start_judge(env, standin.url, "rescuer", timeout_s="10")
    try:
        await eventually(lambda: all_acked(bus), 30, "the rescuer finished every turn")
        counts = Counter(s.id for s in await scored(bus))
        assert counts == Counter({t.id: 1 for t in turns})
        assert all(s.reward == 1 for s in await scored(bus))
    finally:
        assert rescuer.stop() == 0


async def test_three_workers_score_each_turn_exactly_once(bus: Bus, env: dict[str, str], standin: StandinThread, unique: str) -> None:
    # No reclaim here: a live worker's loop stalled past a 1 s claim_idle on a loaded
    # 2-core machine is reclaimed by design (at-least-once; the buffer dedupes by id).
    workers = [start_judge(env, standin.url, f"w{i}", claim_idle_ms=15_000, timeout_s="10") for i in range(3)]
    try:
        turns = [make_turn(f"{unique}-{i}", f"<<standin votes=-1; delays=0.05>> {i}") for i in range(90)]
        for t in turns:
            await bus.publish("turns", t)
        await eventually(lambda: all_acked(bus), 30, "every turn acked")
        counts = Counter(s.id for s in await scored(bus))
        assert counts == Counter({t.id: 1 for t in turns}), "\n\n".join(w.logs() for w in workers)
        assert standin_total(standin) == 3 * 90  # nobody judged a turn twice
        per_worker = [
            metric((await get(f"{w.ops}/metrics")).text, "nextstate_judge_turns_total", outcome="scored")
            for w in workers
        ]
        assert sum(per_worker) == 90 and sum(n > 0 for n in per_worker) >= 2, per_worker
    finally:
        for w in workers:
            assert w.stop() == 0


async def test_plugin_judge_process(bus: Bus, env: dict[str, str], unique: str) -> None:
    good = make_turn(f"{unique}-a", "fine")
    bad = make_turn(f"{unique}-b", "bad answer")
    for t in (good, bad):
        await bus.publish("turns", t)
    judge = start_judge(env, "http://127.0.0.1:9", "plugin", type="tests.unit.test_judge_rules:plugin_sync")
    try:
        await eventually(lambda: all_acked(bus), what="both turns acked")
        out = {s.id: s for s in await scored(bus)}
        assert (out[good.id].reward, out[bad.id].reward) == (1, -1)
        assert out[good.id].judge == "tests.unit.test_judge_rules:plugin_sync"
        ready = (await get(f"{judge.ops}/readyz")).json()
        assert ready["checks"] == {"redis": "ok"}  # no LLM, no judge endpoint to check
    finally:
        assert judge.stop() == 0


def test_bad_configuration_exits_2(env: dict[str, str]) -> None:
    for extra, message in (
        ({"NEXTSTATE_JUDGE__TYPE": "no_such_module_xyz:judge"}, "cannot import 'no_such_module_xyz'"),
        ({"NEXTSTATE_JUDGE__VOTES": "0"}, "NEXTSTATE_JUDGE__VOTES"),
        ({"NEXTSTATE_JUDGE__PROMPT_VERSION": "prm-v9"}, "unknown judge prompt version"),
        ({"NEXTSTATE_JUDGE__SCORES": "graded", "NEXTSTATE_JUDGE__VOTE_THRESHOLD": "0.6"},
         "VOTE_THRESHOLD applies to labels"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "services.judge"], cwd=REPO, env={**env, **extra, "PATH": "/usr/bin:/bin"},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr


async def test_hundreds_of_turns_in_flight_without_failures(bus: Bus, env: dict[str, str], standin: StandinThread, unique: str) -> None:
    """200 turns (600 calls) in flight finish together: their publishes must not exhaust Redis."""
    judge = start_judge(env, standin.url, "busy", read_count=256, concurrency="200", timeout_s="20")
    try:
        turns = [make_turn(f"{unique}-{i}", f"<<standin votes=1; delays=0.5>> {i}") for i in range(400)]
        pipe = bus.redis.pipeline(transaction=False)
        for t in turns:
            pipe.xadd(bus.keys.turns, {"data": t.to_json()})
        await pipe.execute()
        await eventually(lambda: all_acked(bus), 60, "every turn acked")
        assert Counter(s.id for s in await scored(bus)) == Counter({t.id: 1 for t in turns})
        text = (await get(f"{judge.ops}/metrics")).text
        assert metric(text, "nextstate_judge_turns_total", outcome="failed") == 0, judge.logs()
        assert metric(text, "nextstate_judge_turns_total", outcome="scored") == 400
    finally:
        assert judge.stop() == 0
