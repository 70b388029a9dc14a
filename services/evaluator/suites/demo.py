"""`demo`: the demo task's success criterion on held-out questions, greedy.

Each task is one question the demo never asks (`HELD_OUT_QUESTIONS`, the first
`samples` in a seeded order), asked the way the demo asks it — the task's system prompt,
then the question — through the evaluation engine's OpenAI endpoint (so the engine
renders it with the policy's chat template), at temperature 0 with the run's seed and
`max_tokens`. A task passes when `Task.ok(answer)`, the demo's own criterion
(NEXTSTATE_EVAL__DEMO_TASK, shared/demo_tasks.py). Score: the success rate, with its
Wilson interval. More samples than held-out questions are capped (greedy answers to a
repeated question would only repeat), and `n` says how many were asked.
"""

from __future__ import annotations

import logging
import random

from services.evaluator.suite import EvalContext, SuiteOutcome
from services.evaluator.suites import call_timeout, run_ordered
from services.evaluator.suites.openai_chat import ChatClient
from services.evaluator.suites.stats import wilson
from shared.demo_tasks import HELD_OUT_QUESTIONS, TASKS
from shared.errors import SettingsError
from shared.schemas import TaskResult

log = logging.getLogger(__name__)


def questions(seed: int, samples: int) -> list[str]:
    """The held-out questions a run asks: a seeded order, the first `samples` of it."""
    order = list(HELD_OUT_QUESTIONS)
    random.Random(seed).shuffle(order)
    return order[:samples]


async def suite(ctx: EvalContext) -> SuiteOutcome:
    cfg = ctx.cfg
    task = TASKS.get(cfg.demo_task)
    if task is None:
        raise SettingsError(
            f"NEXTSTATE_EVAL__DEMO_TASK={cfg.demo_task!r} is not a demo task: "
            f"one of {', '.join(sorted(TASKS))}"
        )
    asked = questions(cfg.seed, cfg.samples)
    if len(asked) < cfg.samples:
        log.warning("demo suite: %s samples asked for, %s held-out questions exist", cfg.samples, len(asked))

    async with ChatClient(ctx.engine_url, label="the evaluation engine", headers=ctx.headers,
                          timeout_s=call_timeout(cfg)) as engine:  # fmt: skip

        async def ask(i: int) -> TaskResult:
            messages = [{"role": "system", "content": task.system}, {"role": "user", "content": asked[i]}]
            reply = await engine.complete(messages, max_tokens=cfg.max_tokens, temperature=0.0, seed=cfg.seed)
            ok = task.ok(reply.text)
            return TaskResult(
                task=f"{task.name}/{i:03d}",
                score=float(ok),
                passed=ok,
                details={"question": asked[i], "answer": reply.text, "finish_reason": reply.finish_reason},
            )

        results = await run_ordered(len(asked), ask, cfg.concurrency)
    passed = sum(bool(r.passed) for r in results)
    n = len(results)
    return SuiteOutcome(
        score=passed / n,
        n=n,
        tasks=results,
        higher_is_better=True,
        ci=wilson(passed, n),
        metrics={"passed": float(passed)},
    )
