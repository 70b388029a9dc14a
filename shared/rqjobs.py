"""rq jobs with deterministic ids, enqueued exactly once: what evaluations and episodes share.

    conn = rq_connection(settings.redis.url)             # sync, binary, INFO never asked
    guarded_enqueue(conn, queue="nextstate-envs", guard=keys.episode_enqueued(job_id),
                    job_id=job_id, function="services.envs.jobs.run_episode", kwargs={...},
                    timeout_s=600, retries=2, description="episode ...")

A job's id is ours (e.g. `episode.<run>.<env>.<task>.<group>.<i>`); rq, which allows only
letters, digits, `_` and `-` in a job id, knows it as `rq_job_id(id)` (every other
character escaped: one-to-one). Enqueuing an id twice runs it once: a guard key (SET NX,
kept `GUARD_TTL_S`) is set first, then the job goes on the queue with rq's unique enqueue
(its own check-save-push script, so a second copy can never sit in the queue). The guard
says `pending` until the job is in the queue, then `queued`: a caller that died in between
left `pending`, and the next call for that id enqueues it after all.

rq needs a *sync* Redis client without `decode_responses` (job data is binary):
`sync_twin` makes one from a service's asyncio client (same server, same ACL user). rq
asks the server's version with INFO, which no service's Redis ACL user may run:
`rq_connection` and `sync_twin` answer it from HELLO instead.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis
import redis.connection
from rq import Queue, Retry
from rq.exceptions import DuplicateJobError

GUARD_TTL_S = 30 * 24 * 3600  # job ids never repeat: the guard only has to outlive retries
PENDING, QUEUED = "pending", "queued"

T = TypeVar("T")

# The attribute rq (rq/utils.py `get_version`) caches the server version in on a client.
_RQ_VERSION_ATTR = "__rq_redis_server_version"
# What a sync twin of an asyncio client keeps of its connection settings.
_TWIN_KWARGS = ("host", "port", "path", "db", "username", "password", "socket_timeout",
                "socket_connect_timeout", "ssl_keyfile", "ssl_certfile", "ssl_cert_reqs",
                "ssl_ca_certs", "ssl_check_hostname")


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


async def with_sync_twin(client: aioredis.Redis, fn: Callable[[redis.Redis], T]) -> T:
    """`fn(twin)` in a thread, on a sync twin of `client` closed afterwards."""

    def call() -> T:
        twin = sync_twin(client)
        try:
            return fn(twin)
        finally:
            twin.close()

    return await asyncio.to_thread(call)


def guarded_enqueue(
    conn: redis.Redis, *, queue: str, guard: str, job_id: str, function: str, kwargs: dict[str, Any],
    timeout_s: float, retries: int, description: str, guard_ttl_s: int = GUARD_TTL_S, at_front: bool = False,
) -> bool:
    """Put job `job_id` (ours; rq's is `rq_job_id(job_id)`) on `queue` unless it was
    enqueued before; True when this call enqueued it. `function` is a dotted path (a string:
    the caller imports nothing of the worker's). `at_front`: before the jobs waiting."""
    if timeout_s <= 0 or retries < 0:
        raise ValueError("timeout_s must be > 0 and retries >= 0")
    if not conn.set(guard, PENDING, nx=True, ex=guard_ttl_s):
        state = conn.get(guard)
        if state is not None and (state.decode() if isinstance(state, bytes) else state) != PENDING:
            return False  # enqueued before (it may have run already): never twice
        # `pending`: another caller is enqueuing it now, or died before it could. rq's
        # unique enqueue lets exactly one of us put it in the queue.
    if not hasattr(conn, _RQ_VERSION_ATTR):
        learn_server_version(conn)
    enqueued = True
    try:
        Queue(queue, connection=conn).enqueue_call(
            function, kwargs=kwargs, job_id=rq_job_id(job_id), unique=True, at_front=at_front,
            timeout=max(1, math.ceil(timeout_s)),
            retry=Retry(max=retries) if retries > 0 else None,
            description=description,
        )
    except DuplicateJobError:
        enqueued = False  # in the queue (or running) already
    except BaseException:
        # Not enqueued: leave the id free for the next attempt rather than guarded forever.
        conn.delete(guard)
        raise
    conn.set(guard, QUEUED, ex=guard_ttl_s)
    return enqueued
