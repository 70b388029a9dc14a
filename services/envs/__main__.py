"""`python -m services.envs`: an environment worker (one episode at a time).

settings → logging → the sandbox's required protections checked (missing ones refuse to
start, exit 2) → the runtime thread (policy client, Redis, ops port) → the rq worker on
`keys.envs_queue` in the main thread until SIGTERM/SIGINT (shared/rqworker.py). Several
processes, on one host or many, run episodes in parallel. Exit 0 after a stop; 1 when
the runtime failed, Redis could not be reached, or the worker quit on its own.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from urllib.parse import urlsplit

from redis.exceptions import RedisError

from services.envs import jobs
from services.envs.runtime import Runtime
from services.envs.sandbox import check_required
from services.envs.settings import EnvsSettings
from shared.consumer import consumer_name
from shared.errors import NextstateError, SettingsError
from shared.keys import Keys
from shared.rqjobs import rq_connection
from shared.rqworker import RqWorker, worker_ttl
from shared.settings import load_settings
from shared.telemetry import configure_logging

log = logging.getLogger("services.envs")


def run(settings: EnvsSettings) -> int:
    cfg = settings.envs
    # An idle worker blocks in BLMOVE for `maintenance_s`: its reads must wait longer.
    rq = rq_connection(settings.redis.url,
                       socket_timeout=max(settings.redis.socket_timeout, worker_ttl(cfg.maintenance_s) - 5),
                       connect_timeout=settings.redis.connect_timeout)
    queue = Keys(settings.redis.prefix).envs_queue
    name = consumer_name(cfg.consumer_name, "envs")
    # rq refuses a second live worker of one name, and a SIGKILLed one's record outlives it:
    # the rq name is unique per process and starts with the queue's (the ACL user's workers).
    worker_name = f"{queue}.{name}.{os.getpid()}.{uuid.uuid4().hex[:6]}"
    runtime = Runtime(settings, name)
    runtime.start()
    jobs.install_runtime(runtime)
    worker = RqWorker([queue], connection=rq, name=worker_name,
                      heartbeat_s=cfg.heartbeat_s, abandoned_after_s=cfg.abandoned_after_s,
                      maintenance_s=cfg.maintenance_s, on_stop=runtime.request_stop)
    try:
        worker.work(logging_level="WARNING")  # our own lines say what each episode did
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
        settings = load_settings(EnvsSettings)
        check_required(settings.envs.sandbox.require)
    except (SettingsError, NextstateError) as exc:
        print(exc, file=sys.stderr)
        return 2
    configure_logging(settings.log, "envs")
    try:
        return run(settings)
    except RedisError as exc:
        where = urlsplit(settings.redis.url)
        log.error("envs worker failed: Redis at %s:%s: %s", where.hostname, where.port, exc)
        return 1
    except (NextstateError, OSError) as exc:
        log.error("envs worker failed: %s", exc)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
