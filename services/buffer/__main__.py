"""`python -m services.buffer [--host H] [--port N] [--tokenizer PATH]`: run the buffer.

Settings come from `NEXTSTATE_BUFFER__*` (see settings.py); the flags override them.
uvicorn serves the app and handles SIGTERM/SIGINT: the lifespan then stops the
consumer gracefully (settings → logging → run, as every service).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from services.buffer.settings import BufferSettings
from shared.errors import SettingsError
from shared.settings import load_settings
from shared.telemetry import configure_logging

log = logging.getLogger("services.buffer")


def parse_args(argv: list[str] | None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m services.buffer", description=__doc__)
    p.add_argument("--host", help="bind address (NEXTSTATE_BUFFER__HOST)")
    p.add_argument("--port", type=int, help="port (NEXTSTATE_BUFFER__PORT)")
    p.add_argument("--tokenizer", help="tokenizer folder for POST /receive (NEXTSTATE_BUFFER__TOKENIZER)")
    ns = p.parse_args(argv)
    return {k: v for k, v in vars(ns).items() if v is not None}


async def run(settings: BufferSettings) -> int:
    import uvicorn

    from services.buffer.app import build_app

    cfg = settings.buffer
    server = uvicorn.Server(uvicorn.Config(
        build_app(settings), host=cfg.host, port=cfg.port, log_config=None, log_level="warning",
        lifespan="on", timeout_graceful_shutdown=max(1, int(settings.streams.shutdown_grace_s)),
    ))
    log.info("serving", extra={"host": cfg.host, "port": cfg.port})
    await server.serve()
    return 0 if server.started else 1  # not started: the lifespan failed (logged)


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
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
