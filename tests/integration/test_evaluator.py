"""The evaluator against real processes: Redis, SeaweedFS, a tiny CPU engine as the
evaluation engine, and `python -m services.evaluator` as a user starts it.

A `CheckpointPublished` (as the trainer publishes it) leads to one `EvalResult` per suite
on `evals` and in the bucket, computed while the evaluation engine served the candidate;
publishing it again changes nothing. The base model (v0) is evaluated first, once per run;
a version not begun when a newer one is committed is skipped (a job asking for its own
samples never is). A worker SIGKILLed mid-job: its job runs again on
the next worker once rq counts it abandoned, and there is still one result. A worker
SIGTERMed mid-job hands the job back without spending a retry. Suites are test-only
`module:callable`s (tests/support/eval_suites.py); the engine and the evaluator run with
an internal token, as every deployment does.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rq import Queue
from rq.job import JobStatus

from shared import checkpoints as ckpt
from shared.auth import bearer
from shared.evaljobs import enqueue_eval, job_id_for, result_key, rq_connection, rq_job_id
from shared.keys import GROUP_EVALUATOR, Keys
from shared.schemas import CheckpointPublished, EvalResult
from shared.settings import Settings
from shared.store import Bucket
from shared.streams import Bus
from tests.support.eval_suites import MARKS_VAR, attempts
from tests.support.servers import ServiceProcess, free_port
from tests.support.tiny_model import build_tiny_model
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

TOKEN = "evaluator-test-internal-token"
AUTH = bearer(TOKEN)
SERVED = "tests.support.eval_suites:served"
SERVED_AGAIN = "tests.support.eval_suites:served_again"
SLOW = "tests.support.eval_suites:slow"
# Fast failure detection for the tests: heartbeats every second, a job without one for 4 s
# is abandoned, idle workers look for such jobs every second.
TIMING = {"NEXTSTATE_EVAL__HEARTBEAT_S": "1", "NEXTSTATE_EVAL__ABANDONED_AFTER_S": "4",
          "NEXTSTATE_EVAL__MAINTENANCE_S": "1"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("evaluator-models")
    return {name: build_tiny_model(root / name, seed=seed) for name, seed in (("base", 1), ("candidate", 2))}


@pytest.fixture(scope="module")
def eval_engine(models: dict[str, Path]) -> Iterator[str]:
    """The evaluation engine: the CPU engine on the base model. Tests use distinct versions
    (it reports only the version number it serves)."""
    port = free_port()
    proc = ServiceProcess("engine", {"NEXTSTATE_ENV": "test", "NEXTSTATE_INTERNAL__TOKEN": TOKEN},
                          ["--model", str(models["base"]), "--port", str(port)]).start()
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=180)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


@pytest.fixture
def start_evaluator(eval_engine: str, s3_env: dict[str, str], tmp_path: Path
                    ) -> Iterator[Callable[..., ServiceProcess]]:
    started: list[ServiceProcess] = []

    def start(suites: list[str], **extra: str) -> ServiceProcess:
        env = {
            **s3_env, **TIMING,
            "NEXTSTATE_INTERNAL__TOKEN": TOKEN,
            "NEXTSTATE_EVAL__ENGINE_URL": eval_engine,
            "NEXTSTATE_EVAL__SUITES": json.dumps(suites),
            "NEXTSTATE_EVAL__LOCAL_DIR": str(tmp_path / "eval-checkpoints"),
            "NEXTSTATE_EVAL__PORT": str(free_port()),
            "NEXTSTATE_EVAL__CONSUMER_NAME": "evaluator-test",
            "NEXTSTATE_EVAL__JOB_TIMEOUT_S": "300",
            "NEXTSTATE_EVAL__RETRIES": "2",
            MARKS_VAR: str(tmp_path / "marks"),
            **extra,
        }
        proc = ServiceProcess("evaluator", env).start()
        started.append(proc)
        proc.wait_http(ops_url(proc, "readyz"), timeout=90)
        return proc

    yield start
    for proc in started:
        proc.kill()


def ops_url(proc: ServiceProcess, path: str) -> str:
    return f"http://127.0.0.1:{proc.env['NEXTSTATE_EVAL__PORT']}/{path}"


def status(proc: ServiceProcess, path: str) -> int:
    """The status of an ops request without a credential."""
    return httpx.get(ops_url(proc, path), timeout=10).status_code


def metric(proc: ServiceProcess, name: str, **labels: str) -> float | None:
    text = httpx.get(ops_url(proc, "metrics"), headers=AUTH, timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def readyz(proc: ServiceProcess) -> dict[str, str]:
    return dict(httpx.get(ops_url(proc, "readyz"), timeout=10).json()["checks"])


def weight_version(url: str) -> str:
    return str(httpx.get(f"{url}/model_info", headers=AUTH, timeout=10).json()["weight_version"])


async def commit(bucket: Bucket, bus: Bus, run: str, version: int, models: dict[str, Path]) -> CheckpointPublished:
    """What the trainer does: the version to the bucket, then its announcement."""
    ckpt.publish_checkpoint(bucket, run, version, models["candidate"], step=version,
                            base_model=str(models["base"]))
    msg = CheckpointPublished(run=run, version=version, step=version, manifest=ckpt.manifest_key(run, version))
    await bus.publish("checkpoints", msg)
    return msg


async def results(bus: Bus, at_least: int = 1) -> list[EvalResult] | None:
    rows = await bus.redis.xrange(bus.keys.evals)
    got = [EvalResult.from_json(f["data"]) for _, f in rows]
    return got if len(got) >= at_least else None


async def all_handled(bus: Bus) -> bool:
    """The evaluator's group has read and acknowledged every checkpoint announcement."""
    groups = await bus.redis.xinfo_groups(bus.keys.checkpoints)
    g = next((g for g in groups if g["name"] == GROUP_EVALUATOR), None)
    return g is not None and int(g["pending"]) == 0 and g["lag"] == 0


def stored(bucket: Bucket, run: str) -> dict[str, EvalResult]:
    return {o.key: EvalResult.model_validate_json(bucket.get_bytes(o.key))
            for o in bucket.list(ckpt.evals_prefix(run), recursive=True)}


async def test_each_committed_version_is_evaluated_once_per_suite(
    s3_settings: Settings, eval_engine: str, start_evaluator: Callable[..., ServiceProcess],
    models: dict[str, Path],
) -> None:
    run, keys = s3_settings.run, Keys(s3_settings.redis.prefix)
    # An idle worker's blocking dequeue lasts MAINTENANCE_S: longer than Redis's default 5 s
    # socket timeout here, which the worker's reads must outwait.
    evaluator = start_evaluator([SERVED, SERVED_AGAIN], NEXTSTATE_EVAL__MAINTENANCE_S="7")
    with Bucket(s3_settings.bucket) as bucket:
        async with Bus(s3_settings) as bus:
            msg = await commit(bucket, bus, run, 1, models)
            got = await eventually(lambda: results(bus, 2), timeout=120, what="one result per suite")
            assert sorted(r.id for r in got) == sorted(job_id_for(run, 1, s) for s in (SERVED, SERVED_AGAIN))
            for r in got:
                # The suite saw the candidate in the evaluation engine: it scores 1 only then.
                assert (r.run, r.version, r.score, r.n) == (run, 1, 1.0, 1), r
                assert r.tasks[0].details["weight_version"] == "1"
                assert (r.ci_low, r.ci_high) == (0.0, 1.0) and r.duration_s > 0
                assert r.engine == eval_engine and r.worker.startswith(f"{keys.eval_queue}.evaluator-test.")
                assert r.tasks[0].details["samples"] == 128  # the default n
            assert weight_version(eval_engine) == "1"
            # The same results in the bucket, one object per suite.
            in_bucket = stored(bucket, run)
            assert in_bucket == {result_key(run, 1, r.suite): r for r in got}

            # The trainer announces v1 again (its own retry: a new message), and the first
            # message is redelivered: nothing is evaluated twice.
            await bus.publish("checkpoints", CheckpointPublished(run=run, version=1, manifest=msg.manifest))
            await bus.publish_raw("checkpoints", msg.to_json())
            await eventually(lambda: all_handled(bus), timeout=30, what="every announcement handled")
            conn = rq_connection(s3_settings.redis.url)
            try:
                queue = Queue(keys.eval_queue, connection=conn)
                assert queue.get_job_ids() == [] and queue.started_job_registry.get_job_ids() == []
                for r in got:
                    job = queue.fetch_job(rq_job_id(r.id))
                    assert job is not None and job.get_status() == JobStatus.FINISHED
                    assert job.return_value() == {"id": r.id, "score": 1.0, "n": 1}
            finally:
                conn.close()
            assert len(await results(bus) or []) == 2
            assert len(stored(bucket, run)) == 2

    # Its ops port: /metrics only with the internal credential, the probe open.
    assert status(evaluator, "metrics") == 401 and status(evaluator, "healthz") == 200
    for suite in (SERVED, SERVED_AGAIN):
        assert metric(evaluator, "nextstate_eval_score", suite=suite) == 1.0
        assert metric(evaluator, "nextstate_eval_jobs_total", suite=suite, outcome="ok") == 1.0
        assert metric(evaluator, "nextstate_eval_duration_seconds_count", suite=suite) == 1.0
    assert metric(evaluator, "nextstate_eval_version") == 1.0
    assert readyz(evaluator) == {"redis": "ok", "bucket": "ok", "engine": "ok"}
    # Idle now: each time a blocking dequeue ends the worker heartbeats; two heartbeats
    # mean one whole dequeue went by.
    conn = rq_connection(s3_settings.redis.url)
    worker_key = f"rq:worker:{got[0].worker}"
    try:
        beats: set[bytes] = set()

        def beat_twice() -> bool:
            beats.add(conn.hget(worker_key, "last_heartbeat") or b"")
            return len(beats) >= 3

        await eventually(beat_twice, timeout=30, interval=0.2, what="a whole idle dequeue")
    finally:
        conn.close()
    assert evaluator.stop() == 0, evaluator.logs()
    assert "could not connect" not in evaluator.logs(100_000) and "Traceback" not in evaluator.logs(100_000)


async def test_a_worker_killed_mid_job_leaves_one_result(
    s3_settings: Settings, eval_engine: str, start_evaluator: Callable[..., ServiceProcess],
    models: dict[str, Path], tmp_path: Path,
) -> None:
    run, keys = s3_settings.run, Keys(s3_settings.redis.prefix)
    marks = tmp_path / "marks"
    first = start_evaluator([SLOW])
    with Bucket(s3_settings.bucket) as bucket:
        async with Bus(s3_settings) as bus:
            await commit(bucket, bus, run, 7, models)
            await eventually(lambda: attempts(marks, run, 7), timeout=60, what="the first attempt")
            conn = rq_connection(s3_settings.redis.url)
            queue = Queue(keys.eval_queue, connection=conn)
            job_id = job_id_for(run, 7, SLOW)
            try:
                assert queue.started_job_registry.get_job_ids() == [rq_job_id(job_id)]
                assert first.proc is not None
                first.proc.send_signal(signal.SIGKILL)
                first.proc.wait(10)
                killed_at = time.time()
                second = start_evaluator([SLOW])
                got = await eventually(lambda: results(bus), timeout=60, what="the result of the rerun")
                tries = attempts(marks, run, 7)
                rerun_after = float(tries[1].read_text()) - killed_at
                print(f"SIGKILL -> rerun started after {rerun_after:.1f}s (heartbeat 1s, abandoned "
                      f"after 4s, maintenance every 1s)")
                assert len(tries) == 2 and tries[0].name.split("-")[-1] != tries[1].name.split("-")[-1]
                assert rerun_after < 4 + 2 * 1 + 10  # abandoned + 2 maintenance, + the new worker's start
                assert await bus.redis.xlen(bus.keys.evals) == 1  # exactly one entry
                (result,) = got
                assert result.id == job_id and result.score == 1.0 and result.version == 7
                assert list(stored(bucket, run)) == [result_key(run, 7, SLOW)]
                job = queue.fetch_job(rq_job_id(job_id))
                assert job is not None and job.get_status() == JobStatus.FINISHED
                assert job.retries_left == 1  # one retry spent on the dead worker's attempt
            finally:
                conn.close()
    assert second.stop() == 0, second.logs()


async def test_a_stopped_worker_hands_its_job_back(
    s3_settings: Settings, start_evaluator: Callable[..., ServiceProcess], models: dict[str, Path],
    tmp_path: Path,
) -> None:
    run, keys = s3_settings.run, Keys(s3_settings.redis.prefix)
    marks = tmp_path / "marks"
    first = start_evaluator([SLOW], NEXTSTATE_EVAL__SHUTDOWN_GRACE_S="1")
    with Bucket(s3_settings.bucket) as bucket:
        async with Bus(s3_settings) as bus:
            await commit(bucket, bus, run, 9, models)
            await eventually(lambda: attempts(marks, run, 9), timeout=60, what="the first attempt")
            t0 = time.monotonic()
            assert first.stop(timeout=30) == 0, first.logs()  # SIGTERM
            assert time.monotonic() - t0 < 15
            conn = rq_connection(s3_settings.redis.url)
            queue = Queue(keys.eval_queue, connection=conn)
            job_id = job_id_for(run, 9, SLOW)
            try:
                assert queue.get_job_ids() == [rq_job_id(job_id)]  # back in the queue at once
                job = queue.fetch_job(rq_job_id(job_id))
                assert job is not None and job.retries_left == 2  # no retry spent
                assert await results(bus) is None
                second = start_evaluator([SLOW])
                (result,) = await eventually(lambda: results(bus), timeout=60, what="the result")
                assert result.id == job_id and result.score == 1.0
                assert len(attempts(marks, run, 9)) == 2
            finally:
                conn.close()
    assert second.stop() == 0, second.logs()
    assert "handed back" in first.logs(20000)


async def test_a_version_pruned_before_its_turn_is_skipped_not_retried(
    s3_settings: Settings, start_evaluator: Callable[..., ServiceProcess],
) -> None:
    """Announced, then gone from the bucket (the trainer's retention, gate off): the job
    ends at once — no result, no retry, no traceback — and is counted `gone`."""
    run, keys = s3_settings.run, Keys(s3_settings.redis.prefix)
    evaluator = start_evaluator([SERVED])
    async with Bus(s3_settings) as bus:
        await bus.publish("checkpoints", CheckpointPublished(run=run, version=7, step=7,
                                                             manifest=ckpt.manifest_key(run, 7)))
        conn = rq_connection(s3_settings.redis.url)
        try:
            queue = Queue(keys.eval_queue, connection=conn)
            job_id = rq_job_id(job_id_for(run, 7, SERVED))

            def finished() -> bool:
                job = queue.fetch_job(job_id)
                return job is not None and job.get_status() == JobStatus.FINISHED

            await eventually(finished, timeout=60, what="the job finished")
            job = queue.fetch_job(job_id)
            assert job is not None and job.return_value()["skipped"]  # type: ignore[index]
            assert queue.failed_job_registry.get_job_ids() == []
        finally:
            conn.close()
        assert await results(bus, 0) == []
    assert metric(evaluator, "nextstate_eval_jobs_total", suite=SERVED, outcome="gone") == 1.0
    assert evaluator.stop() == 0, evaluator.logs()
    assert "Traceback" not in evaluator.logs(100_000)


async def test_the_base_first_then_only_the_newest_version(
    s3_settings: Settings, eval_engine: str, start_evaluator: Callable[..., ServiceProcess],
    models: dict[str, Path],
) -> None:
    run, keys = s3_settings.run, Keys(s3_settings.redis.prefix)
    with Bucket(s3_settings.bucket) as bucket:
        async with Bus(s3_settings) as bus:
            # Two versions committed before the evaluator comes up: its dispatcher enqueues
            # v0 (the base), v21, v22 in that order; v21 has not begun when v22 exists.
            await commit(bucket, bus, run, 21, models)
            await commit(bucket, bus, run, 22, models)
            evaluator = start_evaluator([SERVED], NEXTSTATE_EVAL__BASE_MODEL=str(models["base"]))
            got = await eventually(lambda: results(bus, 2), timeout=120, what="two results")
            assert [(r.version, r.score) for r in got] == [(0, 1.0), (22, 1.0)]  # each was served
            assert got[0].tasks[0].details["weight_version"] == "0"
            conn = rq_connection(s3_settings.redis.url)
            try:
                queue = Queue(keys.eval_queue, connection=conn)

                def done(job_id: str) -> object:
                    job = queue.fetch_job(rq_job_id(job_id))
                    return job.return_value() if job is not None and job.is_finished else None

                skipped = await eventually(lambda: done(job_id_for(run, 21, SERVED)), 30, "v21's job")
                assert skipped["skipped"] == "v22 was committed before the evaluation of v21 began"
                # Asked for by hand (`nextstate eval run 21 --samples 5`): evaluated all the same.
                enqueue_eval(conn, keys, run, 21, SERVED, samples=5, timeout_s=300, retries=0)
            finally:
                conn.close()
            again = await eventually(lambda: results(bus, 3), timeout=60, what="v21 on request")
            assert (again[-1].version, again[-1].tasks[0].details["samples"]) == (21, 5)
            assert sorted(o.key for o in bucket.list(ckpt.evals_prefix(run))) == sorted(
                result_key(run, v, SERVED) for v in (0, 21, 22))
    assert metric(evaluator, "nextstate_eval_jobs_total", suite=SERVED, outcome="skipped") == 1.0
    assert evaluator.stop() == 0, evaluator.logs()

    # Started again on the same run: the base was evaluated already, and is not again.
    evaluator = start_evaluator([SERVED], NEXTSTATE_EVAL__BASE_MODEL=str(models["base"]))
    assert "baseline already evaluated" in evaluator.logs(20_000) or await eventually(
        lambda: "baseline already evaluated" in evaluator.logs(20_000), 30, "the baseline found")
    async with Bus(s3_settings) as bus:
        assert len(await results(bus) or []) == 3
    assert evaluator.stop() == 0, evaluator.logs()
