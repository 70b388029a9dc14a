"""The rq job function of evaluations: `run_eval`, at the stable path shared/evaljobs.py names.

rq imports `services.evaluator.jobs.run_eval` in the worker process and calls it in the
worker's main thread. It finds the process's runtime (services/evaluator/runtime.py: the
evaluation engine, bucket and Redis clients on their event loop), evaluates there, and
returns a small summary (rq keeps it as the job's result). The `EvalResult` itself goes
to the bucket and the `evals` stream; its id is the job's (shared/evaljobs.py `job_id_for`).
"""

from __future__ import annotations

from typing import Any

from services.evaluator.runtime import Runtime
from shared.evaljobs import job_id_for

_runtime: Runtime | None = None


def install_runtime(runtime: Runtime | None) -> None:
    """Give this process's jobs their runtime (None: take it away)."""
    global _runtime
    _runtime = runtime


def run_eval(run: str, version: int, suite: str, samples: int | None = None) -> dict[str, Any]:
    runtime = _runtime
    if runtime is None:
        raise RuntimeError(
            "services.evaluator.jobs.run_eval runs inside an evaluator worker (`python -m "
            "services.evaluator`), which holds the evaluation engine, bucket and Redis clients"
        )
    return runtime.run_job(job_id_for(run, version, suite, samples), run, version, suite, samples)
