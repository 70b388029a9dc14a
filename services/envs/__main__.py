"""`python -m services.envs`: an environment worker (one episode at a time).

settings → logging → the sandbox checked (a required protection missing, or the docker
backend without a Docker engine: refuse to start, exit 2) → the environments' own sources
read and checked (SWE-bench instances and their local repositories, the tools config: a
problem refuses to start, exit 2, naming the file and entry) → the runtime thread (policy
client, Redis, ops port) → the rq worker on `keys.envs_queue` in the main thread until
SIGTERM/SIGINT (shared/rqworker.py). Several processes, on one host or many, run
episodes in parallel. Exit 0 after a stop; 1 when the runtime failed, Redis could not be
reached, or the worker quit on its own.
"""

from __future__ import annotations

import logging
import sys
from urllib.parse import urlsplit

from redis.exceptions import RedisError

from services.envs import jobs, swebench, tools_config
from services.envs.runtime import Runtime
from services.envs.sandbox import check_backend
from services.envs.settings import EnvsConfig, EnvsSettings, configure
from shared.consumer import consumer_name
from shared.errors import NextstateError, SettingsError
from shared.jobloop import run_worker, worker_connection, worker_name
from shared.keys import Keys
from shared.settings import load_settings
from shared.telemetry import configure_logging

log = logging.getLogger("services.envs")


def run(settings: EnvsSettings) -> int:
    cfg = settings.envs
    rq = worker_connection(settings, cfg.maintenance_s)
    queue = Keys(settings.redis.prefix).envs_queue
    consumer = consumer_name(cfg.consumer_name, "envs")  # in its outcomes
    return run_worker(Runtime(settings, consumer), rq, queue, worker_name(queue, consumer),
                      install=jobs.install_runtime, heartbeat_s=cfg.heartbeat_s,
                      abandoned_after_s=cfg.abandoned_after_s, maintenance_s=cfg.maintenance_s)


def check_sources(cfg: EnvsConfig) -> None:
    """Read what the built-in environments take from files, once, before any episode: a
    bad instance, a missing clone or commit, a bad tool raises naming it."""
    if cfg.swe_bench_path is not None:
        swebench.check(swebench.cached_instances(str(cfg.swe_bench_path)), cfg.swe_bench_repos)
    elif cfg.swe_bench_repos is not None:
        raise SettingsError("NEXTSTATE_ENVS__SWE_BENCH_REPOS is set without NEXTSTATE_ENVS__SWE_BENCH_PATH "
                            "(the instances to read)")
    if cfg.tools_config is not None:
        tools_config.load(cfg.tools_config)
    configure(cfg)


def main() -> int:
    try:
        settings = load_settings(EnvsSettings)
        check_backend(settings.envs.sandbox)
        check_sources(settings.envs)
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
