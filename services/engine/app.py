"""The engine's FastAPI app: native SGLang routes, OpenAI routes, ops routes, lifespan.

The lifespan starts the model thread and, on shutdown, aborts what is still running
(clients get `finish_reason: abort`) and joins the thread.

Every route (generation, weight updates, pause, model info, the OpenAI routes the judge
uses, /metrics) needs the internal token when one is configured (shared/auth.py), like
SGLang started with `--api-key`; /health, /healthz and /readyz stay open for probes. A
refusal is a 401 in OpenAI's error shape on every path.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.engine import native, openai_api
from services.engine.engine import Engine
from services.engine.protocol import error_body
from shared.auth import Guard, InternalAuth
from shared.settings import InternalSettings
from shared.telemetry import add_ops_routes

log = logging.getLogger(__name__)


def build_app(engine: Engine, internal: InternalSettings | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine

    async def model_thread_alive() -> None:
        if not engine.scheduler.alive():
            raise RuntimeError("the model thread is not running")

    add_ops_routes(app, {"model": model_thread_alive})  # behind InternalAuth, as every route
    app.include_router(native.router(engine))
    app.include_router(openai_api.router(engine))

    @app.exception_handler(Exception)
    async def unhandled(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", extra={"path": request.url.path})
        message = f"internal error: {type(exc).__name__}"
        if request.url.path.startswith("/v1/"):
            return openai_api.openai_error(500, message, "server_error")
        return JSONResponse(error_body(500, message, "InternalServerError"), status_code=500)

    def refuse(message: str) -> JSONResponse:
        return openai_api.openai_error(401, message, "invalid_request_error")

    app.add_middleware(InternalAuth, guard=Guard.of(internal or InternalSettings()), refuse=refuse)
    return app
