"""`python -m services.engine [--model PATH] [--host H] [--port N]`: serve one HF model.

Settings come from `NEXTSTATE_ENGINE__*` (see settings.py); the flags override them.
torch and transformers are imported only once the configuration is known to be valid.
SIGTERM/SIGINT stop accepting, abort what is still generating (clients receive
`finish_reason: abort`), and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator
from typing import Any

from services.engine.settings import EngineSettings
from shared.errors import NextstateError, SettingsError
from shared.settings import load_settings
from shared.telemetry import configure_logging

log = logging.getLogger("services.engine")


def parse_args(argv: list[str] | None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m services.engine", description=__doc__)
    p.add_argument("--model", help="HF model folder (NEXTSTATE_ENGINE__MODEL)")
    p.add_argument("--host", help="bind address (NEXTSTATE_ENGINE__HOST)")
    p.add_argument("--port", type=int, help="port (NEXTSTATE_ENGINE__PORT)")
    p.add_argument("--weight-version", help="initial weight version (NEXTSTATE_ENGINE__WEIGHT_VERSION)")
    p.add_argument("--served-model-name", help="name in /v1/models (NEXTSTATE_ENGINE__SERVED_MODEL_NAME)")
    p.add_argument("--tool-call-parser",
                   help="parse tool calls on /v1/chat/completions (NEXTSTATE_ENGINE__TOOL_CALL_PARSER)")
    ns = p.parse_args(argv)
    return {k: v for k, v in vars(ns).items() if v is not None}


async def run(settings: EngineSettings) -> None:
    import uvicorn

    from services.engine.app import build_app
    from services.engine.engine import Engine
    from services.engine.model import load_model, load_tokenizer, resolve_device
    from shared.cpus import torch_threads

    class Server(uvicorn.Server):
        """uvicorn without its own signal capture (which re-raises SIGTERM on exit)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    cfg = settings.engine
    threads = torch_threads(cfg.threads)
    device = resolve_device(cfg.device)
    model = await asyncio.to_thread(load_model, cfg.model, device, cfg.dtype)
    tokenizer_path = cfg.tokenizer or cfg.model
    engine = Engine(model, load_tokenizer(tokenizer_path), cfg, decoder=load_tokenizer(tokenizer_path))
    server = Server(
        uvicorn.Config(
            build_app(engine, settings.internal),
            host=cfg.host,
            port=cfg.port,
            log_config=None,  # keep shared.telemetry's logging
            log_level="warning",
            timeout_graceful_shutdown=max(1, int(cfg.shutdown_grace_s)),
        )
    )

    async def shutdown() -> None:
        log.info("shutting down", extra={"grace_s": cfg.shutdown_grace_s})
        await engine.drain(cfg.shutdown_grace_s)
        server.should_exit = True

    tasks: set[asyncio.Task[None]] = set()

    def request_exit() -> None:
        if not tasks:
            tasks.add(asyncio.ensure_future(shutdown()))

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, request_exit)
    log.info(
        "serving",
        extra={"model": cfg.model, "device": str(device), "host": cfg.host, "port": cfg.port,
               "weight_version": cfg.weight_version, "threads": threads},
    )  # fmt: skip
    await server.serve()
    log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    overrides = parse_args(argv)
    try:
        settings = load_settings(EngineSettings, **({"engine": overrides} if overrides else {}))
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 2
    configure_logging(settings.log, "engine")
    try:
        asyncio.run(run(settings))
    except NextstateError as exc:
        log.error("engine stopped: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
