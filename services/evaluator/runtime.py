"""The asyncio half of an evaluator process, on a thread of its own beside the rq worker.

rq's worker owns the main thread (its signal handlers and job timeouts need it). This
thread runs one event loop for the life of the process, holding:
- the resources every job uses, opened once: the evaluation engine's client (one pooled
  HTTP client), the bucket, the Redis bus;
- the dispatcher: a consumer of `checkpoints` in group `evaluator` that enqueues one
  evaluation job per configured suite for each committed version (shared/evaljobs.py);
- the ops port: /healthz, /readyz (Redis, bucket, the evaluation engine's /health), /metrics.

A job (services/evaluator/jobs.py, in the main thread) hands its evaluation to this loop
with `run_job` and waits for it; once a stop was requested it waits `shutdown_grace_s`
more, then cancels the evaluation and raises `HandedBack` (the worker requeues the job).
If the loop's own work dies (the ops port cannot bind, the dispatcher crashes), the
process sends itself SIGTERM: the worker stops and `python -m services.evaluator` exits 1.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from services.evaluator.evaluation import JOBS, Evaluator
from services.evaluator.settings import EvalSettings
from services.evaluator.suite import Suite
from shared import keys as K
from shared.consumer import Consumer, Delivery
from shared.engine_client import make_engine_client
from shared.errors import NextstateError
from shared.evaljobs import enqueue_eval
from shared.schemas import CheckpointPublished
from shared.store import AsyncBucket
from shared.streams import Bus
from shared.telemetry import embedded_server, ops_app

log = logging.getLogger(__name__)


class HandedBack(NextstateError):
    """The worker is stopping: the evaluation was cancelled and goes back to the queue."""


class Runtime:
    def __init__(self, settings: EvalSettings, resolve: Callable[[str], Suite], rq: redis.Redis, consumer: str,
                 worker: str) -> None:
        self.settings = settings
        self.resolve = resolve  # suite name -> suite (services.evaluator.suites.resolve)
        self.rq = rq  # the worker's sync client: the dispatcher enqueues with it (thread-safe)
        self.consumer = consumer
        self.worker = worker
        self.loop = asyncio.new_event_loop()
        self.evaluator: Evaluator | None = None
        self.error: BaseException | None = None
        self.stop_requested_at: float | None = None
        self._thread = threading.Thread(target=self._thread_main, name="evaluator-loop", daemon=True)
        self._ready = threading.Event()
        self._stop_dispatch = asyncio.Event()
        self._finish = asyncio.Event()

    # -- life ---------------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> None:
        """Open the resources, start the dispatcher and the ops port; raise if that fails."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"the evaluator's event loop did not start within {timeout_s}s")
        if self.error is not None:
            raise self.error

    def request_stop(self) -> None:
        """Stop dispatching; the running job gets `shutdown_grace_s`. Safe in a signal handler."""
        if self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()
        with contextlib.suppress(RuntimeError):  # the loop is gone already
            self.loop.call_soon_threadsafe(self._stop_dispatch.set)

    def close(self, timeout_s: float = 30.0) -> None:
        """After the worker returned: stop the ops port, close the resources, join."""
        self.request_stop()
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._finish.set)
        self._thread.join(timeout_s)

    def _thread_main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as exc:  # SystemExit too: uvicorn's answer to a port it cannot bind
            self.error = exc
            log.error("the evaluator's event loop failed", extra={"error": f"{type(exc).__name__}: {exc}"})
            if self._ready.is_set():  # the worker runs: stop it, the process exits 1
                os.kill(os.getpid(), signal.SIGTERM)
        finally:
            self._ready.set()
            self.loop.close()

    async def _main(self) -> None:
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
            consumer = Consumer(bus, K.CHECKPOINTS, K.GROUP_EVALUATOR, CheckpointPublished,
                                self._dispatch, name=self.consumer)
            dispatcher = asyncio.create_task(consumer.run(), name="dispatcher")
            self._ready.set()
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
            await self._finish.wait()  # jobs may still need the resources until the worker returns
            server.should_exit = True
            await asyncio.gather(ops, return_exceptions=True)

    # -- the dispatcher ------------------------------------------------------------------------
    async def _dispatch(self, msg: CheckpointPublished, delivery: Delivery) -> None:
        cfg = self.settings.eval
        for suite in cfg.suites:
            job_id = await asyncio.to_thread(
                enqueue_eval, self.rq, K.Keys(self.settings.redis.prefix), msg.run, msg.version, suite,
                timeout_s=cfg.job_timeout_s, retries=cfg.retries)
            log.info("evaluation enqueued", extra={"job": job_id, "version": msg.version, "suite": suite})

    # -- jobs (called from the worker's thread) ----------------------------------------------------
    def run_job(self, job_id: str, run: str, version: int, suite: str, samples: int | None) -> dict[str, Any]:
        """Evaluate on the loop and wait; count how the job ended."""
        evaluator = self.evaluator
        if evaluator is None or self.error is not None:
            raise RuntimeError("the evaluator's event loop is not running")
        fut = asyncio.run_coroutine_threadsafe(
            evaluator.evaluate(job_id, run, version, suite, samples), self.loop)
        outcome = "failed"
        try:
            while True:
                try:
                    result = fut.result(timeout=0.2)
                except concurrent.futures.TimeoutError:
                    if self._hand_back_due():
                        outcome = "handed_back"
                        raise HandedBack(f"the worker is stopping: {job_id} goes back to the queue") from None
                    continue
                outcome = "ok"
                return {"id": result.id, "score": result.score, "n": result.n}
        finally:
            if not fut.done():
                fut.cancel()
            if outcome == "failed" and self.stop_requested_at is not None:
                outcome = "handed_back"  # a job interrupted by a cold stop
            JOBS.labels(suite, outcome).inc()

    def _hand_back_due(self) -> bool:
        at = self.stop_requested_at
        return at is not None and time.monotonic() - at > self.settings.eval.shutdown_grace_s
