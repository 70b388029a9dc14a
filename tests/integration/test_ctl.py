"""`nextstate tail | status | dlq` as a user runs them, against a real stream."""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shared.schemas import ScoredTurn, Turn, Vote
from shared.settings import Settings
from shared.streams import Bus
from tests.support.servers import REPO

pytestmark = pytest.mark.integration

NEXTSTATE = str(Path(sys.executable).parent / "nextstate")


def run(env: dict[str, str], *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [NEXTSTATE, *args], env={**os.environ, **env}, cwd=REPO,
        capture_output=True, text=True, timeout=timeout,
    )


def turn(i: int) -> Turn:
    return Turn(
        session_id=f"sess-{i}", turn_index=i,
        messages=[{"role": "user", "content": "SECRET user text"}],
        response={"role": "assistant", "content": "SECRET model text"},
        prompt_ids=[1, 2, 3], response_ids=[4, 5], response_logprobs=[-0.1, -0.2],
        next_state=[{"role": "tool", "content": "x"}, {"role": "tool", "content": "y"}],
        weight_version="3", policy_version=3,
    )


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[Bus]:
    async with Bus(settings) as b:
        yield b


async def test_tail_prints_one_line_per_message_without_text(bus: Bus, env: dict[str, str]) -> None:
    turns = [turn(i) for i in range(3)]
    turns[1] = turns[1].model_copy(update={"group_id": "chatcmpl-7", "group_index": 1, "group_size": 3})
    for t in turns:
        await bus.publish("turns", t)
    votes = [Vote(score=1), Vote(score=1), Vote(score=None)]
    await bus.publish("scored", ScoredTurn(turn=turns[0], reward=1, votes=votes))
    out = run(env, "tail", "turns")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3
    for line, t in zip(lines, turns, strict=True):
        assert t.id in line and "turn" in line and f"session={t.session_id}" in line
        assert "next=tool×2" in line and "wv=3" in line
        assert ("group=chatcmpl-7[1/3]" in line) == (t is turns[1])
    assert "SECRET" not in out.stdout
    scored = run(env, "tail", "scored").stdout
    assert "reward=+1" in scored and "votes=[+1,+1,?]" in scored

    raw = run(env, "tail", "turns", "--raw", "-n", "1").stdout.strip()
    assert Turn.from_json(raw) == turns[-1]


async def test_tail_since_and_follow(bus: Bus, env: dict[str, str]) -> None:
    await bus.publish("turns", turn(0))
    second = await bus.publish("turns", turn(1))
    await bus.publish("turns", turn(2))
    since = run(env, "tail", "turns", "--since", second or "").stdout.strip().splitlines()
    assert len(since) == 2 and "sess-1" in since[0]
    proc = subprocess.Popen(
        [NEXTSTATE, "tail", "turns", "--follow", "-n", "0"], env={**os.environ, **env},
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        late = turn(9)
        seen = ""
        # The follower reads from "$" once it is up: publish until it prints one.
        for _ in range(150):
            await bus.publish("turns", late)
            if select.select([proc.stdout], [], [], 0.2)[0]:
                seen = proc.stdout.readline()
                break
        assert late.id in seen
    finally:
        proc.terminate()
        proc.communicate(timeout=5)


async def test_status_json_reports_streams_groups_and_stalls(bus: Bus, env: dict[str, str]) -> None:
    await bus.ensure_group("turns", "judge")
    for i in range(4):
        await bus.publish("turns", turn(i))
    await bus.redis.xreadgroup("judge", "worker-1", {bus.keys.turns: ">"}, count=1)
    await bus.redis.set(bus.keys.policy_version, 7)
    out = run(env, "status", "--json", "--window", "0.3")
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout)
    turns = next(s for s in snap["streams"] if s["stream"] == "turns")
    assert turns["length"] == 4
    (judge,) = turns["groups"]
    assert judge["name"] == "judge" and judge["pending"] == 1 and judge["lag"] == 3
    assert [c["name"] for c in judge["consumers"]] == ["worker-1"]
    assert judge["stalled"] is True and snap["stalled"] == ["turns/judge"]
    assert snap["policy_version"] == 7 and snap["dead_letters"] == 0
    text = run(env, "status", "--window", "0").stdout
    assert "turns" in text and "worker-1" in text


async def test_status_shows_the_real_serving_version_refusals_decisions_and_processes(
    bus: Bus, env: dict[str, str]
) -> None:
    """What the watcher, trainer, buffer and `up`'s supervisor write to Redis, in one view."""
    k = bus.keys
    await bus.redis.hset(k.watcher_state, mapping={
        "engine_version": "0", "target_version": "5", "mismatch": "1", "checked_at": "1",
        "engine": "http://e", "error": "", "latest_version": "5"})
    await bus.redis.hset(k.refused_versions, "6", json.dumps(
        {"by": "trainer", "reason": "checksum", "detail": "model.safetensors", "at": 1.0}))
    await bus.redis.hset(k.refused_versions, "LATEST", json.dumps(
        {"by": "trainer", "reason": "latest", "detail": "not JSON", "at": 2.0}))
    await bus.redis.hset(k.buffer_counts, mapping={"kept": 12, "stale": 2, "no_next_state": 3})
    await bus.redis.zadd(k.force_candidates, {"t1": 1.0})
    await bus.redis.zadd(k.episode_sessions, {"env:e1": 1.0, "env:e2": 2.0})
    await bus.redis.zadd(k.chat_groups, {"chatcmpl-1": 1.0})
    await bus.redis.zadd(k.pending_deadlines, {"h1": 1.0, "h2": 2.0})
    await bus.redis.hset(k.services, mapping={
        "trainer": json.dumps({"state": "crash-loop", "pid": 42, "restarts": 7, "last_exit": 1}),
        "collector": json.dumps({"state": "running", "pid": 41, "restarts": 0})})
    snap = json.loads(run(env, "status", "--json", "--window", "0").stdout)
    assert snap["watcher"]["mismatch"] == "1" and snap["watcher"]["target_version"] == "5"
    assert list(snap["refused_versions"]) == ["6", "LATEST"]
    assert snap["refused_versions"]["6"] == {"by": "trainer", "reason": "checksum",
                                             "detail": "model.safetensors", "at": 1.0}
    assert snap["buffer"] == {"decisions": {"kept": 12, "no_next_state": 3, "stale": 2},
                              "final_turns_waiting": 1, "episodes_waiting": 2, "chat_groups_waiting": 1}
    assert snap["turns_waiting_next_state"] == 2
    assert snap["services"]["trainer"]["state"] == "crash-loop"
    text = run(env, "status", "--window", "0").stdout
    assert "MISMATCH: the engine serves v0, should serve v5" in text
    assert "refused v6 by trainer: checksum" in text and "refused LATEST by trainer: latest" in text
    assert "buffer decisions: kept 12, no_next_state 3, stale 2" in text
    assert "episodes waiting for their outcome: 2" in text
    assert "chat groups waiting for their choices: 1" in text
    assert "turns waiting for their next state: 2" in text
    assert "CRASH LOOP" in text and "restarts 7" in text


async def test_status_flowing_group_not_stalled(bus: Bus, env: dict[str, str]) -> None:
    await bus.ensure_group("turns", "judge")
    for i in range(1000):  # backlog for 50 s of acks
        await bus.publish("turns", turn(i))
    proc = subprocess.Popen(
        [NEXTSTATE, "status", "--json", "--window", "1.0"], env={**os.environ, **env},
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )
    # While status samples, a consumer makes progress: one entry acked every 50 ms for as
    # long as the command runs, so its window sees acks however slowly it starts.
    while proc.poll() is None:
        resp = await bus.redis.xreadgroup("judge", "w", {bus.keys.turns: ">"}, count=1)
        await bus.redis.xack(bus.keys.turns, "judge", resp[0][1][0][0])
        await asyncio.sleep(0.05)
    out, _ = proc.communicate(timeout=30)
    snap = json.loads(out)
    judge = next(s for s in snap["streams"] if s["stream"] == "turns")["groups"][0]
    assert judge["lag"] > 0 and judge["acked_in_window"] > 0
    assert judge["stalled"] is False and snap["stalled"] == []


async def test_dlq_list_requeue_drop(bus: Bus, env: dict[str, str]) -> None:
    await bus.dead_letter("turns", "judge", "1-0", turn(1).to_json(), "ValueError: judge down", 5, "w1")
    await bus.dead_letter("turns", "judge", "2-0", turn(2).to_json(), "ValueError: judge down", 5, "w1")
    listed = run(env, "dlq", "list")
    assert "judge down" in listed.stdout and listed.stdout.count("deliveries=5") == 2
    entries = json.loads(run(env, "dlq", "list", "--json").stdout)
    first = entries[0]["dead_entry_id"]
    assert entries[0]["letter"]["error"] == "ValueError: judge down"
    assert run(env, "dlq", "requeue", first).returncode == 0
    (back,) = await bus.redis.xrange(bus.keys.turns)
    assert Turn.from_json(back[1]["data"]).session_id == "sess-1"
    assert run(env, "dlq", "drop", "--all").stdout.strip() == "drop: 1 dead letter(s)"
    assert await bus.redis.xlen(bus.keys.dead) == 0


def test_unreachable_redis_is_one_clear_line(env: dict[str, str]) -> None:
    out = run({**env, "NEXTSTATE_REDIS__URL": "redis://127.0.0.1:1/0"}, "status", "--window", "0")
    assert out.returncode == 1
    assert "did not answer" in out.stderr and "Traceback" not in out.stderr
