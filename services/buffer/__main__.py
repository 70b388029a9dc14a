"""`python -m services.buffer [--host H] [--port N] [--tokenizer PATH]`: run the buffer.

Settings come from `NEXTSTATE_BUFFER__*` (see settings.py); the flags override them.
SIGTERM/SIGINT stop uvicorn (in-flight requests finish), then the lifespan stops the
consumer gracefully and the process exits 0 (settings → logging → run, as every service).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from services.buffer.settings import BufferSettings
from shared.errors import NextstateError, SettingsError
from shared.settings import load_settings
from shared.telemetry import configure_logging, embedded_server

log = logging.getLogger("services.buffer")


def parse_args(argv: list[str] | None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m services.buffer", description=__doc__)
    p.add_argument("--host", help="bind address (NEXTSTATE_BUFFER__HOST)")
    p.add_argument("--port", type=int, help="port (NEXTSTATE_BUFFER__PORT)")
    p.add_argument("--tokenizer", help="tokenizer folder for POST /receive (NEXTSTATE_BUFFER__TOKENIZER)")
    ns = p.parse_args(argv)
    return {k: v for k, v in vars(ns).items() if v is not None}


async def run(settings: BufferSettings) -> int:
    from services.buffer.app import build_app

    cfg = settings.buffer
    app = build_app(settings)
    server = embedded_server(app, cfg.host, cfg.port)
    server.config.timeout_graceful_shutdown = max(1, int(settings.streams.shutdown_grace_s))
    loop = asyncio.get_running_loop()

    def stop() -> None:
        log.info("signal received, stopping")
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    # Our lifespan around uvicorn's serve: requests drain first, then the consumer stops.
    async with app.router.lifespan_context(app):
        log.info("serving", extra={"host": cfg.host, "port": cfg.port})
        await server.serve()
    return 0


def main(argv: list[str] | None = None) -> int:
    overrides = parse_args(argv)
    try:
        settings = load_settings(BufferSettings)
        if overrides:
            buffer = settings.buffer.model_copy(update=overrides)
            settings = load_settings(BufferSettings, buffer=buffer.model_dump())
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 2
    configure_logging(settings.log, "buffer")
    try:
        return asyncio.run(run(settings))
    except NextstateError as exc:
        log.error("buffer stopped: %s", exc)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
