"""What a suite is: an async callable from an `EvalContext` to a `SuiteOutcome`.

A suite scores one candidate version, served by the evaluation engine, on its own tasks.
Built-in suites live in services/evaluator/suites/ and are found by name; any other is
`module:callable` (a user's own). The evaluator loads the candidate into the evaluation
engine before calling the suite, and turns its outcome into an `EvalResult`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from services.evaluator.settings import EvalConfig
from shared.schemas import TaskResult
from shared.streams import Bus


@dataclass(frozen=True)
class EvalContext:
    run: str
    version: int
    engine_url: str  # the evaluation engine: SGLang-native API and OpenAI /v1, serving `version`
    headers: dict[str, str]  # the internal credential for it (shared/auth.py `bearer`)
    tokenizer: str  # the policy's tokenizer folder (its chat template)
    base_model: str  # the base model's HF folder: drift's reference
    cfg: EvalConfig
    bus: Bus | None = None  # the evaluator's Redis: suites whose work runs on other workers (env:<name>)


@dataclass
class SuiteOutcome:
    score: float
    n: int
    tasks: list[TaskResult] = field(default_factory=list)
    higher_is_better: bool = True
    ci: tuple[float, float] | None = None  # 95% interval of `score`
    metrics: dict[str, float] = field(default_factory=dict)


Suite = Callable[[EvalContext], Awaitable[SuiteOutcome]]
