"""Environment workers (`python -m services.envs`) on real Redis: an episode end to end
through the real collector and engine, a worker SIGKILLed mid-episode, enqueuing twice,
and the exactly-once outcome publish."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from rq import Queue
from rq.job import JobStatus

from services.envs.base import load_tasks
from services.envs.outcomes import OutcomePublisher
from shared.envjobs import enqueue_episode, enqueue_run, new_group, task_json
from shared.keys import Keys
from shared.rqjobs import rq_connection, rq_job_id
from shared.schemas import Outcome, Turn, episode_job_id, episode_session_id
from shared.settings import Settings
from shared.streams import Bus
from tests.support.collector_harness import Turns, collector_process, engine_process, wait_ready
from tests.support.servers import REPO, ServiceProcess, free_port, wait_until
from tests.support.standin_policy import StandinPolicy
from tests.support.tool_model import ANSWER, CALL_ARGS, TOOL_RESULT

pytestmark = pytest.mark.integration

ECHO = "tests.support.echo_env:EchoEnv"
WEATHER = "tests.support.weather_env:WeatherEnv"
TIMING = {"NEXTSTATE_ENVS__HEARTBEAT_S": "1", "NEXTSTATE_ENVS__ABANDONED_AFTER_S": "3",
          "NEXTSTATE_ENVS__MAINTENANCE_S": "1"}


def outcomes(url: str, keys: Keys) -> list[Outcome]:
    client: Any = redis.Redis.from_url(url, decode_responses=True, socket_timeout=5)
    try:
        return [Outcome.from_json(f["data"]) for _, f in client.xrange(keys.outcomes)]
    finally:
        client.close()


@pytest.fixture
def start_worker(env: dict[str, str]) -> Iterator[Callable[..., ServiceProcess]]:
    procs: list[ServiceProcess] = []

    def start(policy_url: str, **extra: str) -> ServiceProcess:
        port = free_port()
        proc = ServiceProcess("envs", {**env, **TIMING, "NEXTSTATE_ENVS__URL": policy_url,
                                       "NEXTSTATE_ENVS__PORT": str(port), **extra}).start()
        procs.append(proc)
        proc.wait_http(f"http://127.0.0.1:{port}/healthz", timeout=60)
        return proc

    yield start
    for p in procs:
        p.stop()


def test_enqueue_twice_runs_once(settings: Settings) -> None:
    keys, run = Keys(settings.redis.prefix), settings.run
    task = load_tasks(ECHO, "train")[0]
    conn = rq_connection(settings.redis.url)
    try:
        group = new_group(0)
        first = enqueue_episode(conn, keys, run, ECHO, task.id, group, 0, 1, task=task_json(task), timeout_s=60,
                                retries=1)
        again = enqueue_episode(conn, keys, run, ECHO, task.id, group, 0, 1, task=task_json(task), timeout_s=60,
                                retries=1)
        assert first == again == episode_job_id(run, ECHO, task.id, group, 0)
        queue = Queue(keys.envs_queue, connection=conn)
        assert queue.job_ids == [rq_job_id(first)]
        job = queue.fetch_job(rq_job_id(first))
        assert job is not None and job.kwargs["task"]["task"]["id"] == task.id and job.kwargs["retries"] == 1
        # A whole run: N tasks x K episodes, each task its own group; twice with one invocation id = once.
        ids = enqueue_run(conn, keys, run, ECHO, 3, 2, timeout_s=60, retries=0, invocation="inv1")
        assert ids == enqueue_run(conn, keys, run, ECHO, 3, 2, timeout_s=60, retries=0, invocation="inv1")
        assert len(set(ids)) == 6 and queue.count == 7
        assert ids[0] == episode_job_id(run, ECHO, "train-0-0", "inv1-t0", 0)
    finally:
        conn.close()


async def test_outcome_published_once(settings: Settings) -> None:
    async with Bus(settings) as bus:
        publisher = OutcomePublisher(bus)
        job = episode_job_id(settings.run, "echo", "t0", "g", 0)
        first = Outcome(id=job, run=settings.run, env="echo", task_id="t0", group="g", reward=1.0, passed=True,
                        session_id=episode_session_id(job, 1, "aa"))
        rerun = first.model_copy(update={"session_id": episode_session_id(job, 2, "bb"), "attempt": 2})
        assert (await publisher.publish_once(first))[0] is True
        assert await publisher.publish_once(rerun) == (False, first.session_id)
        assert await publisher.published(job) == first.session_id
        assert await bus.redis.xlen(bus.keys.outcomes) == 1


def test_worker_killed_mid_episode_leaves_one_outcome(
    settings: Settings, start_worker: Callable[..., ServiceProcess],
) -> None:
    keys, run = Keys(settings.redis.prefix), settings.run
    task = load_tasks(ECHO, "train")[0]
    with StandinPolicy(latency_s=0.5, tool_turns=4) as policy:  # ~2.5 s per episode
        first = start_worker(policy.url)
        conn = rq_connection(settings.redis.url)
        try:
            job_id = enqueue_episode(conn, keys, run, ECHO, task.id, new_group(0), 0, 1, task=task_json(task),
                                     timeout_s=60, retries=2)
            wait_until(lambda: len(policy.requests) >= 2, 30, "the first attempt under way")
            assert first.proc is not None
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait(10)
            killed_at = time.monotonic()
            start_worker(policy.url)
            wait_until(lambda: len(outcomes(settings.redis.url, keys)) == 1, 60, "the rerun's outcome")
            rerun_after = time.monotonic() - killed_at
            (outcome,) = outcomes(settings.redis.url, keys)
            assert outcome.id == job_id and outcome.passed and outcome.reward == 1.0 and outcome.error is None
            assert outcome.attempt == 2 and outcome.steps == 5 and outcome.policy_versions == [7]
            sessions = list(dict.fromkeys(s.session_id for s in policy.requests))
            assert len(sessions) == 2 and outcome.session_id == sessions[1]  # a new session per attempt
            assert all(s.startswith(f"env:{job_id}.a") for s in sessions)
            queue = Queue(keys.envs_queue, connection=conn)
            rq_id = rq_job_id(job_id)
            # Finished, and nothing can run it a third time: it is neither queued nor in the
            # started registry (where every running job is, and the only place rq's
            # maintenance requeues from, and then only jobs still marked started).
            wait_until(lambda: (j := queue.fetch_job(rq_id)) is not None
                       and j.get_status() == JobStatus.FINISHED and rq_id not in queue.job_ids
                       and rq_id not in queue.started_job_registry.get_job_ids(cleanup=False),
                       10, "the job finished and nowhere to run again")  # fmt: skip
            assert len(outcomes(settings.redis.url, keys)) == 1
            assert len(set(s.session_id for s in policy.requests)) == 2
            print(f"SIGKILL -> outcome of the rerun after {rerun_after:.1f}s (heartbeat 1 s, abandoned after "
                  "3 s, maintenance 1 s, episode ~2.5 s)")
        finally:
            conn.close()


def test_a_stopped_worker_hands_its_episode_back(
    settings: Settings, start_worker: Callable[..., ServiceProcess],
) -> None:
    """SIGTERM mid-episode: past the grace, the episode goes back to the queue (no retry
    spent, even with none left) and the next worker runs it; one outcome."""
    keys, run = Keys(settings.redis.prefix), settings.run
    task = load_tasks(ECHO, "train")[0]
    with StandinPolicy(latency_s=0.5, tool_turns=4) as policy:
        first = start_worker(policy.url, NEXTSTATE_ENVS__SHUTDOWN_GRACE_S="0")
        conn = rq_connection(settings.redis.url)
        try:
            job_id = enqueue_episode(conn, keys, run, ECHO, task.id, new_group(0), 0, 1, task=task_json(task),
                                     timeout_s=60, retries=0)
            wait_until(lambda: len(policy.requests) >= 2, 30, "the first attempt under way")
            assert first.stop() == 0, first.logs()
            assert outcomes(settings.redis.url, keys) == []
            start_worker(policy.url)
            wait_until(lambda: len(outcomes(settings.redis.url, keys)) == 1, 60, "the outcome")
            (outcome,) = outcomes(settings.redis.url, keys)
            assert outcome.id == job_id and outcome.passed and outcome.error is None
            assert len({s.session_id for s in policy.requests}) == 2
        finally:
            conn.close()


def test_unreachable_policy_ends_with_an_error_outcome(
    settings: Settings, start_worker: Callable[..., ServiceProcess],
) -> None:
    keys, run = Keys(settings.redis.prefix), settings.run
    task = load_tasks(ECHO, "train")[0]
    start_worker(f"http://127.0.0.1:{free_port()}/v1", NEXTSTATE_ENVS__REQUEST_RETRIES="0")
    conn = rq_connection(settings.redis.url)
    try:
        job_id = enqueue_episode(conn, keys, run, ECHO, task.id, new_group(0), 0, 1, task=task_json(task),
                                 timeout_s=60, retries=1)
        wait_until(lambda: len(outcomes(settings.redis.url, keys)) == 1, 60, "the error outcome")
        (outcome,) = outcomes(settings.redis.url, keys)
        assert outcome.id == job_id and outcome.error and "PolicyUnavailable" in outcome.error
        assert outcome.reward == 0.0 and not outcome.passed and outcome.attempt == 2  # after one retry
    finally:
        conn.close()


def test_an_episode_past_its_job_timeout_ends_with_an_error_outcome(
    settings: Settings, start_worker: Callable[..., ServiceProcess],
) -> None:
    keys, run = Keys(settings.redis.prefix), settings.run
    task = load_tasks(ECHO, "train")[0]
    with StandinPolicy(latency_s=1.5, tool_turns=4) as policy:
        worker = start_worker(policy.url)
        conn = rq_connection(settings.redis.url)
        try:
            job_id = enqueue_episode(conn, keys, run, ECHO, task.id, new_group(0), 0, 1, task=task_json(task),
                                     timeout_s=2, retries=0)
            wait_until(lambda: len(outcomes(settings.redis.url, keys)) == 1, 30, "the error outcome")
            (outcome,) = outcomes(settings.redis.url, keys)
            assert outcome.id == job_id and outcome.error and "Timeout" in outcome.error and outcome.reward == 0
            queue = Queue(keys.envs_queue, connection=conn)
            wait_until(lambda: queue.failed_job_registry.get_job_ids() == [rq_job_id(job_id)], 10, "failed")
            health = httpx.get(f"http://127.0.0.1:{worker.env['NEXTSTATE_ENVS__PORT']}/healthz", timeout=5)
            assert health.status_code == 200  # the worker lives on
        finally:
            conn.close()


def test_the_ops_port_wants_the_internal_credential(start_worker: Callable[..., ServiceProcess]) -> None:
    token = "envs-test-internal-token"
    with StandinPolicy(latency_s=0.0, tool_turns=0) as policy:
        worker = start_worker(policy.url, NEXTSTATE_INTERNAL__TOKEN=token)
        base = f"http://127.0.0.1:{worker.env['NEXTSTATE_ENVS__PORT']}"
        denied = httpx.get(f"{base}/metrics", timeout=5)
        assert denied.status_code == 401 and "error" in denied.json()
        assert httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer wrong"}, timeout=5).status_code == 401
        ok = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=5)
        assert ok.status_code == 200 and "nextstate_envs_episodes_total" in ok.text
        assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200


# -- through the real collector and engine --------------------------------------------------------


def test_episode_through_the_collector_and_engine(
    tool_model: Path, env: dict[str, str], settings: Settings, start_worker: Callable[..., ServiceProcess],
) -> None:
    keys, run = Keys(settings.redis.prefix), settings.run
    engine = engine_process(tool_model)
    collector = collector_process(env, engine[1])
    try:
        wait_ready(engine, collector)
        start_worker(collector[1] + "/v1", NEXTSTATE_ENVS__TEMPERATURE="0", NEXTSTATE_ENVS__MAX_TOKENS="64")
        task = load_tasks(WEATHER, "train")[0]
        conn = rq_connection(settings.redis.url)
        try:
            job_id = enqueue_episode(conn, keys, run, WEATHER, task.id, new_group(0), 0, 1, task=task_json(task),
                                     timeout_s=120, retries=0)
        finally:
            conn.close()
        wait_until(lambda: len(outcomes(settings.redis.url, keys)) == 1, 120, "the outcome")
        (outcome,) = outcomes(settings.redis.url, keys)
        assert outcome.id == job_id and outcome.error is None, outcome
        assert outcome.passed and outcome.reward == 1.0 and outcome.steps == 2
        assert outcome.details["ended"] == "answered" and outcome.details["cities"] == [CALL_ARGS["city"]]
        assert outcome.session_id.startswith(f"env:{job_id}.a1.")
        turns = Turns(settings.redis.url, settings.redis.prefix)
        try:
            got: list[Turn] = sorted(turns.wait(lambda ts: len(ts) == 3, timeout=30, sessions=[outcome.session_id]),
                                     key=lambda t: t.turn_index)
        finally:
            turns.close()
        call, answer, closing = got
        assert [t.turn_index for t in got] == [0, 1, 2]
        assert call.response["tool_calls"][0]["function"]["name"] == "get_weather"
        assert call.closed_by == "next_request" and call.next_state is not None and len(call.next_state) == 1
        assert call.next_state[0]["role"] == "tool" and call.next_state[0]["content"] == TOOL_RESULT
        assert answer.response["content"] == ANSWER
        assert answer.next_state == [{"role": "user", "content": "The episode is over: the task's check passed."}]
        assert closing.closed_by == "session_done" and not closing.next_state
        assert outcome.policy_versions == [call.policy_version]
    finally:
        collector[0].stop()
        engine[0].stop()


def test_run_cli_summary(settings: Settings, env: dict[str, str], start_worker: Callable[..., ServiceProcess]) -> None:
    """`nextstate envs run` enqueues N x K episodes, waits for their outcomes, summarises."""
    with StandinPolicy(latency_s=0.05, tool_turns=1) as policy:
        start_worker(policy.url)
        start_worker(policy.url)
        out = subprocess.run(
            [sys.executable, "-m", "services.ctl", "envs", "run", ECHO, "--tasks", "2", "--group", "2",
             "--timeout", "60", "--json"],
            cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["episodes"] == 4 and summary["success_rate"] == 1.0 and summary["failures"] == 0
    assert summary["mean_steps"] == 2.0 and summary["episodes_per_s"] > 0
    assert len(outcomes(settings.redis.url, Keys(settings.redis.prefix))) == 4
