"""`python -m services.evaluator`: dispatch and run evaluation jobs (one worker, one engine).

settings → logging → suites resolved (an unknown one refuses to start, exit 2) → the
runtime thread (resources, dispatcher, ops port) → the rq worker on `keys.eval_queue` in
the main thread until SIGTERM/SIGINT (services/evaluator/worker.py). Exit 0 after a stop;
1 when the runtime failed, Redis could not be reached, or the worker quit on its own (rq
gives up on a Redis that times out).
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from urllib.parse import urlsplit

from redis.exceptions import RedisError

from services.evaluator import jobs
from services.evaluator.runtime import Runtime
from services.evaluator.settings import EvalSettings
from services.evaluator.suites import resolve
from services.evaluator.worker import EvalWorker, worker_ttl
from shared.consumer import consumer_name
from shared.errors import NextstateError, SettingsError
from shared.evaljobs import rq_connection
from shared.keys import Keys
from shared.settings import load_settings
from shared.telemetry import configure_logging

log = logging.getLogger("services.evaluator")


def run(settings: EvalSettings) -> int:
    cfg = settings.eval
    # An idle worker blocks in BLMOVE for `maintenance_s`: its reads must wait longer (rq
    # would raise the pool's timeout itself, but only for connections made after it looks).
    rq = rq_connection(settings.redis.url,
                       socket_timeout=max(settings.redis.socket_timeout, worker_ttl(cfg.maintenance_s) - 5),
                       connect_timeout=settings.redis.connect_timeout)
    queue = Keys(settings.redis.prefix).eval_queue
    consumer = consumer_name(cfg.consumer_name, "evaluator")
    # rq refuses a second live worker of one name, and a SIGKILLed one's record outlives it:
    # the worker's name is unique per process (the stable name is the dispatcher's). It
    # starts with the queue's name: the evaluator's Redis user may touch only such workers.
    worker_name = f"{queue}.{consumer}.{os.getpid()}.{uuid.uuid4().hex[:6]}"
    runtime = Runtime(settings, resolve, rq, consumer, worker_name)
    runtime.start()
    jobs.install_runtime(runtime)
    worker = EvalWorker([queue], connection=rq, name=worker_name,
                        heartbeat_s=cfg.heartbeat_s, abandoned_after_s=cfg.abandoned_after_s,
                        maintenance_s=cfg.maintenance_s, on_stop=runtime.request_stop)
    try:
        worker.work(logging_level="WARNING")  # our own lines say what each job did
    finally:
        jobs.install_runtime(None)
        runtime.close()
        rq.close()
    if runtime.error is not None:
        return 1
    if not worker.stopping:
        log.error("the rq worker quit without being asked to (see rq's message above)")
        return 1
    return 0


def main() -> int:
    try:
        settings = load_settings(EvalSettings)
        for name in settings.eval.suites:
            resolve(name)
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 2
    configure_logging(settings.log, "evaluator")
    try:
        return run(settings)
    except RedisError as exc:
        where = urlsplit(settings.redis.url)
        log.error("evaluator failed: Redis at %s:%s: %s", where.hostname, where.port, exc)
        return 1
    except (NextstateError, OSError) as exc:
        log.error("evaluator failed: %s", exc)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
