"""The `envs` Redis ACL user against a real redis-server (services/ctl/redis_acl.py).

A real envs worker (`python -m services.envs`) runs as that user: its rq worker takes
episodes the operator (`ctl`, as `nextstate envs run` does) enqueued, a worker SIGKILLed
mid-episode leaves its job to another's maintenance, and each episode's outcome is
published once. `nextstate envs status` reads the queue as `ctl`. What the role must not
do is refused (NOPERM): the loop's streams and keys, other rq queues and jobs, INFO.
KEDA's user reads the queue's length and nothing else of rq's.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.exceptions import ResponseError

from services.ctl.envs import queue_status
from shared.envjobs import enqueue_run
from shared.rqjobs import rq_connection
from shared.schemas import Outcome
from tests.integration.test_redis_acl import DENIED, Acl, acl, acl_port  # noqa: F401  (fixtures)
from tests.support.servers import ServiceProcess, free_port, wait_until
from tests.support.standin_policy import StandinPolicy

pytestmark = pytest.mark.integration

ECHO = "tests.support.echo_env:EchoEnv"


def refused(call: Any) -> None:
    try:
        call()
    except ResponseError as exc:
        assert DENIED.search(str(exc)), f"failed, but not for permissions: {exc}"
        return
    raise AssertionError("allowed, should have been refused")


@pytest.fixture
def policy() -> Iterator[StandinPolicy]:
    with StandinPolicy(latency_s=0.3, tool_turns=2) as p:
        yield p


def worker(a: Acl, policy: StandinPolicy, **extra: str) -> ServiceProcess:
    port = free_port()
    proc = ServiceProcess("envs", {
        "NEXTSTATE_ENV": "test", "NEXTSTATE_RUN": f"run-{a.prefix}", "NEXTSTATE_REDIS__URL": a.url("envs"),
        "NEXTSTATE_REDIS__PREFIX": a.prefix, "NEXTSTATE_ENVS__URL": policy.url, "NEXTSTATE_ENVS__PORT": str(port),
        "NEXTSTATE_ENVS__HEARTBEAT_S": "1", "NEXTSTATE_ENVS__ABANDONED_AFTER_S": "2",
        "NEXTSTATE_ENVS__MAINTENANCE_S": "1", **extra,
    }).start()
    proc.wait_http(f"http://127.0.0.1:{port}/readyz", timeout=60)
    return proc


def test_the_envs_user_runs_episodes_and_publishes_outcomes(acl: Acl, policy: StandinPolicy) -> None:  # noqa: F811
    k, run = acl.keys, f"run-{acl.prefix}"
    ctl = rq_connection(acl.url("ctl"))
    admin: Any = redis.Redis.from_url(acl.url("default"), decode_responses=True)
    first = worker(acl, policy)
    second: ServiceProcess | None = None
    try:
        ids = enqueue_run(ctl, k, run, ECHO, 2, 2, timeout_s=60, retries=2)
        wait_until(lambda: len(policy.requests) >= 1, 30, "an episode under way")
        assert first.proc is not None
        first.proc.send_signal(signal.SIGKILL)  # mid-episode: its job is rerun by the next worker
        first.proc.wait(10)
        second = worker(acl, policy)
        wait_until(lambda: admin.xlen(k.outcomes) >= 4, 90, "four outcomes")
        outcomes = [Outcome.from_json(f["data"]) for _, f in admin.xrange(k.outcomes)]
        assert sorted(o.id for o in outcomes) == sorted(ids)  # each once
        assert all(o.passed and o.error is None for o in outcomes)
        assert any(o.attempt == 2 for o in outcomes)
        ctl_text: Any = redis.Redis.from_url(acl.url("ctl"), decode_responses=True)
        status = queue_status(ctl_text, k)
        ctl_text.close()
        assert status["queued"] == 0 and status["outcomes"] == 4 and len(status["workers"]) >= 1
    finally:
        for p in (first, second):
            if p is not None:
                p.stop()
        ctl.close()
        admin.close()
    # What the envs user may not do.
    envs: Any = redis.Redis.from_url(acl.url("envs"), decode_responses=True)
    refused(lambda: envs.xadd(k.turns, {"data": "x"}))
    refused(lambda: envs.xrange(k.scored))
    refused(lambda: envs.xrange(k.outcomes))  # it publishes outcomes, never reads them
    refused(lambda: envs.set(k.policy_version, "1"))
    refused(lambda: envs.lpush(f"rq:queue:{k.eval_queue}", "x"))
    refused(lambda: envs.hgetall("rq:job:eval_2ex"))
    refused(lambda: envs.info())
    envs.close()
    keda: Any = redis.Redis.from_url(acl.url("keda"), decode_responses=True)
    assert keda.llen(f"rq:queue:{k.envs_queue}") == 0
    refused(lambda: keda.lrange(f"rq:queue:{k.envs_queue}", 0, -1))
    refused(lambda: keda.llen(f"rq:queue:{k.eval_queue}"))
    keda.close()


async def test_evaluation_episodes_under_the_evaluator_and_envs_users(acl: Acl, policy: StandinPolicy) -> None:  # noqa: F811
    """The `env:<name>` suite as the `evaluator` user (enqueue at the front, count workers,
    read results) and its episodes run by a worker as `envs` (write the results only)."""
    from services.evaluator.settings import EvalConfig
    from services.evaluator.suite import EvalContext
    from services.evaluator.suites import resolve
    from shared.settings import Settings
    from shared.streams import Bus

    k, run = acl.keys, f"run-{acl.prefix}"
    engine = policy.url.removesuffix("/v1")  # the stand-in plays the evaluation engine
    proc = worker(acl, policy, NEXTSTATE_ENVS__EVAL_ENGINES=f'["{engine}"]')
    settings = Settings(env="test", run=run, redis={"url": acl.url("evaluator"), "prefix": acl.prefix})  # type: ignore[arg-type]
    try:
        async with Bus(settings) as bus:
            ctx = EvalContext(run=run, version=3, engine_url=engine, headers={}, tokenizer="", base_model="",
                              cfg=EvalConfig(samples=1, job_timeout_s=60), bus=bus)
            outcome = await resolve(f"env:{ECHO}")(ctx)
            assert (outcome.score, outcome.n) == (1.0, 1) and outcome.tasks[0].task == f"{ECHO}/echo-3"
    finally:
        proc.stop()
    evaluator: Any = redis.Redis.from_url(acl.url("evaluator"), decode_responses=True)
    refused(lambda: evaluator.hset(k.eval_episodes("x"), "a", "1"))  # results come from the workers only
    refused(lambda: evaluator.lrange(f"rq:queue:{k.envs_queue}", 0, -1))
    evaluator.close()
    envs: Any = redis.Redis.from_url(acl.url("envs"), decode_responses=True)
    refused(lambda: envs.hgetall(k.eval_episodes("x")))
    envs.close()
