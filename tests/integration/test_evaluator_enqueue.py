"""Enqueuing evaluation jobs against a real Redis (shared/evaljobs.py): an id enqueued twice
is one rq job; a sample override is another; an asyncio client works the same; a caller
that died between the guard and the queue does not lose the job."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from rq import Queue

from shared.evaljobs import JOB_FUNCTION, PENDING, QUEUED, enqueue_eval, rq_connection, rq_job_id
from shared.keys import Keys
from shared.settings import Settings
from shared.streams import Bus

pytestmark = pytest.mark.integration


@pytest.fixture
def conn(redis_url: str) -> Iterator[redis.Redis]:
    c = rq_connection(redis_url)
    yield c
    c.close()


def queued(conn: redis.Redis, keys: Keys) -> list[str]:
    return Queue(keys.eval_queue, connection=conn).get_job_ids()


def test_enqueued_twice_is_one_job(conn: redis.Redis, settings: Settings) -> None:
    keys, run = Keys(settings.redis.prefix), settings.run
    first = enqueue_eval(conn, keys, run, 3, "demo", timeout_s=120.5, retries=2)
    again = enqueue_eval(conn, keys, run, 3, "demo", timeout_s=120.5, retries=2)
    assert first == again == f"eval.{run}.v000003.demo"
    assert queued(conn, keys) == [rq_job_id(first)]
    job = Queue(keys.eval_queue, connection=conn).fetch_job(rq_job_id(first))
    assert job is not None
    assert job.func_name == JOB_FUNCTION
    assert job.kwargs == {"run": run, "version": 3, "suite": "demo", "samples": None}
    assert job.timeout == 121 and job.retries_left == 2
    assert conn.get(keys.eval_enqueued(first)) == QUEUED.encode()
    assert 0 < conn.ttl(keys.eval_enqueued(first))  # the guard expires (versions never repeat)

    # A sample override is a job of its own, once too; another suite another job.
    bigger = enqueue_eval(conn, keys, run, 3, "demo", samples=256, timeout_s=120, retries=2)
    assert bigger == f"eval.{run}.v000003.demo.n256"
    assert enqueue_eval(conn, keys, run, 3, "demo", samples=256, timeout_s=120, retries=2) == bigger
    drift = enqueue_eval(conn, keys, run, 3, "drift", timeout_s=120, retries=0)
    assert queued(conn, keys) == [rq_job_id(first), rq_job_id(bigger), rq_job_id(drift)]
    override = Queue(keys.eval_queue, connection=conn).fetch_job(rq_job_id(bigger))
    assert override is not None and override.kwargs["samples"] == 256
    no_retry = Queue(keys.eval_queue, connection=conn).fetch_job(rq_job_id(drift))
    assert no_retry is not None and not no_retry.retries_left


def test_once_run_never_again(conn: redis.Redis, settings: Settings) -> None:
    """The guard outlives the rq job (whose hash expires after its result's TTL)."""
    keys, run = Keys(settings.redis.prefix), settings.run
    job_id = enqueue_eval(conn, keys, run, 4, "demo", timeout_s=60, retries=1)
    Queue(keys.eval_queue, connection=conn).empty()  # ran, and rq forgot it
    assert enqueue_eval(conn, keys, run, 4, "demo", timeout_s=60, retries=1) == job_id
    assert queued(conn, keys) == []


def test_a_caller_that_died_after_the_guard_does_not_lose_the_job(conn: redis.Redis, settings: Settings) -> None:
    keys, run = Keys(settings.redis.prefix), settings.run
    job_id = f"eval.{run}.v000005.demo"
    conn.set(keys.eval_enqueued(job_id), PENDING)  # set, then the dispatcher was SIGKILLed
    assert enqueue_eval(conn, keys, run, 5, "demo", timeout_s=60, retries=1) == job_id
    assert queued(conn, keys) == [rq_job_id(job_id)]
    assert conn.get(keys.eval_enqueued(job_id)) == QUEUED.encode()


async def test_an_asyncio_client_enqueues_the_same_way(conn: redis.Redis, settings: Settings) -> None:
    keys, run = Keys(settings.redis.prefix), settings.run
    async with Bus(settings) as bus:  # decode_responses=True: the sync twin reads binary
        first = await enqueue_eval(bus.redis, keys, run, 6, "demo", timeout_s=60, retries=2)
        again = await enqueue_eval(bus.redis, keys, run, 6, "demo", timeout_s=60, retries=2)
    assert first == again and queued(conn, keys) == [rq_job_id(first)]
