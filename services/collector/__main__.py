"""`python -m services.collector [--port N] [--engine-url URL]`: the agents' front door
(OpenAI Chat Completions and Responses, Anthropic Messages).

Settings come from `NEXTSTATE_COLLECTOR__*` (settings.py); the flags override them.
At start it asks the engine's /model_info for the tokenizer and the served model name
(unless configured), waiting up to `startup_timeout_s` for the engine to answer, then
loads the chat template and serves on uvicorn (uvloop + httptools). SIGTERM/SIGINT stop
accepting, let in-flight requests finish, let capture emissions finish (or spool),
and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from services.collector.settings import CollectorSettings
from shared.errors import EngineError, NextstateError, SettingsError
from shared.settings import load_settings
from shared.telemetry import configure_logging

log = logging.getLogger("services.collector")


def parse_args(argv: list[str] | None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m services.collector", description=__doc__)
    p.add_argument("--host", help="bind address (NEXTSTATE_COLLECTOR__HOST)")
    p.add_argument("--port", type=int, help="port (NEXTSTATE_COLLECTOR__PORT)")
    p.add_argument("--engine-url", help="engine base URL (NEXTSTATE_COLLECTOR__ENGINE_URL)")
    p.add_argument("--tokenizer", help="tokenizer folder (NEXTSTATE_COLLECTOR__TOKENIZER)")
    ns = p.parse_args(argv)
    return {k: v for k, v in vars(ns).items() if v is not None}


async def engine_info(engine: Any, wait_s: float) -> dict[str, Any]:
    """The engine's /model_info, retrying until it answers or `wait_s` passes."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return dict(await engine.model_info())
        except EngineError as exc:
            if time.monotonic() >= deadline:
                raise
            log.info("waiting for the engine: %s", exc)
            await asyncio.sleep(1.0)


async def run(settings: CollectorSettings) -> None:
    import uvicorn

    from services.collector.app import build_app
    from services.collector.capture import Capture
    from services.collector.completion import ChatService
    from services.collector.context_window import context_length
    from services.collector.engine_transport import EngineTransport
    from services.collector.pending_store import connect
    from services.collector.response_store import ResponseStore
    from services.collector.spool import Spool
    from shared.chat import ChatTemplate
    from shared.engine_client import make_engine_client
    from shared.streams import Bus

    cfg = settings.collector

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # signals are ours (below)

    async with contextlib.AsyncExitStack() as stack:
        # Plain http: our lean keep-alive transport (engine_transport.py); https: httpx's own.
        lean = EngineTransport(cfg.engine_max_connections) if cfg.engine_url.startswith("http://") else None
        engine = make_engine_client(
            cfg.engine_kind, cfg.engine_url, timeout=cfg.engine_timeout_s,
            connect_timeout=cfg.engine_connect_timeout_s, max_connections=cfg.engine_max_connections,
            transport=lean, api_key=settings.internal.secret(), adapters=cfg.engine_adapters,
        )  # fmt: skip
        stack.push_async_callback(engine.aclose)
        info: dict[str, Any] = {}
        known = cfg.tokenizer is not None and cfg.served_model_name is not None
        try:
            info = await engine_info(engine, 0 if known else cfg.startup_timeout_s)
        except EngineError as exc:
            if not known:
                raise SettingsError(
                    f"the engine at {cfg.engine_url} did not answer /model_info within "
                    f"{cfg.startup_timeout_s}s ({exc}); start it first, or set "
                    "NEXTSTATE_COLLECTOR__TOKENIZER and NEXTSTATE_COLLECTOR__SERVED_MODEL_NAME"
                ) from exc
            log.warning("the engine does not answer yet; serving with the configured tokenizer")
        tokenizer = cfg.tokenizer or info.get("tokenizer_path") or info.get("model_path")
        if not tokenizer:
            raise SettingsError("the engine reports no tokenizer_path: set NEXTSTATE_COLLECTOR__TOKENIZER")
        name = cfg.served_model_name or str(info.get("served_model_name") or tokenizer)
        template = await asyncio.to_thread(
            ChatTemplate.from_pretrained, tokenizer, chat_template=cfg.chat_template
        )
        url, most = settings.redis.url, settings.redis.max_connections
        bus = Bus(settings, client=connect(url, cfg.redis_background_timeout_s, most))
        stack.push_async_callback(bus.aclose)
        fast = connect(url, cfg.redis_timeout_s, most)
        stack.push_async_callback(fast.aclose)
        spool = Spool(cfg.spool_file(), cfg.spool_max_bytes)
        capture = Capture(cfg, bus, spool, fast)
        window = context_length(cfg.context_length, info, tokenizer)
        if window is None:
            log.warning("the policy's context length is unknown (set NEXTSTATE_COLLECTOR__CONTEXT_LENGTH): "
                        "prompts that do not fit are refused by the engine, not checked here")
        service = ChatService(cfg, engine, template, capture, name,
                              str(info.get("weight_version") or "unknown"), window)  # fmt: skip

        async def engine_ready() -> None:
            if not await engine.health():
                raise RuntimeError(f"the engine at {cfg.engine_url} is not healthy")

        store = ResponseStore(fast, bus.keys, cfg.responses_ttl_s, cfg.redis_timeout_s)
        app = build_app(cfg, service, {"engine": engine_ready, "redis": bus.ping}, settings.internal,
                        store)  # fmt: skip
        server = Server(uvicorn.Config(
            app, host=cfg.host, port=cfg.port, log_config=None, log_level="warning",
            access_log=False, http="httptools", lifespan="off", backlog=2048,
            timeout_graceful_shutdown=10, timeout_keep_alive=30,
        ))  # fmt: skip

        def request_exit() -> None:
            server.should_exit = True

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, request_exit)
        background = asyncio.create_task(capture.run())
        log.info("serving", extra={"host": cfg.host, "port": cfg.port, "engine": cfg.engine_url,
                                   "model": name, "tokenizer": tokenizer, "context_length": window,
                                   "auth": bool(cfg.api_keys), "spool": str(spool.path)})  # fmt: skip
        try:
            await server.serve()
        finally:
            capture.stop()
            await background
            await capture.drain(timeout=5.0)
        log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    overrides = parse_args(argv)
    try:
        settings = load_settings(
            CollectorSettings, **({"collector": overrides} if overrides else {})
        )
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 2
    configure_logging(settings.log, "collector")
    try:
        import uvloop

        uvloop.run(run(settings))
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 2
    except NextstateError as exc:
        log.error("collector stopped: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
