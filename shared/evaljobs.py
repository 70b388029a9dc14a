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
worker died mid-job (shared/rqworker.py says how soon).

A model outside the run's lineage (`nextstate eval run --model PATH | --version RUN:V`) is
evaluated by `enqueue_model_eval`: job `MODEL_JOB_FUNCTION` with id `model_job_id(run, label,
suite, nonce)` — a fresh nonce per request: asking again evaluates again — whose result
goes to the bucket at `model_result_key(run, label, suite)`, beside the run's versions, and
never on `evals`: no gate decides on it, nothing of the run's lineage changes. The worker
keeps the job's state in `keys.model_eval(job_id)` for the CLI that waits on it.

Given an asyncio client (a service's `Bus.redis`), `enqueue_eval` returns a coroutine
that does the same on a sync twin of it in a thread. The rq plumbing (the guarded unique
enqueue, `rq_job_id`, `rq_connection`, the sync twin) is shared/rqjobs.py's, shared with
the environments' episodes (shared/envjobs.py).
"""

from __future__ import annotations

import re
from collections.abc import Coroutine
from typing import Any, overload

import redis
import redis.asyncio as aioredis

from shared.checkpoints import eval_key, evals_prefix
from shared.keys import Keys
from shared.rqjobs import (
    GUARD_TTL_S,
    PENDING,
    QUEUED,
    guarded_enqueue,
    learn_server_version,
    rq_connection,
    rq_job_id,
    sync_twin,
    with_sync_twin,
)
from shared.schemas import eval_job_id

__all__ = ["GUARD_TTL_S", "JOB_FUNCTION", "MODEL_JOB_FUNCTION", "PENDING", "QUEUED", "enqueue_eval",
           "enqueue_model_eval", "job_id_for", "learn_server_version", "model_job_id", "model_result_key",
           "model_slug", "result_key", "rq_connection", "rq_job_id", "sync_twin"]

JOB_FUNCTION = "services.evaluator.jobs.run_eval"
MODEL_JOB_FUNCTION = "services.evaluator.jobs.run_model_eval"
MODEL_STATE_TTL_S = 7 * 24 * 3600


def job_id_for(run: str, version: int, suite: str, samples: int | None = None) -> str:
    """`eval_job_id(run, version, suite)`, or `<that>.n<samples>` for a sample override."""
    base = eval_job_id(run, version, suite)
    if samples is None:
        return base
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    return f"{base}.n{samples}"


def result_key(run: str, version: int, suite: str) -> str:
    """The bucket key of `suite`'s result on `run` v`version` (shared/checkpoints.py `eval_key`)."""
    return eval_key(run, version, suite.replace(":", "."))


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

    def enqueue(sync: redis.Redis) -> str:
        guarded_enqueue(
            sync, queue=keys.eval_queue, guard=keys.eval_enqueued(job_id), job_id=job_id,
            function=JOB_FUNCTION, kwargs={"run": run, "version": version, "suite": suite, "samples": samples},
            timeout_s=timeout_s, retries=retries,
            description=f"evaluate {suite} on {run} v{version}" + (f" (n={samples})" if samples else ""),
        )
        return job_id

    if isinstance(conn, aioredis.Redis):
        return with_sync_twin(conn, enqueue)
    return enqueue(conn)


# -- models outside the run -------------------------------------------------------------------
def model_slug(label: str) -> str:
    """A label as a bucket folder name: letters, digits, `_ . -` (others become `_`)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", label).strip("._") or "model"
    return slug[:64]


def model_job_id(run: str, label: str, suite: str, nonce: str) -> str:
    """`eval.model.<run>.<label slug>.<suite>.<nonce>` (an evaluation job id, as the ACLs know them)."""
    return f"eval.model.{run}.{model_slug(label)}.{suite}.{nonce}"


def model_result_key(run: str, label: str, suite: str) -> str:
    """Where the newest result of `suite` on the model `label` lies: beside `run`'s versions."""
    name = suite.replace(":", ".")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
        raise ValueError(f"invalid suite name {suite!r}: letters, digits and _ . - only")
    return f"{evals_prefix(run)}models/{model_slug(label)}/{name}.json"


def enqueue_model_eval(
    conn: redis.Redis, keys: Keys, run: str, label: str, suite: str, *, nonce: str,
    model: str | None = None, source: tuple[str, int] | None = None, samples: int | None = None,
    timeout_s: float, retries: int,
) -> str:
    """Enqueue the evaluation of `suite` on a model outside `run`'s lineage: an HF folder
    `model` (a path the evaluator and its engine see), or version `source` = (run, version)
    of the bucket. Returns the job id."""
    if (model is None) == (source is None):
        raise ValueError("give model (a folder) or source (run, version), one of the two")
    if samples is not None and samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    job_id = model_job_id(run, label, suite, nonce)
    kwargs: dict[str, Any] = {"job_id": job_id, "run": run, "label": label, "suite": suite, "samples": samples, "model": model,
                              "source_run": source[0] if source else None,
                              "source_version": source[1] if source else None, "retries": retries}
    what = model if model is not None else f"{source[0]} v{source[1]}" if source else ""
    state = keys.model_eval(job_id)
    conn.hset(state, "state", "queued")  # before the job: the worker's own state comes after it
    conn.expire(state, MODEL_STATE_TTL_S)
    guarded_enqueue(conn, queue=keys.eval_queue, guard=keys.eval_enqueued(job_id), job_id=job_id,
                    function=MODEL_JOB_FUNCTION, kwargs=kwargs, timeout_s=timeout_s, retries=retries,
                    description=f"evaluate {suite} on {what} ({label}, beside run {run})")
    return job_id
