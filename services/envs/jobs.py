"""The rq job function of episodes: `run_episode`, at the stable path shared/envjobs.py names.

rq imports `services.envs.jobs.run_episode` in the worker process and calls it in the
worker's main thread. It finds the process's runtime (services/envs/runtime.py: the
policy client and Redis on their event loop), runs one attempt of the episode there, and
returns a small summary (rq keeps it as the job's result). The `Outcome` itself goes to
the `outcomes` stream, once; its id is the job's (shared/schemas.py `episode_job_id`).

Which attempt this is comes from rq's `retries_left` and the job's `retries` (enqueued
with it): attempt 1 + retries − retries_left; the last attempt is the one rq will not
retry (services/envs/runtime.py says what it does differently).
"""

from __future__ import annotations

from typing import Any

from rq import get_current_job

from services.envs.runtime import Runtime

_runtime: Runtime | None = None


def install_runtime(runtime: Runtime | None) -> None:
    """Give this process's jobs their runtime (None: take it away)."""
    global _runtime
    _runtime = runtime


def attempt_of(retries: int, retries_left: int | None) -> tuple[int, bool]:
    """(attempt number from 1, whether rq will not retry it)."""
    left = max(0, min(retries, retries_left if retries_left is not None else 0))
    return 1 + retries - left, left == 0


def run_episode(run: str, env: str, task_id: str, task: dict[str, Any], group: str, index: int, group_size: int,
                retries: int = 0, target: dict[str, Any] | None = None) -> dict[str, Any]:
    runtime = _runtime
    if runtime is None:
        raise RuntimeError(
            "services.envs.jobs.run_episode runs inside an envs worker (`python -m services.envs`), "
            "which holds the policy client and Redis"
        )
    job = get_current_job()
    attempt, last = attempt_of(retries, job.retries_left if job is not None else 0)
    return runtime.run_job(run=run, env=env, task_id=task_id, task=task, group=group, index=index, group_size=group_size,
                           attempt=attempt, last_attempt=last, target=target)
