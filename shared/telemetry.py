"""Logging, Prometheus metrics and the `/healthz` `/readyz` `/metrics` endpoints.

- `configure_logging` sets the root logger once per process: text for people, JSON
  (`NEXTSTATE_LOG__FORMAT=json`) for log pipelines. Fields passed with `extra=` are
  kept (as `k=v` in text). Conversation text is never logged at INFO.
- `add_ops_routes(app, checks, internal)` mounts the three endpoints on a FastAPI app;
  `serve_ops(host, port, checks, internal)` runs them for services that have no API of
  their own. `/healthz` is liveness (the process answers); `/readyz` runs every check
  with a timeout and answers 503 naming the ones that failed. Both are open; `/metrics`
  needs the internal token (shared/auth.py) unless `NEXTSTATE_INTERNAL__METRICS_PUBLIC`.
  An app whose whole API sits behind `InternalAuth` may leave `internal` out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from shared.auth import METRICS, Guard, challenge, unauthorized
from shared.settings import InternalSettings, LogSettings

Check = Callable[[], Awaitable[object]]

_STANDARD_ATTRS = set(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__
) | {"message", "asctime", "taskName"}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items()
            if k not in _STANDARD_ATTRS and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_extras(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__(f"%(asctime)s %(levelname)-5s {service} %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = _extras(record)
        if extras:
            line += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        return line


def configure_logging(settings: LogSettings, service: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter(service) if settings.format == "json" else TextFormatter(service)
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.level)
    # Per-request access lines are noise at INFO; errors still come through.
    for noisy in ("uvicorn.access", "httpx", "httpx2", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


async def run_checks(checks: Mapping[str, Check], timeout: float = 2.0) -> dict[str, str]:
    """Run readiness checks concurrently; map each name to "ok" or its error."""

    async def one(check: Check) -> str:
        try:
            await asyncio.wait_for(check(), timeout)
            return "ok"
        except asyncio.TimeoutError:
            return f"timed out after {timeout}s"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    names = list(checks)
    results = await asyncio.gather(*(one(checks[n]) for n in names))
    return dict(zip(names, results, strict=True))


def add_ops_routes(
    app: FastAPI, checks: Mapping[str, Check] | None = None, internal: InternalSettings | None = None
) -> None:
    started = time.time()
    checks = checks if checks is not None else {}
    guard = Guard.of(internal) if internal is not None else None

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "uptime_s": round(time.time() - started, 1)}

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> JSONResponse:
        results = await run_checks(checks)
        ok = all(v == "ok" for v in results.values())
        return JSONResponse(
            {"status": "ready" if ok else "not ready", "checks": results},
            status_code=200 if ok else 503,
        )

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        problem = guard.refusal(METRICS, request.headers) if guard is not None else None
        if problem is not None:
            return challenge(unauthorized(problem))
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def ops_app(checks: Mapping[str, Check] | None = None, internal: InternalSettings | None = None) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    add_ops_routes(app, checks, internal)
    return app


def embedded_server(app: Any, host: str, port: int) -> Any:
    """A uvicorn server to run inside our own event loop: it leaves signals to us."""
    import contextlib

    import uvicorn

    class _Embedded(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
    return _Embedded(config)


async def serve_ops(
    host: str, port: int, checks: Mapping[str, Check] | None = None,
    internal: InternalSettings | None = None,
) -> None:
    """Serve the ops endpoints until cancelled (for services without an HTTP API)."""
    server = embedded_server(ops_app(checks, internal), host, port)
    try:
        await server.serve()
    finally:
        server.should_exit = True
