"""The asyncio half of an evaluator process, on a thread of its own beside the rq worker.

rq's worker owns the main thread (its signal handlers and job timeouts need it). This
thread runs one event loop for the life of the process, holding:
- the resources every job uses, opened once: the evaluation engine's client (one pooled
  HTTP client), the bucket, the Redis bus;
- the dispatcher: a consumer of `checkpoints` in group `evaluator` that enqueues one
  evaluation job per configured suite for each committed version (shared/evaljobs.py);
  before it starts, with BASELINE on, the base model's (v0) jobs of every suite without a
  result of it in the bucket yet — once per run, ahead of any version;
- the ops port: /healthz, /readyz (Redis, bucket, the evaluation engine's /health), /metrics.

A job (services/evaluator/jobs.py, in the main thread) hands its evaluation to this loop
with `run_job` and waits for it; once a stop was requested it waits `shutdown_grace_s`
more, then cancels the evaluation and raises `HandedBack` (the worker requeues the job).
If the loop's own work dies (the ops port cannot bind, the dispatcher crashes), the
process sends itself SIGTERM: the worker stops and `python -m services.evaluator` exits 1.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import redis

from services.evaluator.evaluation import BASE, JOBS, Evaluator, Superseded, begun
from services.evaluator.settings import EvalSettings
from services.evaluator.suite import Suite
from shared import keys as K
from shared.consumer import Consumer, Delivery
from shared.engine_client import make_engine_client
from shared.errors import NextstateError, NoCheckpoint
from shared.evaljobs import enqueue_eval
from shared.jobloop import JobLoop
from shared.schemas import CheckpointPublished
from shared.store import AsyncBucket
from shared.streams import Bus
from shared.telemetry import embedded_server, ops_app

log = logging.getLogger(__name__)


class HandedBack(NextstateError):
    """The worker is stopping: the evaluation was cancelled and goes back to the queue."""


class Runtime(JobLoop):
    def __init__(self, settings: EvalSettings, resolve: Callable[[str], Suite], rq: redis.Redis, consumer: str,
                 worker: str) -> None:
        super().__init__("evaluator", settings.eval.shutdown_grace_s)
        self.settings = settings
        self.resolve = resolve  # suite name -> suite (services.evaluator.suites.resolve)
        self.rq = rq  # the worker's sync client: the dispatcher enqueues with it (thread-safe)
        self.consumer = consumer
        self.worker = worker
        self.evaluator: Evaluator | None = None
        self._stop_dispatch = asyncio.Event()

    def on_stop(self) -> None:
        self._stop_dispatch.set()  # stop dispatching; the running job gets its grace

    async def main(self) -> None:
        settings, cfg = self.settings, self.settings.eval
        cfg.local_dir.mkdir(parents=True, exist_ok=True)
        engine = make_engine_client(cfg.engine_kind, cfg.engine_url, update_timeout=cfg.job_timeout_s,
                                    api_key=settings.internal.secret())
        async with AsyncBucket(settings.bucket) as bucket, Bus(settings) as bus, engine:
            self.evaluator = Evaluator(settings, bucket, bus, engine, self.resolve, self.worker)

            async def engine_ok() -> None:
                if not await engine.health():
                    raise RuntimeError(f"the evaluation engine at {cfg.engine_url} fails /health")

            checks = {"redis": bus.ping, "bucket": bucket.ping, "engine": engine_ok}
            server = embedded_server(ops_app(checks, settings.internal), cfg.host, cfg.port)
            ops = asyncio.create_task(server.serve(), name="ops")
            while not server.started:
                if ops.done():
                    await ops  # raises (SystemExit from a port that would not bind)
                    raise RuntimeError(f"the ops port {cfg.host}:{cfg.port} stopped at start")
                await asyncio.sleep(0.02)
            await self._baseline(bucket)
            consumer = Consumer(bus, K.CHECKPOINTS, K.GROUP_EVALUATOR, CheckpointPublished,
                                self._dispatch, name=self.consumer)
            dispatcher = asyncio.create_task(consumer.run(), name="dispatcher")
            self.ready()
            log.info("evaluator started", extra={"engine": cfg.engine_url, "suites": cfg.suites,
                                                 "consumer": self.consumer, "worker": self.worker})
            stop = asyncio.create_task(self._stop_dispatch.wait())
            await asyncio.wait({stop, ops, dispatcher}, return_when=asyncio.FIRST_COMPLETED)
            consumer.stop()
            await asyncio.gather(dispatcher, return_exceptions=True)
            if not stop.done():  # the dispatcher or the ops port died on its own
                stop.cancel()
                failed = ops if ops.done() else dispatcher
                raise RuntimeError(f"{failed.get_name()} stopped: {failed.exception()!r}")
            await self.finished()  # jobs may still need the resources until the worker returns
            server.should_exit = True
            await asyncio.gather(ops, return_exceptions=True)

    # -- the dispatcher ------------------------------------------------------------------------
    async def _baseline(self, bucket: AsyncBucket) -> None:
        """Enqueue the base model's evaluation (v0) of every suite not scored on it yet."""
        cfg, run = self.settings.eval, self.settings.run
        if not cfg.baseline:
            return
        if not cfg.base_model:
            log.warning("no baseline: the base model is not evaluated without NEXTSTATE_EVAL__BASE_MODEL "
                        "(the gate then compares the first version with nothing)")
            return
        if await bucket.run(begun, bucket.sync, run, BASE):
            log.info("baseline already evaluated", extra={"run": run})  # per suite: the gate keeps it
            return
        for suite in cfg.suites:
            job_id = await asyncio.to_thread(
                enqueue_eval, self.rq, K.Keys(self.settings.redis.prefix), run, BASE, suite,
                timeout_s=cfg.job_timeout_s, retries=cfg.retries)
            log.info("baseline evaluation enqueued", extra={"job": job_id, "version": BASE, "suite": suite})

    async def _dispatch(self, msg: CheckpointPublished, delivery: Delivery) -> None:
        cfg = self.settings.eval
        for suite in cfg.suites:
            job_id = await asyncio.to_thread(
                enqueue_eval, self.rq, K.Keys(self.settings.redis.prefix), msg.run, msg.version, suite,
                timeout_s=cfg.job_timeout_s, retries=cfg.retries)
            log.info("evaluation enqueued", extra={"job": job_id, "version": msg.version, "suite": suite})

    # -- jobs (called from the worker's thread) ----------------------------------------------------
    def run_model_job(self, job_id: str, run: str, label: str, suite: str, samples: int | None, *,
                      model: str | None, source: tuple[str, int] | None, attempt: int,
                      last: bool) -> dict[str, Any]:
        """A model outside the run, evaluated on the loop; counted as `run_job` counts."""
        evaluator = self.evaluator
        if evaluator is None:
            raise RuntimeError("the evaluator's event loop is not running")
        outcome = "failed"
        try:
            result = self.wait(
                evaluator.evaluate_model(job_id, run, label, suite, samples, model=model, source=source,
                                         attempt=attempt, last=last),
                lambda: HandedBack(f"the worker is stopping: {job_id} goes back to the queue"))
            outcome = "ok"
            return {"id": result.id, "model": label, "score": result.score, "n": result.n}
        except HandedBack:
            outcome = "handed_back"
            raise
        finally:
            if outcome == "failed" and self.stop_requested_at is not None:
                outcome = "handed_back"
            JOBS.labels(suite, outcome).inc()

    def run_job(self, job_id: str, run: str, version: int, suite: str, samples: int | None) -> dict[str, Any]:
        """Evaluate on the loop and wait; count how the job ended."""
        evaluator = self.evaluator
        if evaluator is None:
            raise RuntimeError("the evaluator's event loop is not running")
        outcome = "failed"
        try:
            result = self.wait(evaluator.evaluate(job_id, run, version, suite, samples), lambda: HandedBack(
                f"the worker is stopping: {job_id} goes back to the queue"))
            outcome = "ok"
            return {"id": result.id, "score": result.score, "n": result.n}
        except NoCheckpoint as exc:
            # Pruned by the trainer's retention before its turn came (the gate off: nothing
            # waits for evaluations); a retry would find it no more than this attempt did.
            outcome = "gone"
            log.warning("version pruned before its evaluation: skipped",
                        extra={"job": job_id, "version": version, "suite": suite, "error": str(exc)})
            return {"id": job_id, "skipped": "the checkpoint is no longer in the bucket"}
        except Superseded as exc:
            outcome = "skipped"
            log.info("evaluation skipped: %s", exc, extra={"job": job_id, "version": version, "suite": suite})
            return {"id": job_id, "skipped": str(exc)}
        except HandedBack:
            outcome = "handed_back"
            raise
        finally:
            if outcome == "failed" and self.stop_requested_at is not None:
                outcome = "handed_back"  # a job interrupted by a cold stop
            JOBS.labels(suite, outcome).inc()
