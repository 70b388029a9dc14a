"""The two halves of an rq-job process (the evaluator, the env workers): an event loop on
a thread of its own, and the rq worker in the main thread.

rq's worker owns the main thread (its signal handlers and job timeouts need it).
`JobLoop` runs one asyncio event loop for the life of the process: a subclass opens, in
`main()`, the resources every job uses (pooled HTTP clients, the bucket, the Redis bus)
and its ops port, calls `ready()`, and returns once `finished()`. A job (in the main
thread) hands its coroutine to the loop with `wait`; once a stop was requested it waits
`grace_s` more, then cancels the coroutine and raises the service's hand-back error (the
worker requeues the job, no retry spent: shared/rqworker.py). If the loop's own work dies
(the ops port cannot bind, a dispatcher crashes), the process sends itself SIGTERM: the
worker stops and `run_worker` returns 1.
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
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import redis

from shared.rqjobs import rq_connection
from shared.rqworker import RqWorker, worker_ttl
from shared.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")


class JobLoop:
    """The event loop thread of an rq-job process; subclasses write `main()`."""

    def __init__(self, name: str, grace_s: float) -> None:
        self.name = name  # in its thread's name and its log lines
        self.grace_s = grace_s  # what the running job gets after a stop was requested
        self.loop = asyncio.new_event_loop()
        self.error: BaseException | None = None
        self.stop_requested_at: float | None = None
        self._thread = threading.Thread(target=self._thread_main, name=f"{name}-loop", daemon=True)
        self._ready = threading.Event()
        self._finish = asyncio.Event()

    # -- for subclasses (on the loop) -----------------------------------------------------
    async def main(self) -> None:
        """Open the resources, start the ops port, `ready()`, serve until `finished()`."""
        raise NotImplementedError

    def on_stop(self) -> None:
        """A stop was requested (called on the loop): stop taking new work."""

    def ready(self) -> None:
        self._ready.set()

    async def finished(self) -> None:
        """Returns once the worker returned (`close`): jobs no longer need the resources."""
        await self._finish.wait()

    # -- life (main thread) ---------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> None:
        """Run `main` until it is ready; raise if it fails first."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"the {self.name}'s event loop did not start within {timeout_s}s")
        if self.error is not None:
            raise self.error

    def request_stop(self) -> None:
        """The running job gets `grace_s`. Safe in a signal handler."""
        if self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()
        with contextlib.suppress(RuntimeError):  # the loop is gone already
            self.loop.call_soon_threadsafe(self.on_stop)

    def close(self, timeout_s: float = 30.0) -> None:
        """After the worker returned: let `main` finish (ops port, resources), join."""
        self.request_stop()
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._finish.set)
        self._thread.join(timeout_s)

    def _thread_main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.main())
        except BaseException as exc:  # SystemExit too: uvicorn's answer to a port it cannot bind
            self.error = exc
            log.error("the %s's event loop failed", self.name, extra={"error": f"{type(exc).__name__}: {exc}"})
            if self._ready.is_set():  # the worker runs: stop it, the process exits 1
                os.kill(os.getpid(), signal.SIGTERM)
        finally:
            self._ready.set()
            self.loop.close()

    # -- jobs (main thread) ---------------------------------------------------------------
    def hand_back_due(self) -> bool:
        at = self.stop_requested_at
        return at is not None and time.monotonic() - at > self.grace_s

    def wait(self, coro: Coroutine[Any, Any, T], hand_back: Callable[[], BaseException],
             interrupted: Callable[[BaseException], None] | None = None) -> T:
        """Run `coro` on the loop and wait for it. Past a stop's grace: cancel it, raise
        `hand_back()`. `interrupted(exc)`: told when something else (rq's job timeout, a
        cold stop) ends the wait while `coro` still runs, before it is cancelled."""
        if self.error is not None or not self._thread.is_alive():
            coro.close()
            raise RuntimeError(f"the {self.name}'s event loop is not running")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            while True:
                try:
                    return fut.result(timeout=0.2)
                except concurrent.futures.TimeoutError:
                    if self.hand_back_due():
                        raise hand_back() from None
        except BaseException as exc:
            if interrupted is not None and not fut.done() and not self.hand_back_due():
                fut.cancel()
                interrupted(exc)
            raise
        finally:
            if not fut.done():
                fut.cancel()


def worker_name(queue: str, consumer: str) -> str:
    """rq refuses a second live worker of one name, and a SIGKILLed one's record outlives
    it: the rq name is unique per process. It starts with the queue's name: the service's
    Redis ACL user may touch only such workers."""
    return f"{queue}.{consumer}.{os.getpid()}.{uuid.uuid4().hex[:6]}"


def worker_connection(settings: Settings, maintenance_s: int) -> redis.Redis:
    """The worker's sync client. An idle worker blocks in BLMOVE for `maintenance_s`: its
    reads must wait longer (rq would raise the pool's timeout itself, but only for
    connections made after it looks)."""
    return rq_connection(settings.redis.url,
                         socket_timeout=max(settings.redis.socket_timeout, worker_ttl(maintenance_s) - 5),
                         connect_timeout=settings.redis.connect_timeout)


def run_worker(runtime: JobLoop, rq: redis.Redis, queue: str, name: str, *,
               install: Callable[[Any], None], heartbeat_s: int, abandoned_after_s: int,
               maintenance_s: int) -> int:
    """Start `runtime`, run the rq worker on `queue` until SIGTERM/SIGINT, close. 0 after a
    stop; 1 when the runtime failed or the worker quit on its own (rq gives up on a Redis
    that times out). `install(runtime)` gives the jobs their runtime (None after)."""
    runtime.start()
    install(runtime)
    worker = RqWorker([queue], connection=rq, name=name, heartbeat_s=heartbeat_s,
                      abandoned_after_s=abandoned_after_s, maintenance_s=maintenance_s,
                      on_stop=runtime.request_stop)
    try:
        worker.work(logging_level="WARNING")  # the service's own lines say what each job did
    finally:
        install(None)
        runtime.close()
        rq.close()
    if runtime.error is not None:
        return 1
    if not worker.stopping:
        log.error("the rq worker quit without being asked to (see rq's message above)")
        return 1
    return 0
