"""Test-only evaluation suites, configured as `module:callable` (NEXTSTATE_EVAL__SUITES).

- `served`: asks the evaluation engine what it serves (`/model_info`, with the internal
  credential) and scores 1 when it is the candidate: a result of 1 proves the candidate
  was loaded when the suite ran.
- `served_model`: the engine serves a model outside the run, and which.
- `slow`: `served`, except that the first attempt of each (run, version) hangs until the
  process dies. Every attempt leaves a marker file `<run>-v<version>-<attempt>-<pid>` in
  `$NS_EVAL_MARKS`, so a test sees when an attempt started, and how many there were.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx

from services.evaluator.suite import EvalContext, SuiteOutcome
from shared.schemas import TaskResult

MARKS_VAR = "NS_EVAL_MARKS"


async def served(ctx: EvalContext) -> SuiteOutcome:
    async with httpx.AsyncClient(headers=ctx.headers, timeout=10.0) as client:
        r = await client.get(f"{ctx.engine_url}/model_info")
        r.raise_for_status()
    weight_version = str(r.json()["weight_version"])
    ok = weight_version == str(ctx.version)
    return SuiteOutcome(
        score=1.0 if ok else 0.0, n=1, ci=(0.0, 1.0),
        tasks=[TaskResult(task="weight_version", score=1.0 if ok else 0.0, passed=ok,
                          details={"weight_version": weight_version, "samples": ctx.cfg.samples})],
        metrics={"samples": float(ctx.cfg.samples)},
    )


def attempts(marks: Path, run: str, version: int) -> list[Path]:
    """The marker files of every attempt so far, oldest first."""
    return sorted(marks.glob(f"{run}-v{version}-*"), key=lambda p: int(p.name.split("-")[-2]))


async def slow(ctx: EvalContext) -> SuiteOutcome:
    marks = Path(os.environ[MARKS_VAR])
    marks.mkdir(parents=True, exist_ok=True)
    attempt = len(attempts(marks, ctx.run, ctx.version)) + 1
    (marks / f"{ctx.run}-v{ctx.version}-{attempt}-{os.getpid()}").write_text(f"{time.time()}\n")
    if attempt == 1:
        await asyncio.sleep(3600)  # until the test kills or stops the worker
    return await served(ctx)


served_again = served  # a second suite name for the same check (one job per suite name)


async def served_model(ctx: EvalContext) -> SuiteOutcome:
    """What the evaluation engine serves while the suite runs (`/model_info`): score 1 when
    it is a model outside the run (weight version `model:<job id>`), its path in the task."""
    async with httpx.AsyncClient(headers=ctx.headers, timeout=10.0) as client:
        r = await client.get(f"{ctx.engine_url}/model_info")
        r.raise_for_status()
    info = r.json()
    ok = str(info["weight_version"]).startswith("model:")
    return SuiteOutcome(score=1.0 if ok else 0.0, n=1, tasks=[TaskResult(
        task="model_path", score=1.0 if ok else 0.0, passed=ok,
        details={"model_path": info["model_path"], "weight_version": info["weight_version"], "run": ctx.run})])
