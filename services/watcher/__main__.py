"""`python -m services.watcher`: reconcile the engine with the bucket's policy, on a timer."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from redis.exceptions import RedisError

from services.watcher.settings import WatcherSettings
from services.watcher.watcher import Watcher
from shared.engine_client import make_engine_client
from shared.errors import SettingsError
from shared.settings import load_settings
from shared.store import AsyncBucket
from shared.streams import Bus
from shared.telemetry import configure_logging, serve_ops

log = logging.getLogger("services.watcher")


async def run(settings: WatcherSettings) -> None:
    cfg = settings.watcher
    cfg.local_dir.mkdir(parents=True, exist_ok=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine = make_engine_client(cfg.engine_kind, cfg.engine_url, update_timeout=cfg.reload_timeout_s,
                                api_key=settings.internal.secret())
    async with AsyncBucket(settings.bucket) as bucket, Bus(settings) as bus, engine:
        watcher = Watcher(settings, bucket, engine, bus)

        async def engine_ok() -> None:
            if not await engine.health():
                raise RuntimeError("engine /health failed")

        # "policy": the engine serves what it should (fails once a pass could not fix that).
        checks = {"redis": bus.ping, "bucket": bucket.ping, "engine": engine_ok,
                  "policy": watcher.check_serving}
        ops = asyncio.create_task(serve_ops(cfg.host, cfg.port, checks, settings.internal))
        log.info("watching", extra={"run": settings.run, "engine": cfg.engine_url,
                                    "every_s": cfg.poll_interval_s})
        try:
            await watcher.run_forever(stop)
        except RedisError as exc:
            log.error("redis failed", extra={"error": str(exc)})
            raise
        finally:
            ops.cancel()
            await asyncio.gather(ops, return_exceptions=True)


def main() -> int:
    try:
        settings = load_settings(WatcherSettings)
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 2
    configure_logging(settings.log, "watcher")
    asyncio.run(run(settings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
