"""`env:<name>`: an environment's held-out tasks, greedy, scored as a success rate.

    NEXTSTATE_EVAL__SUITES=["demo","drift","env:toolcall"]    (any environment name, or
                                                          `env:package.module:MyEnv`)

The episodes run where environments live, on the envs workers (services never import each
other): the suite enqueues `samples` held-out episodes of the environment (task `i` of its
`heldout` split, seeded by NEXTSTATE_EVAL__SEED) at the front of the envs queue, each
aimed at this evaluator's engine, which serves the candidate (shared/envjobs.py
`enqueue_eval_episodes`). A worker runs the agent loop against that engine at temperature
0 — not through the collector: nothing of an evaluation is captured or trained — and
writes the verdict to the evaluation's hash; the suite waits for all of them (within the
job's budget) and scores the success rate with its Wilson interval.

An episode that errored (the engine unreachable, the environment's own bug) is not the
candidate's failure: it is left out of `n` and counted in `metrics["errors"]`; when none
could run, the suite fails (the evaluation job is retried). Repeated tasks (more samples
than the split holds) count once. With no envs worker on the queue the suite fails at once,
saying so, rather than waiting out its budget.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from services.evaluator.suite import EvalContext, SuiteOutcome
from services.evaluator.suites.errors import SuiteError
from services.evaluator.suites.stats import wilson
from shared.envjobs import enqueue_eval_episodes
from shared.rqjobs import with_sync_twin
from shared.schemas import TaskResult

PREFIX = "env:"
POLL_S = 0.5
EPISODE_RETRIES = 1


class EnvironmentSuite:
    """The suite `env:<env>` (an `async` callable, as every suite)."""

    def __init__(self, env: str) -> None:
        if not env:
            raise ValueError("env:<name> needs an environment name (e.g. env:toolcall)")
        self.env = env

    def __repr__(self) -> str:
        return f"EnvironmentSuite({self.env!r})"

    async def __call__(self, ctx: EvalContext) -> SuiteOutcome:
        if ctx.bus is None:
            raise SuiteError(f"{PREFIX}{self.env} runs its episodes on the envs workers: it needs the evaluator's Redis")
        redis, keys, cfg = ctx.bus.redis, ctx.bus.keys, ctx.cfg
        if not await redis.scard(f"rq:workers:{keys.envs_queue}"):
            raise SuiteError(
                f"{PREFIX}{self.env}: no envs worker serves the queue {keys.envs_queue} "
                "(start some: `nextstate up --envs P`, `python -m services.envs`), or drop the suite")
        started = time.monotonic()
        evaluation, ids = await with_sync_twin(redis, lambda conn: enqueue_eval_episodes(
            conn, keys, ctx.run, self.env, ctx.version, engine=ctx.engine_url, n=cfg.samples, seed=cfg.seed,
            timeout_s=cfg.job_timeout_s, retries=EPISODE_RETRIES))
        key = keys.eval_episodes(evaluation)
        deadline = started + cfg.job_timeout_s
        while True:
            raw = await redis.hgetall(key)
            if all(i in raw for i in ids):
                break
            if time.monotonic() > deadline:
                raise SuiteError(f"{PREFIX}{self.env}: {sum(i in raw for i in ids)} of {len(ids)} episodes "
                                 f"came back within {cfg.job_timeout_s:.0f} s (are the envs workers busy?)")
            await asyncio.sleep(POLL_S)
        return score([json.loads(raw[i]) for i in ids], self.env)


def score(episodes: list[dict[str, Any]], env: str) -> SuiteOutcome:
    """The outcome of an evaluation's episode results (in task order; see the module doc)."""
    seen: set[str] = set()
    tasks: list[TaskResult] = []
    errors = 0
    for ep in episodes:
        if ep.get("error"):
            errors += 1
            continue
        if ep["task_id"] in seen:
            continue
        seen.add(ep["task_id"])
        tasks.append(TaskResult(
            task=f"{env}/{ep['task_id']}", score=float(ep["reward"]), passed=bool(ep["passed"]),
            details={"steps": ep.get("steps"), "ended": ep.get("ended"), **(ep.get("details") or {})}))
    if not tasks:
        first = next((ep["error"] for ep in episodes if ep.get("error")), "no episodes")
        raise SuiteError(f"{PREFIX}{env}: none of {len(episodes)} episodes ran ({first})")
    passed = sum(bool(t.passed) for t in tasks)
    n = len(tasks)
    return SuiteOutcome(
        score=passed / n, n=n, tasks=tasks, higher_is_better=True, ci=wilson(passed, n),
        metrics={"passed": float(passed), "errors": float(errors),
                 "mean_reward": sum(t.score for t in tasks) / n,
                 "mean_steps": sum(float(t.details.get("steps") or 0) for t in tasks) / n},
    )
