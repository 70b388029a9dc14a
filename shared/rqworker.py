"""The rq worker of rq-job services (evaluator, envs): no fork, a heartbeat thread, prompt
recovery of dead workers.

**No fork per job.** rq's default `Worker` forks a child per job. Our workers keep
long-lived asyncio clients (pooled HTTP clients, the bucket's thread pool, Redis) on an
event loop thread, and their Prometheus metrics in memory for their ops port: a forked
child would inherit a loop and pools owned by another thread, and its metrics would die
with it. So `RqWorker` is an rq `SimpleWorker`: jobs run in the main thread, one at a
time (an evaluator: one evaluation engine per worker, which serves one candidate at a
time; envs: one episode per worker). Scaling means more worker processes.

**Heartbeats.** A `SimpleWorker` never heartbeats while a job runs, so rq would take a
dead worker's job for abandoned only after the job timeout + 60 s. `RqWorker` runs
rq's own `maintain_heartbeats` on a thread every `heartbeat_s` and gives each heartbeat a
TTL of `abandoned_after_s` (rq's default: the monitoring interval + 60 s).

**How soon a dead worker's job runs again (rq 3).** A running job sits in the queue's
StartedJobRegistry (`rq:wip:<queue>`), scored by when its last heartbeat expires. Some
worker's maintenance (`clean_registries`: at its start, then whenever `maintenance_interval`
has passed — checked only when a blocking dequeue returns, every `worker_ttl` − 15 s)
runs `StartedJobRegistry.cleanup`, which requeues every expired job with `retries_left`
(spending one) and fails the others. With rq's defaults (forking worker: heartbeat TTL
30 + 60 s; maintenance every 600 s, seen every 405 s, so every 810 s on an idle worker) a
dead worker's job runs again 1.5 to ~15 minutes after its last heartbeat; a plain
`SimpleWorker` (TTL = job timeout + 60 s) after 16 minutes at best for a 900 s timeout. Here `worker_ttl` is
`maintenance_s` + 15, so an idle worker looks every `maintenance_s`: the job runs again at
most `abandoned_after_s` + 2 × `maintenance_s` after its last heartbeat, provided some
worker is idle then (a restarted one is). Measured (tests/integration/test_evaluator.py,
heartbeat 1 s, abandoned after 4 s, maintenance 1 s, a new worker started at once): the
job ran again 3.9–4.3 s after the SIGKILL.

**Only its own keys.** Maintenance cleans this worker's queue (its registries, its
workers, its intermediate list) and nothing else: rq's cleanups of rate limits and job
groups, which our jobs never use, would touch other rq applications' keys. The worker
subscribes to no Pub/Sub channel (rq's remote stop/kill commands; nothing in the stack
sends them). So its Redis ACL user needs no Pub/Sub and no key outside the queue's
(services/ctl/redis_acl.py), and INFO is never asked (shared/rqjobs.py).

**Stopping.** SIGTERM/SIGINT: rq stops taking jobs (warm shutdown); `on_stop` tells the
service's runtime, which gives the running job its shutdown grace before handing it back
(by raising out of the job). A job that fails once a stop was requested goes back to the queue
without spending a retry. A second signal is rq's cold shutdown: the same hand-back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError
from rq import Queue, worker_registration
from rq.executions import Execution
from rq.job import Job
from rq.utils import now
from rq.worker import SimpleWorker, WorkerStatus

log = logging.getLogger(__name__)


def worker_ttl(maintenance_s: int) -> int:
    """The worker TTL that makes an idle worker's blocking dequeue time out (and so check
    for maintenance) every `maintenance_s`: rq blocks for `worker_ttl - 15` seconds."""
    return max(1, maintenance_s) + 15


class RqWorker(SimpleWorker):
    def __init__(
        self, queues: list[str], *, heartbeat_s: int, abandoned_after_s: int, maintenance_s: int,
        on_stop: Callable[[], None] = lambda: None, **kwargs: Any,
    ) -> None:
        super().__init__(
            queues, job_monitoring_interval=heartbeat_s, maintenance_interval=maintenance_s,
            worker_ttl=worker_ttl(maintenance_s), **kwargs,
        )
        self.abandoned_after_s = abandoned_after_s
        self.stopping = False
        self._on_stop = on_stop

    def get_heartbeat_ttl(self, job: Job, working_time: float = 0.0) -> int:
        """Each heartbeat keeps the job in the StartedJobRegistry this long."""
        return self.abandoned_after_s

    def execute_job(self, job: Job, queue: Queue) -> None:
        execution = self.prepare_execution(job)
        done = threading.Event()
        beat = threading.Thread(target=self._heartbeats, args=(job, execution, done),
                                name="rq-heartbeat", daemon=True)
        beat.start()
        try:
            self.perform_job(job, queue, execution)
        finally:
            done.set()
            beat.join()
        self.set_state(WorkerStatus.IDLE)

    def _heartbeats(self, job: Job, execution: Execution, done: threading.Event) -> None:
        while not done.wait(self.job_monitoring_interval):
            try:
                self.maintain_heartbeats(job, execution)
            except RedisError as exc:  # the next one may get through before the TTL runs out
                log.warning("job heartbeat failed", extra={"job": job.id, "error": str(exc)})

    def handle_warm_shutdown_request(self) -> None:
        super().handle_warm_shutdown_request()  # type: ignore[no-untyped-call]
        self.stopping = True
        self._on_stop()

    def handle_job_failure(self, job: Job, queue: Queue, started_job_registry: Any = None,
                           exc_string: str = "", execution: Execution | None = None) -> None:
        if self.stopping:
            # Interrupted by the stop, not failed: back to the queue without spending a retry.
            job.retries_left = (job.retries_left or 0) + 1
            log.info("job handed back to the queue", extra={"job": job.id})
        super().handle_job_failure(job, queue, started_job_registry, exc_string, execution)

    # -- only this queue's keys -------------------------------------------------------------
    def clean_registries(self) -> None:
        """rq's maintenance of this worker's queues, minus rate limits (and the lock is let go
        even when a cleanup fails, where rq would hold it 15 minutes)."""
        for queue in self.queues:
            if not queue.acquire_maintenance_lock():
                continue
            try:
                queue.finished_job_registry.cleanup()
                queue.started_job_registry.cleanup(exception_handlers=self._exc_handlers)
                queue.failed_job_registry.cleanup()
                queue.deferred_job_registry.cleanup()
                queue.ready_job_registry.cleanup()
                worker_registration.clean_worker_registry(queue)
                queue.intermediate_queue.cleanup(self, queue)
            finally:
                queue.release_maintenance_lock()  # type: ignore[no-untyped-call]
        self.last_cleaned_at = now()  # type: ignore[assignment]

    def clean_group_registries(self) -> None:
        """Our jobs use no job groups: nothing of ours to clean."""

    def subscribe(self) -> None:
        """No Pub/Sub: nothing in the stack sends rq's remote commands."""

    def unsubscribe(self) -> None:
        pass
