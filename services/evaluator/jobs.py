"""The rq job function of evaluations: `run_eval`, at the stable path shared/evaljobs.py names.

rq imports `services.evaluator.jobs.run_eval` in the worker process and calls it in the
worker's main thread. It finds the process's runtime (services/evaluator/runtime.py: the
evaluation engine, bucket and Redis clients on their event loop), evaluates there, and
returns a small summary (rq keeps it as the job's result). The `EvalResult` itself goes
to the bucket and the `evals` stream; its id is the job's (shared/evaljobs.py `job_id_for`).
"""

from __future__ import annotations

from typing import Any

from rq import get_current_job

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


def run_model_eval(job_id: str, run: str, label: str, suite: str, samples: int | None = None,
                   model: str | None = None, source_run: str | None = None, source_version: int | None = None,
                   retries: int = 0) -> dict[str, Any]:
    """A model outside the run (shared/evaljobs.py `enqueue_model_eval`): an HF folder, or
    version `source_version` of run `source_run`."""
    runtime = _runtime
    if runtime is None:
        raise RuntimeError("services.evaluator.jobs.run_model_eval runs inside an evaluator worker "
                           "(`python -m services.evaluator`)")
    job = get_current_job()
    left = max(0, min(retries, job.retries_left or 0 if job is not None else 0))
    source = (source_run, source_version) if source_run is not None and source_version is not None else None
    return runtime.run_model_job(job_id, run, label, suite, samples, model=model, source=source,
                                 attempt=1 + retries - left, last=left == 0)
