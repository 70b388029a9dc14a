"""The evaluator's rq worker: shared/rqworker.py's `RqWorker` (no fork, heartbeats on a
thread, a dead worker's job requeued within ABANDONED_AFTER_S + 2 x MAINTENANCE_S, a
graceful hand-back on SIGTERM), under the name the evaluator has always used."""

from __future__ import annotations

from shared.rqworker import RqWorker, worker_ttl

__all__ = ["EvalWorker", "worker_ttl"]

EvalWorker = RqWorker
