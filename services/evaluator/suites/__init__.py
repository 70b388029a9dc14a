"""The built-in evaluation suites and `resolve(name)`, which finds any suite by name.

    demo            the demo task's success criterion (shared/demo_tasks.py), temperature 0
    drift           mean KL(base ‖ candidate) on a fixed prompt set (lower is better)
    simulated-user  an LLM user holds scenario conversations with the candidate, then rates them
    env:<name>      an environment's held-out tasks (success rate at temperature 0), run by the
                    envs workers against the evaluation engine (suites/environment.py)

Any other name is `module:callable` (a user's own suite, e.g. `mypkg.evals:tool_suite`):
the module is imported and the callable must be an `async def suite(ctx) -> SuiteOutcome`
(services/evaluator/suite.py). A name that cannot be resolved is a `SettingsError` saying
why, so the evaluator can refuse its configuration at start. Built-in modules are
imported only when resolved (drift pulls torch for its reference).

Every suite is deterministic given `ctx.cfg.seed`, runs `ctx.cfg.samples` tasks with at
most `ctx.cfg.concurrency` requests in flight (the simulated user: `CONCURRENCY`, as its
user model serves others too), and puts a timeout on every call (`call_timeout`).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

from services.evaluator.settings import EvalConfig
from services.evaluator.suite import Suite
from shared.errors import SettingsError

BUILTIN = {
    "demo": "services.evaluator.suites.demo:suite",
    "drift": "services.evaluator.suites.drift:suite",
    "simulated-user": "services.evaluator.suites.simulated_user:suite",
}
CONCURRENCY = 4  # requests in flight by default (the evaluation engine batches them)
MAX_CALL_TIMEOUT_S = 120.0

T = TypeVar("T")


def resolve(name: str) -> Suite:
    """The suite called `name`: a built-in name or `module:callable`."""
    if name.startswith("env:"):
        from services.evaluator.suites.environment import EnvironmentSuite

        try:
            return EnvironmentSuite(name.removeprefix("env:"))
        except ValueError as exc:
            raise SettingsError(f"suite {name!r}: {exc}") from None
    target = BUILTIN.get(name)
    if target is None:
        module_name, sep, attr = name.partition(":")
        if not sep or not module_name or not attr:
            raise SettingsError(
                f"unknown suite {name!r}: the built-in suites are {', '.join(sorted(BUILTIN))}; "
                "a suite of your own is 'module:callable' (e.g. mypkg.evals:my_suite)"
            )
        target = name
    module_name, _, attr = target.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:  # a plugin's import may fail any way it likes
        raise SettingsError(
            f"suite {name!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SettingsError(f"suite {name!r}: module {module_name!r} has no {attr!r}") from None
    if not _is_async_callable(obj):
        raise SettingsError(
            f"suite {name!r}: {target} is a {type(obj).__name__}, not an async callable; "
            "a suite is `async def suite(ctx: EvalContext) -> SuiteOutcome`"
        )
    return cast(Suite, obj)


def _is_async_callable(obj: object) -> bool:
    if inspect.iscoroutinefunction(obj):
        return True
    call = getattr(obj, "__call__", None)  # noqa: B004 - an instance with `async def __call__`
    return not inspect.isclass(obj) and call is not None and inspect.iscoroutinefunction(call)


def call_timeout(cfg: EvalConfig) -> float:
    """Seconds one model call may take: the job's budget, at most MAX_CALL_TIMEOUT_S."""
    return min(MAX_CALL_TIMEOUT_S, cfg.job_timeout_s)


async def run_ordered(n: int, task: Callable[[int], Awaitable[T]], concurrency: int = CONCURRENCY) -> list[T]:
    """`task(0) … task(n-1)` with at most `concurrency` at once; results in index order.
    The first failure cancels the rest and is raised."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> T:
        async with gate:
            return await task(i)

    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()  # a no-op for the finished ones; stops the rest after a failure
        await asyncio.gather(*tasks, return_exceptions=True)
