"""`python -m services.evaluator`: dispatch and run evaluation jobs (one worker, one engine).

settings → logging → suites resolved (an unknown one refuses to start, exit 2) → the
runtime thread (resources, dispatcher, ops port) → the rq worker on `keys.eval_queue` in
the main thread until SIGTERM/SIGINT (shared/rqworker.py). Exit 0 after a stop;
1 when the runtime failed, Redis could not be reached, or the worker quit on its own (rq
gives up on a Redis that times out).
"""

from __future__ import annotations

import logging
import sys
from urllib.parse import urlsplit

from redis.exceptions import RedisError

from services.evaluator import jobs
from services.evaluator.runtime import Runtime
from services.evaluator.settings import EvalSettings
from services.evaluator.suites import resolve
from shared.consumer import consumer_name
from shared.errors import NextstateError, SettingsError
from shared.jobloop import run_worker, worker_connection, worker_name
from shared.keys import Keys
from shared.settings import load_settings
from shared.telemetry import configure_logging

log = logging.getLogger("services.evaluator")


def run(settings: EvalSettings) -> int:
    cfg = settings.eval
    rq = worker_connection(settings, cfg.maintenance_s)
    queue = Keys(settings.redis.prefix).eval_queue
    consumer = consumer_name(cfg.consumer_name, "evaluator")  # the dispatcher's stable name
    name = worker_name(queue, consumer)
    return run_worker(Runtime(settings, resolve, rq, consumer, name), rq, queue, name,
                      install=jobs.install_runtime, heartbeat_s=cfg.heartbeat_s,
                      abandoned_after_s=cfg.abandoned_after_s, maintenance_s=cfg.maintenance_s)


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
