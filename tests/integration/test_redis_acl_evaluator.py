"""The `evaluator` Redis ACL user against a real redis-server (services/ctl/redis_acl.py).

As that user, the evaluator's own code runs: the dispatcher (a consumer of `checkpoints`
in group `evaluator`, enqueuing through shared/evaljobs.py), results published on
`evals`, dead letters, and its rq worker (shared/rqworker.py) through every
path rq takes — a job that succeeds, one that fails and is retried, and one whose worker
is SIGKILLed mid-job, requeued by another worker's maintenance and run again. Then what
the role must not do is refused (NOPERM): other streams, other rq queues and jobs, INFO,
Pub/Sub. The operator (`ctl`) may enqueue evaluations, and do nothing else in rq's keys.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from redis.exceptions import ResponseError
from rq import Queue
from rq.job import JobStatus

from services.ctl import redis_acl
from services.evaluator import jobs
from shared import keys as K
from shared.consumer import Consumer, Delivery
from shared.evaljobs import enqueue_eval, job_id_for, rq_connection, rq_job_id
from shared.rqworker import RqWorker as EvalWorker
from shared.schemas import CheckpointPublished, EvalResult
from tests.integration.test_redis_acl import DENIED, Acl, acked, acl, acl_port, denied  # noqa: F401  (fixtures)
from tests.support.servers import REPO, wait_until
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration


def refused(call: Callable[[], Any]) -> str:
    """`call()` (a sync client's command) fails because the ACL refuses it."""
    try:
        call()
    except ResponseError as exc:
        assert DENIED.search(str(exc)), f"failed, but not for permissions: {exc}"
        return str(exc)
    raise AssertionError("allowed, should have been refused")


class StandIn:
    """The evaluator's runtime, as far as `run_eval` sees it: records, fails when told."""

    def __init__(self, fail_first: set[str] | None = None) -> None:
        self.calls: list[str] = []
        self.fail_first = set(fail_first or ())

    def run_job(self, job_id: str, run: str, version: int, suite: str, samples: int | None) -> dict[str, Any]:
        self.calls.append(job_id)
        if job_id in self.fail_first:
            self.fail_first.discard(job_id)
            raise RuntimeError("the evaluation engine went away")
        return {"id": job_id, "score": 1.0, "n": 1}


@contextmanager
def own_signals() -> Iterator[None]:
    """rq's worker installs SIGINT/SIGTERM handlers: give pytest its own back afterwards."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def burst(conn: redis.Redis, queue: str, name: str) -> None:
    """One worker as the evaluator runs it: every queued job, then exit."""
    worker = EvalWorker([queue], connection=conn, name=f"{queue}.{name}", heartbeat_s=1,
                        abandoned_after_s=2, maintenance_s=1)
    with own_signals():
        worker.work(burst=True, logging_level="WARNING")


async def test_the_evaluator_dispatches_runs_jobs_and_publishes_results(acl: Acl) -> None:  # noqa: F811
    trainer, evaluator, k = acl.bus("trainer"), acl.bus("evaluator"), acl.keys
    admin = acl.bus(redis_acl.ADMIN).redis
    conn = rq_connection(acl.url("evaluator"))  # HELLO, not INFO, tells rq the version
    run = f"run-{acl.prefix}"
    suites = ("demo", "drift")

    async def dispatch(msg: CheckpointPublished, d: Delivery) -> None:  # the runtime's handler
        for suite in suites:
            await asyncio.to_thread(enqueue_eval, conn, k, msg.run, msg.version, suite, timeout_s=60, retries=2)

    consumer = Consumer(evaluator, K.CHECKPOINTS, K.GROUP_EVALUATOR, CheckpointPublished, dispatch,
                        name="evaluator-0")
    task = asyncio.create_task(consumer.run())
    for version in (1, 2, 2):  # v2 announced twice: enqueued once
        await trainer.publish(K.CHECKPOINTS, CheckpointPublished(run=run, version=version, manifest="m"))
    await admin.xadd(k.checkpoints, {"data": "not json"})  # dead-lettered
    await eventually(lambda: acked(admin, k.checkpoints, K.GROUP_EVALUATOR), what="announcements handled")
    consumer.stop()
    await asyncio.wait_for(task, 10)
    assert await admin.xlen(k.dead) == 1
    queue = Queue(k.eval_queue, connection=conn)
    ids = [job_id_for(run, v, s) for v in (1, 2) for s in suites]
    assert sorted(queue.get_job_ids()) == sorted(rq_job_id(i) for i in ids)

    # The worker: three succeed, one fails once and is retried.
    stand_in = StandIn(fail_first={ids[1]})
    jobs.install_runtime(stand_in)  # type: ignore[arg-type]
    try:
        burst(conn, k.eval_queue, "a")
    finally:
        jobs.install_runtime(None)
    assert sorted(stand_in.calls) == sorted([*ids, ids[1]])
    for i in ids:
        job = queue.fetch_job(rq_job_id(i))
        assert job is not None and job.get_status() == JobStatus.FINISHED, i
    assert await evaluator.publish(K.EVALS, EvalResult(id=ids[0], run=run, version=1, suite="demo",
                                                       score=1.0)) is not None
    assert await admin.xlen(k.evals) == 1

    # A worker SIGKILLed mid-job (as the evaluator user, in a process of its own); another
    # worker's maintenance requeues it once abandoned, and runs it.
    job_id = enqueue_eval(conn, k, run, 3, "demo", timeout_s=60, retries=2)
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from services.evaluator import jobs
        from shared.rqworker import RqWorker as EvalWorker
        from shared.evaljobs import rq_connection

        class Hangs:
            def run_job(self, *args):
                print("started", flush=True)
                time.sleep(600)

        jobs.install_runtime(Hangs())
        conn = rq_connection({acl.url("evaluator")!r})
        EvalWorker([{k.eval_queue!r}], connection=conn, name={k.eval_queue + ".doomed"!r}, heartbeat_s=1,
                   abandoned_after_s=2, maintenance_s=1).work(logging_level="WARNING")
        """)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"started"
        assert queue.started_job_registry.get_job_ids() == [rq_job_id(job_id)]
    finally:
        child.kill()
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
    wait_until(lambda: bool(queue.started_job_registry.get_expired_job_ids()), 10, "the job abandoned")
    stand_in = StandIn()
    jobs.install_runtime(stand_in)  # type: ignore[arg-type]
    try:
        burst(conn, k.eval_queue, "b")  # its maintenance requeues the job, then runs it
    finally:
        jobs.install_runtime(None)
    assert stand_in.calls == [job_id]
    job = queue.fetch_job(rq_job_id(job_id))
    assert job is not None and job.get_status() == JobStatus.FINISHED and job.retries_left == 1
    conn.close()


async def test_the_evaluator_may_not_touch_what_is_not_its_own(acl: Acl) -> None:  # noqa: F811
    evaluator, k = acl.bus("evaluator"), acl.keys
    conn = rq_connection(acl.url("evaluator"))
    try:
        # Other streams: no writing turns, batches or checkpoints; results are written, never read.
        await denied(evaluator.redis.xadd(k.turns, {"data": "x"}))
        await denied(evaluator.redis.xadd(k.batches, {"data": "x"}))
        await denied(evaluator.redis.xadd(k.checkpoints, {"data": "x"}))
        await denied(evaluator.redis.xrange(k.evals))
        await denied(evaluator.redis.xrange(k.policy))
        await denied(evaluator.redis.xadd(k.promotions, {"data": "x"}))
        await denied(evaluator.redis.set(k.policy_version, 1))
        await denied(evaluator.redis.set(k.done(K.GROUP_JUDGE, "m"), 1))
        # Other rq queues, jobs and workers: not its own.
        refused(lambda: conn.rpush("rq:queue:someone-else", "x"))
        refused(lambda: conn.hset("rq:job:not-an-evaluation", "status", "queued"))
        refused(lambda: conn.zadd("rq:wip:someone-else", {"x": 1}))
        refused(lambda: conn.hset("rq:worker:someone-else.w", "state", "idle"))
        refused(lambda: conn.set("rq:suspended", 1))  # suspending workers is the operator's
        refused(lambda: conn.keys("rq:*"))
        refused(lambda: conn.info())
        refused(lambda: conn.publish(f"rq:pubsub:{k.eval_queue}.x", "{}"))
        refused(lambda: conn.execute_command("SUBSCRIBE", f"rq:pubsub:{k.eval_queue}.x"))
        refused(lambda: conn.flushall())
    finally:
        conn.close()


async def test_the_operator_may_enqueue_evaluations_and_nothing_more_in_rq(acl: Acl) -> None:  # noqa: F811
    k = acl.keys
    ctl = rq_connection(acl.url("ctl"))  # `nextstate eval run`
    admin = rq_connection(acl.url(redis_acl.ADMIN))
    try:
        job_id = enqueue_eval(ctl, k, f"run-{acl.prefix}", 5, "demo", samples=128, timeout_s=60, retries=1)
        assert enqueue_eval(ctl, k, f"run-{acl.prefix}", 5, "demo", samples=128, timeout_s=60, retries=1) == job_id
        assert Queue(k.eval_queue, connection=admin).get_job_ids() == [rq_job_id(job_id)]
        refused(lambda: ctl.lrange(f"rq:queue:{k.eval_queue}", 0, -1))  # running jobs is the evaluator's
        refused(lambda: ctl.hset(f"rq:worker:{k.eval_queue}.x", "state", "idle"))
        refused(lambda: ctl.zadd(f"rq:wip:{k.eval_queue}", {"x": 1}))
    finally:
        ctl.close()
        admin.close()


async def test_a_busy_workers_heartbeats_push_its_jobs_deadline(acl: Acl) -> None:  # noqa: F811
    """As the evaluator: while a job runs, its StartedJobRegistry score (the moment it
    counts as abandoned) keeps moving forward."""
    k = acl.keys
    conn = rq_connection(acl.url("evaluator"))
    enqueue_eval(conn, k, f"run-{acl.prefix}", 8, "demo", timeout_s=60, retries=1)
    deadlines: list[float] = []

    class Slow:
        def run_job(self, *args: Any) -> dict[str, Any]:
            for _ in range(8):
                deadlines.extend(score for _, score in conn.zrange(f"rq:wip:{k.eval_queue}", 0, -1, withscores=True))
                time.sleep(0.5)
            return {}

    jobs.install_runtime(Slow())  # type: ignore[arg-type]
    try:
        burst(conn, k.eval_queue, "c")
    finally:
        jobs.install_runtime(None)
        conn.close()
    assert deadlines == sorted(deadlines) and len(set(deadlines)) >= 3
    assert deadlines[-1] - deadlines[0] >= 2
