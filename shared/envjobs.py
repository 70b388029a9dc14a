"""Environment episodes on rq: one job = one episode, enqueued exactly once.

    ids = enqueue_run(conn, keys, run, "toolcall", tasks=8, group_size=4, timeout_s=600, retries=2)
    job_id = enqueue_episode(conn, keys, run, "toolcall", task_id, group, 0, 4, task=task_json(task),
                             timeout_s=600, retries=2)

The job id is deterministic: `episode_job_id(run, env, task_id, group, index)`
(shared/schemas.py), the id of the episode's `Outcome` too. Enqueuing it twice runs it once
(shared/rqjobs.py: a guard `keys.episode_enqueued(id)` SET NX, then rq's unique enqueue on
`keys.envs_queue`).

What the worker runs travels in the job as a task reference, one of:
- `task_json(task)`: the task whole (its JSON) — for callers that hold `Task`s;
- `task_pick(split, n, seed, position)`: task `position` of the environment's
  `load_tasks(env, split, n, seed)`, resolved by the worker (modulo the set's size). This
  is what `nextstate envs run` enqueues: the CLI imports no environment code (services
  never import each other), and the task id in the job id is then `<split>-<seed>-<position>`
  (the Outcome's `task_id` is the environment's own id of the task).

A group is the K episodes of one task sampled together (advantage groups): `new_group`
gives each task of one invocation its own group id, so a second `nextstate envs run` of
the same tasks is a new group (and new jobs), never a no-op.

The job runs `JOB_FUNCTION` (`services.envs.jobs.run_episode`, a stable path named as a
string) with a job timeout and `rq.Retry(max=retries)`; rq retries a failed job and, with
`retries_left`, one whose worker died (shared/rqworker.py says how soon).

Evaluation episodes (`enqueue_eval_episodes`, the evaluator's `env:<name>` suites) are the
same jobs with a `target`: the held-out tasks, greedy, against an evaluation engine (never
the collector: nothing of them is captured or trained), at the front of the queue (an
evaluation waits behind no training run), each result written to `keys.eval_episodes
(evaluation)` instead of an `Outcome` on `outcomes`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Coroutine, Sequence
from typing import Any, Protocol, overload

import redis
import redis.asyncio as aioredis

from shared.keys import Keys
from shared.rqjobs import guarded_enqueue, with_sync_twin
from shared.schemas import episode_job_id

JOB_FUNCTION = "services.envs.jobs.run_episode"


class TaskLike(Protocol):
    """What is enqueued of a task (services/envs/base.py `Task`): its id and its JSON."""

    @property
    def id(self) -> str: ...

    def model_dump(self, *, mode: str = ...) -> dict[str, Any]: ...


def new_group(task_index: int, invocation: str | None = None) -> str:
    """A group id for task `task_index` of one invocation (`invocation` default: a fresh
    time-ordered id). Letters, digits and `-`: short in job and session ids."""
    inv = invocation or f"{int(time.time()):x}{secrets.token_hex(3)}"
    return f"{inv}-t{task_index}"


def task_json(task: TaskLike) -> dict[str, Any]:
    """A task reference carrying the task whole."""
    return {"task": task.model_dump(mode="json")}


def task_pick(split: str, n: int, seed: int, position: int) -> dict[str, Any]:
    """A task reference the worker resolves: `load_tasks(env, split, n, seed)[position % size]`."""
    if n < 1 or not 0 <= position < n:
        raise ValueError(f"task position {position} outside {n} tasks")
    return {"pick": {"split": split, "n": n, "seed": seed, "position": position}}


def _kwargs(run: str, env: str, task_id: str, task: dict[str, Any], group: str, index: int, group_size: int,
            retries: int, target: dict[str, Any] | None = None) -> dict[str, Any]:
    out = {"run": run, "env": env, "task_id": task_id, "task": task, "group": group, "index": index,
           "group_size": group_size, "retries": retries}
    return out if target is None else {**out, "target": target}


def _check(index: int, group_size: int, timeout_s: float, retries: int) -> None:
    if not 0 <= index < group_size:
        raise ValueError(f"episode index {index} outside a group of {group_size}")
    if timeout_s <= 0 or retries < 0:
        raise ValueError("timeout_s must be > 0 and retries >= 0")


def _enqueue(conn: redis.Redis, keys: Keys, run: str, env: str, task_id: str, group: str, index: int,
             group_size: int, task: dict[str, Any], timeout_s: float, retries: int) -> str:
    job_id = episode_job_id(run, env, task_id, group, index)
    guarded_enqueue(
        conn, queue=keys.envs_queue, guard=keys.episode_enqueued(job_id), job_id=job_id,
        function=JOB_FUNCTION, kwargs=_kwargs(run, env, task_id, task, group, index, group_size, retries),
        timeout_s=timeout_s, retries=retries,
        description=f"episode {index + 1}/{group_size} of {env} task {task_id} (run {run}, group {group})",
    )
    return job_id


@overload
def enqueue_episode(conn: redis.Redis, keys: Keys, run: str, env: str, task_id: str, group: str, index: int,
                    group_size: int, *, task: dict[str, Any], timeout_s: float, retries: int) -> str: ...


@overload
def enqueue_episode(conn: aioredis.Redis, keys: Keys, run: str, env: str, task_id: str, group: str,
                    index: int, group_size: int, *, task: dict[str, Any], timeout_s: float,
                    retries: int) -> Coroutine[Any, Any, str]: ...


def enqueue_episode(
    conn: redis.Redis | aioredis.Redis, keys: Keys, run: str, env: str, task_id: str, group: str, index: int,
    group_size: int, *, task: dict[str, Any], timeout_s: float, retries: int,
) -> str | Coroutine[Any, Any, str]:
    """Enqueue episode `index` of `group` on task `task_id` (what to run: `task`, from
    `task_json` or `task_pick`) once; return its job id (= its Outcome's id). With an
    asyncio client this returns a coroutine (the work runs in a thread)."""
    _check(index, group_size, timeout_s, retries)
    if "task" not in task and "pick" not in task:
        raise ValueError("task: a reference from task_json() or task_pick()")
    if isinstance(conn, aioredis.Redis):
        return with_sync_twin(conn, lambda sync: _enqueue(sync, keys, run, env, task_id, group, index, group_size,
                                                          task, timeout_s, retries))
    return _enqueue(conn, keys, run, env, task_id, group, index, group_size, task, timeout_s, retries)


Episode = tuple[str, str, str, int, dict[str, Any]]  # job id, task id, group, index, task reference


def episode_plan(run: str, env: str, tasks: int, group_size: int, *, split: str = "train", seed: int = 0,
                 invocation: str | None = None) -> list[Episode]:
    """Every episode of a run of `tasks` tasks picked by (split, seed), `group_size` each,
    each task its own group of this invocation. Tasks first, then their group members."""
    if group_size < 1 or tasks < 1:
        raise ValueError(f"tasks and group_size must be at least 1, got {tasks} and {group_size}")
    inv = invocation or f"{int(time.time()):x}{secrets.token_hex(3)}"
    plan: list[Episode] = []
    for t in range(tasks):
        group, task_id = new_group(t, inv), f"{split}-{seed}-{t}"
        ref = task_pick(split, tasks, seed, t)
        plan.extend((episode_job_id(run, env, task_id, group, i), task_id, group, i, ref) for i in range(group_size))
    return plan


def enqueue_plan(conn: redis.Redis, keys: Keys, run: str, env: str, plan: Sequence[Episode], group_size: int, *,
                 timeout_s: float, retries: int) -> list[str]:
    """Enqueue the episodes of `plan` (from `episode_plan`); their job ids, in order."""
    return [_enqueue(conn, keys, run, env, task_id, group, index, group_size, ref, timeout_s, retries)
            for _, task_id, group, index, ref in plan]


def enqueue_run(conn: redis.Redis, keys: Keys, run: str, env: str, tasks: int, group_size: int, *,
                timeout_s: float, retries: int, split: str = "train", seed: int = 0,
                invocation: str | None = None) -> list[str]:
    """Enqueue `group_size` episodes of each of `tasks` tasks (a whole run); their job ids."""
    plan = episode_plan(run, env, tasks, group_size, split=split, seed=seed, invocation=invocation)
    return enqueue_plan(conn, keys, run, env, plan, group_size, timeout_s=timeout_s, retries=retries)


EVAL_SPLIT = "heldout"
EVAL_RESULT_TTL_S = 7 * 24 * 3600


def eval_target(engine: str, evaluation: str, temperature: float = 0.0) -> dict[str, Any]:
    """An episode job's `target` when it evaluates: the engine's root URL (the worker calls
    only engines it is configured to trust), where the result goes, the temperature."""
    return {"engine": engine.rstrip("/"), "evaluation": evaluation, "temperature": temperature}


def evaluation_id(run: str, version: int, env: str, n: int, seed: int) -> str:
    """One evaluation's id (its episodes' group): the same evaluation enqueued again (a
    retried evaluation job) finds the episodes already run or running."""
    return f"eval-{run}-v{version}-{env}-n{n}-s{seed}"


def enqueue_eval_episodes(conn: redis.Redis, keys: Keys, run: str, env: str, version: int, *, engine: str,
                          n: int, seed: int, timeout_s: float, retries: int) -> tuple[str, list[str]]:
    """Enqueue `n` held-out episodes of `env` (task `i` of `load_tasks(env, "heldout", n,
    seed)`) that evaluate `version`, served by `engine`, at the front of the envs queue;
    (the evaluation id, the episodes' job ids)."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    _check(0, 1, timeout_s, retries)
    evaluation = evaluation_id(run, version, env, n, seed)
    target = eval_target(engine, evaluation)
    ids = []
    for i in range(n):
        task_id = f"{EVAL_SPLIT}-{seed}-{i}"
        job_id = episode_job_id(run, env, task_id, evaluation, 0)
        guarded_enqueue(
            conn, queue=keys.envs_queue, guard=keys.episode_enqueued(job_id), job_id=job_id,
            function=JOB_FUNCTION, at_front=True, timeout_s=timeout_s, retries=retries,
            kwargs=_kwargs(run, env, task_id, task_pick(EVAL_SPLIT, n, seed, i), evaluation, 0, 1, retries,
                           target),
            description=f"evaluation episode {i + 1}/{n} of {env} on v{version} (run {run})",
        )
        ids.append(job_id)
    return evaluation, ids
