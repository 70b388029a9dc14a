"""The whole environment chain with real processes: env worker -> collector -> judge ->
buffer (outcome join) -> training batches.

Redis (this session's), the engine on the tool-calling tiny model, the collector, a rule
judge, the buffer and one envs worker, each a `python -m services.<name>` process; no
trainer (the batches are read from the stream). The episodes are of
`ScriptedWeatherEnv`: the model calls `get_weather`, reads the result and answers (two
real turns, then the worker's closing request), and the outcome reward is scripted per
episode so that every advantage can be computed by hand. Two buffer configurations run
one after the other on the same stack:

1. `outcome` / `raw`: every real turn of an episode carries the episode's reward R;
2. `outcome` / `group_norm`: A = (R - mean) / (std + eps) over the episode's group
   (Bessel std), and an A of exactly 0 is not trained (rl mode's `zero_reward`).

In both, the closing request's turn never reaches a batch, and every sample's token ids
are exactly the ones the collector captured (prompt + response) with the engine's log-probs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis

from shared.envjobs import enqueue_episode, new_group, task_json
from shared.keys import Keys
from shared.rqjobs import rq_connection
from shared.schemas import Outcome, TrainBatch, TrainSample, Turn
from shared.settings import Settings
from tests.support.collector_harness import collector_process, engine_process, wait_ready
from tests.support.servers import ServiceProcess, free_port, wait_until
from tests.support.weather_env import scripted_task

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ENV = "tests.support.weather_env:ScriptedWeatherEnv"
EPS = 1e-6
FAST = {"NEXTSTATE_STREAMS__BLOCK_MS": "100", "NEXTSTATE_STREAMS__CLAIM_IDLE_MS": "2000"}


class Streams:
    """This test's view of the stack's Redis: outcomes, turns, batches, buffer decisions."""

    def __init__(self, url: str, keys: Keys) -> None:
        self.r: Any = redis.Redis.from_url(url, decode_responses=True, socket_timeout=5)
        self.keys = keys

    def outcomes(self) -> dict[str, Outcome]:
        got = (Outcome.from_json(f["data"]) for _, f in self.r.xrange(self.keys.outcomes))
        return {o.id: o for o in got}

    def turns(self, session: str) -> list[Turn]:
        got = (Turn.from_json(f["data"]) for _, f in self.r.xrange(self.keys.turns))
        return sorted((t for t in got if t.session_id == session), key=lambda t: t.turn_index)

    def samples(self) -> list[TrainSample]:
        return [s for _, f in self.r.xrange(self.keys.batches) for s in TrainBatch.from_json(f["data"]).samples]

    def counts(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.r.hgetall(self.keys.buffer_counts).items()}

    def held(self) -> int:
        return int(self.r.zcard(self.keys.episode_sessions))


@pytest.fixture
def stack(tool_model: Path, env: dict[str, str]) -> Iterator[Callable[..., ServiceProcess]]:
    """Engine, collector, rule judge and one envs worker; returns `buffer(**settings)`,
    which starts a buffer with those NEXTSTATE_BUFFER__* settings (waited until ready)."""
    procs: list[ServiceProcess] = []
    engine = engine_process(tool_model)
    procs.append(engine[0])
    try:
        collector = collector_process({**env, **FAST}, engine[1])
        procs.append(collector[0])
        judge_port, envs_port = free_port(), free_port()
        judge = ServiceProcess("judge", {
            **env, **FAST, "NEXTSTATE_JUDGE__TYPE": "rule", "NEXTSTATE_JUDGE__URL": engine[1],
            "NEXTSTATE_JUDGE__ENGINE_URL": engine[1], "NEXTSTATE_JUDGE__PORT": str(judge_port),
            "NEXTSTATE_JUDGE__CONSUMER_NAME": "judge-0"}).start()
        procs.append(judge)
        worker = ServiceProcess("envs", {
            **env, "NEXTSTATE_ENVS__URL": collector[1] + "/v1", "NEXTSTATE_ENVS__PORT": str(envs_port),
            # Greedy: the tool model then calls get_weather and answers, every time.
            "NEXTSTATE_ENVS__TEMPERATURE": "0", "NEXTSTATE_ENVS__MAX_TOKENS": "64"}).start()
        procs.append(worker)
        wait_ready(engine, collector)
        judge.wait_http(f"http://127.0.0.1:{judge_port}/healthz", timeout=60)
        worker.wait_http(f"http://127.0.0.1:{envs_port}/readyz", timeout=60)

        def buffer(**cfg: str) -> ServiceProcess:
            port = free_port()
            proc = ServiceProcess("buffer", {
                **env, **FAST, "NEXTSTATE_BUFFER__PORT": str(port), "NEXTSTATE_BUFFER__ARCHIVE": "false",
                "NEXTSTATE_BUFFER__BATCH_SIZE": "4", "NEXTSTATE_BUFFER__MAX_WAIT_S": "0.5",
                **{f"NEXTSTATE_BUFFER__{k.upper()}": v for k, v in cfg.items()}}).start()
            procs.append(proc)
            return proc.wait_http(f"http://127.0.0.1:{port}/readyz", timeout=60)

        yield buffer
    finally:
        with ThreadPoolExecutor(len(procs)) as pool:  # SIGTERM them all at once
            list(pool.map(ServiceProcess.stop, procs))


def run_group(settings: Settings, rewards: list[float], task_index: int) -> list[str]:
    """Enqueue one group: len(rewards) episodes of one task, episode i scripted to end with
    rewards[i]. Returns their job ids (= their outcomes' ids)."""
    keys, group = Keys(settings.redis.prefix), new_group(task_index)
    conn = rq_connection(settings.redis.url)
    try:
        return [enqueue_episode(conn, keys, settings.run, ENV, f"weather-{task_index}", group, i, len(rewards),
                                task=task_json(scripted_task(task_index, r)), timeout_s=120, retries=0)
                for i, r in enumerate(rewards)]
    finally:
        conn.close()


def check_episode(streams: Streams, outcome: Outcome, expected: float | None) -> list[TrainSample]:
    """The episode's samples: one per real turn (none when `expected` is None: not trained),
    each with reward `expected` and exactly the captured ids; never its closing turn."""
    assert outcome.error is None and outcome.steps == 2 and outcome.details["ended"] == "answered", outcome
    turns = streams.turns(outcome.session_id)
    assert [t.turn_index for t in turns] == [0, 1, 2]
    closing = turns[-1]
    assert closing.closed_by == "session_done" and not closing.next_state
    real = {t.turn_index: t for t in turns[:-1]}
    assert all(t.next_state for t in real.values())
    mine = [s for s in streams.samples() if s.session_id == outcome.session_id]
    assert closing.turn_index not in {s.turn_index for s in mine}, "a closing turn was trained"
    if expected is None:
        assert mine == []
        return mine
    assert sorted(s.turn_index for s in mine) == [0, 1], mine
    for s in mine:
        turn = real[s.turn_index]
        assert s.reward == pytest.approx(expected, abs=1e-9), (s.turn_index, s.reward, expected)
        assert s.tokens == turn.prompt_ids + turn.response_ids
        assert s.response_length == len(turn.response_ids)
        assert s.rollout_logprobs == turn.response_logprobs
        assert s.loss_mask == [1] * len(turn.response_ids)
        assert s.policy_version == turn.policy_version and s.weight_version == turn.weight_version
    return mine


def wait_decided(streams: Streams, decided: int, trained: int, timeout: float = 120) -> None:
    """`decided` turns decided by the buffer in all (each counted once, closing turns too:
    they may reach it after their episode's other turns), `trained` samples in batches."""

    def done() -> bool:
        return sum(streams.counts().values()) >= decided and len(streams.samples()) >= trained

    wait_until(done, timeout, f"{decided} turns decided, {trained} samples in batches")


def test_episode_outcomes_reach_training_batches_with_their_advantage(
    settings: Settings, stack: Callable[..., ServiceProcess],
) -> None:
    keys = Keys(settings.redis.prefix)
    streams = Streams(settings.redis.url, keys)
    buffer = stack(OUTCOME_MODE="outcome", GROUP_ADVANTAGE="raw")

    # 1. outcome / raw: each real turn carries its own episode's R.
    raw = {**dict.fromkeys(run_group(settings, [0.75], 0), 0.75),
           **dict.fromkeys(run_group(settings, [0.25], 1), 0.25)}
    wait_until(lambda: set(raw) <= set(streams.outcomes()), 120, "the raw episodes' outcomes")
    first = [streams.outcomes()[j] for j in raw]
    wait_decided(streams, decided=6, trained=4)  # 2 episodes x (2 real turns + the closing one)
    for o in first:
        check_episode(streams, o, raw[o.id])
    assert streams.counts() == {"kept": 4, "no_next_state": 2}
    wait_until(lambda: streams.held() == 0, 30, "the episodes' turns released")
    assert buffer.stop() == 0, buffer.logs()

    # 2. outcome / group_norm, on the same stack with the buffer restarted.
    stack(OUTCOME_MODE="outcome", GROUP_ADVANTAGE="group_norm", GROUP_EPS=str(EPS))
    three = run_group(settings, [1.0, 0.5, 0.0], 0)  # mean 0.5, std sqrt((.25 + 0 + .25) / 2) = 0.5
    two = run_group(settings, [0.9, 0.3], 1)  # mean 0.6, std sqrt((.09 + .09) / 1) = 0.3 * sqrt(2)
    expected: dict[str, float | None] = {
        three[0]: 0.5 / (0.5 + EPS), three[1]: None, three[2]: -0.5 / (0.5 + EPS),  # A = 0: not trained
        two[0]: 0.3 / (0.3 * math.sqrt(2) + EPS), two[1]: -0.3 / (0.3 * math.sqrt(2) + EPS),
    }
    wait_until(lambda: set(expected) <= set(streams.outcomes()), 120, "the grouped episodes' outcomes")
    second = [streams.outcomes()[j] for j in expected]
    wait_decided(streams, decided=6 + 15, trained=4 + 8)
    for o in second:
        check_episode(streams, o, expected[o.id])
    assert streams.counts() == {"kept": 12, "no_next_state": 7, "zero_reward": 2}
    assert len(streams.samples()) == 12  # nothing else, nothing twice
    wait_until(lambda: streams.held() == 0, 30, "the episodes' turns released")
    assert int(streams.r.xlen(keys.dead)) == 0
