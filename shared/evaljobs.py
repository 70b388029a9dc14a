"""Evaluation jobs on rq: enqueue one suite on one version, exactly once.

    job_id = enqueue_eval(redis, keys, run, 42, "demo", timeout_s=900, retries=2)
    job_id = await enqueue_eval(bus.redis, keys, run, 42, "demo", samples=256, timeout_s=900, retries=2)

The job id is deterministic: `eval_job_id(run, version, suite)` (shared/schemas.py), or
`<that>.n<samples>` for a re-evaluation with more samples than configured (a distinct
job, and a distinct `EvalResult` id). It is the id of the job's `EvalResult`; rq itself,
which allows only letters, digits, `_` and `-` in a job id, knows the job as
`rq_job_id(id)` (every other character escaped: one-to-one). Enqueuing an id twice runs it
once: a guard key (`keys.eval_enqueued(id)`, SET NX, kept `GUARD_TTL_S`) is set first,
then the job goes on `keys.eval_queue` with rq's unique enqueue (its own check-save-push
script, so a second copy can never sit in the queue).

`result_key(run, version, suite)` is where the result lies in the bucket: `eval_key`, with
the `:` of a `module:callable` suite (which bucket suite names may not hold) as `.`. The guard says `pending` until the job is in the queue,
then `queued`: a caller that died in between left `pending`, and the next call for that
id (a redelivered checkpoint) enqueues it after all.

The job runs `JOB_FUNCTION` (`services.evaluator.jobs.run_eval`, a stable path named as a
string: nothing here imports the evaluator, nor torch) with a job timeout and
`rq.Retry(max=retries)`; rq retries a failed job and, with `retries_left`, one whose
worker died mid-job (services/evaluator/worker.py says how soon).

rq needs a *sync* Redis client without `decode_responses` (job data is binary). Given an
asyncio client (a service's `Bus.redis`), `enqueue_eval` returns a coroutine that does
the same on a sync twin of it in a thread. rq asks the server's version with INFO, which
no service's Redis ACL user may run: `rq_connection` answers it from HELLO instead.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Coroutine
from typing import Any, overload

import redis
import redis.asyncio as aioredis
import redis.connection
from rq import Queue, Retry
from rq.exceptions import DuplicateJobError

from shared.checkpoints import eval_key
from shared.keys import Keys
from shared.schemas import eval_job_id

JOB_FUNCTION = "services.evaluator.jobs.run_eval"
GUARD_TTL_S = 30 * 24 * 3600  # versions never repeat: the guard only has to outlive retries
PENDING, QUEUED = "pending", "queued"

# The attribute rq (rq/utils.py `get_version`) caches the server version in on a client.
_RQ_VERSION_ATTR = "__rq_redis_server_version"
# What a sync twin of an asyncio client keeps of its connection settings.
_TWIN_KWARGS = ("host", "port", "path", "db", "username", "password", "socket_timeout",
                "socket_connect_timeout", "ssl_keyfile", "ssl_certfile", "ssl_cert_reqs",
                "ssl_ca_certs", "ssl_check_hostname")


def job_id_for(run: str, version: int, suite: str, samples: int | None = None) -> str:
    """`eval_job_id(run, version, suite)`, or `<that>.n<samples>` for a sample override."""
    base = eval_job_id(run, version, suite)
    if samples is None:
        return base
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    return f"{base}.n{samples}"


def rq_job_id(job_id: str) -> str:
    """The id rq knows job `job_id` by: letters, digits and `-` as they are, every other
    character `_` + two hex digits (`_u` + six beyond Latin-1). `eval.r.v000001.demo` ->
    `eval_2er_2ev000001_2edemo`."""
    out = []
    for c in job_id:
        if c.isascii() and (c.isalnum() or c == "-"):
            out.append(c)
        else:
            out.append(f"_{ord(c):02x}" if ord(c) < 256 else f"_u{ord(c):06x}")
    return "".join(out)


def result_key(run: str, version: int, suite: str) -> str:
    """The bucket key of `suite`'s result on `run` v`version` (shared/checkpoints.py `eval_key`)."""
    return eval_key(run, version, suite.replace(":", "."))


def learn_server_version(conn: redis.Redis) -> tuple[int, int, int]:
    """Ask the server's version with HELLO (an @connection command every ACL user may run)
    and cache it where rq looks, so rq never sends INFO (@dangerous, refused to services).
    Without a version rq assumes an old server and dequeues without its intermediate queue."""
    client: Any = conn  # redis-py leaves execute_command untyped
    reply = client.execute_command("HELLO")  # no argument: the connection keeps its protocol
    fields = reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2], strict=True))
    raw = fields.get(b"version", fields.get("version", b"0"))
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    parts = [int(p) for p in text.split(".")[:3] if p.isdigit()]
    version = (*parts, 0, 0, 0)[:3]
    setattr(conn, _RQ_VERSION_ATTR, version)
    return (version[0], version[1], version[2])


def rq_connection(url: str, *, socket_timeout: float = 10.0, connect_timeout: float = 2.0) -> redis.Redis:
    """A sync client for rq on `url` (binary replies), its server version already known."""
    conn = redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout)
    learn_server_version(conn)
    return conn


def sync_twin(client: aioredis.Redis) -> redis.Redis:
    """A sync client on the same server, as the same user, as an asyncio client (binary
    replies whatever the original decodes). Close it when done."""
    pool = client.connection_pool
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if k in _TWIN_KWARGS}
    cls: type[redis.connection.AbstractConnection] = getattr(
        redis.connection, pool.connection_class.__name__, redis.connection.Connection)
    conn = redis.Redis(connection_pool=redis.ConnectionPool(connection_class=cls, **kwargs))
    learn_server_version(conn)
    return conn


@overload
def enqueue_eval(
    conn: redis.Redis, keys: Keys, run: str, version: int, suite: str, *,
    samples: int | None = None, timeout_s: float, retries: int,
) -> str: ...


@overload
def enqueue_eval(
    conn: aioredis.Redis, keys: Keys, run: str, version: int, suite: str, *,
    samples: int | None = None, timeout_s: float, retries: int,
) -> Coroutine[Any, Any, str]: ...


def enqueue_eval(
    conn: redis.Redis | aioredis.Redis, keys: Keys, run: str, version: int, suite: str, *,
    samples: int | None = None, timeout_s: float, retries: int,
) -> str | Coroutine[Any, Any, str]:
    """Enqueue the evaluation of `suite` on `run` v`version` once; return its job id.

    With an asyncio client this returns a coroutine (the work runs in a thread)."""
    job_id = job_id_for(run, version, suite, samples)
    if timeout_s <= 0 or retries < 0:
        raise ValueError("timeout_s must be > 0 and retries >= 0")
    args = (keys, job_id, run, version, suite, samples, timeout_s, retries)
    if isinstance(conn, aioredis.Redis):
        client = conn

        def with_twin() -> str:
            twin = sync_twin(client)
            try:
                return _enqueue(twin, *args)
            finally:
                twin.close()

        async def in_thread() -> str:
            return await asyncio.to_thread(with_twin)

        return in_thread()
    return _enqueue(conn, *args)


def _enqueue(conn: redis.Redis, keys: Keys, job_id: str, run: str, version: int, suite: str,
             samples: int | None, timeout_s: float, retries: int) -> str:
    guard = keys.eval_enqueued(job_id)
    if not conn.set(guard, PENDING, nx=True, ex=GUARD_TTL_S):
        state = conn.get(guard)
        if state is not None and (state.decode() if isinstance(state, bytes) else state) != PENDING:
            return job_id  # enqueued before (it may have run already): never twice
        # `pending`: another caller is enqueuing it now, or died before it could. rq's
        # unique enqueue lets exactly one of us put it in the queue.
    if not hasattr(conn, _RQ_VERSION_ATTR):
        learn_server_version(conn)
    queue = Queue(keys.eval_queue, connection=conn)
    kwargs: dict[str, Any] = {"run": run, "version": version, "suite": suite, "samples": samples}
    try:
        queue.enqueue_call(
            JOB_FUNCTION, kwargs=kwargs, job_id=rq_job_id(job_id), unique=True,
            timeout=max(1, math.ceil(timeout_s)),
            retry=Retry(max=retries) if retries > 0 else None,
            description=f"evaluate {suite} on {run} v{version}" + (f" (n={samples})" if samples else ""),
        )
    except DuplicateJobError:
        pass  # in the queue (or running) already
    except BaseException:
        # Not enqueued: leave the id free for the next attempt rather than guarded forever.
        conn.delete(guard)
        raise
    conn.set(guard, QUEUED, ex=GUARD_TTL_S)
    return job_id
