"""The collector's HTTP surface: `/v1/chat/completions`, `/v1/models`, and the ops routes.

Every request to `/v1/*` is checked in this order, each failure answered in OpenAI's
error shape: bearer key (401), body size (413, from Content-Length or while reading),
JSON (400 invalid_json), schema and semantics (400 naming the `param`). Every answer
carries `X-Policy-Version`: the engine weight version that produced it (for errors,
the last one seen). `/healthz` is liveness, `/readyz` checks that the engine and Redis
answer, `/metrics` is Prometheus (an internal endpoint: it needs the stack's internal
token, not a user key, unless NEXTSTATE_INTERNAL__METRICS_PUBLIC; shared/auth.py).

Routing errors answer in the same shape: another method on a chat path is a 405 (with
`Allow: POST`), an unknown path a 404 (`Invalid URL (GET /v1/nope)`, as OpenAI says it).

`/v1/chat/completions` is the hot path: `FastPath` hands it straight to its handler
as an ASGI app, ahead of FastAPI's routing and middleware stack (measured: a fifth of
the collector's own cost per request); every other route is served by FastAPI.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from services.collector import metrics as M
from services.collector.completion import ChatService
from services.collector.openai_shapes import ApiError, dumps, model_list
from services.collector.request import build_call, parse_body
from services.collector.settings import CollectorConfig
from shared.settings import InternalSettings
from shared.telemetry import add_ops_routes

log = logging.getLogger(__name__)

JSON = "application/json"


def _error(err: ApiError, service: ChatService) -> Response:
    headers = service.headers()
    if err.status == 401:
        headers["www-authenticate"] = "Bearer"
    return Response(err.json_bytes(), status_code=err.status, media_type=JSON, headers=headers)


class Guard:
    """Bearer keys and the body-size limit."""

    def __init__(self, cfg: CollectorConfig) -> None:
        self.keys = [k.encode() for k in cfg.key_values()]
        self.max_body = cfg.max_body_bytes

    def check_auth(self, headers: Mapping[str, str]) -> None:
        if not self.keys:
            return
        header = headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")  # fmt: skip
        given = token.strip().encode()
        ok = False
        for key in self.keys:  # compare with every key: timing does not reveal which matched
            ok |= hmac.compare_digest(given, key)
        if not ok:
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")

    async def read_body(self, headers: Mapping[str, str], receive: Receive) -> bytes:
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise self._too_large()
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ApiError(400, "the client went away", code="client_disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise self._too_large()
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body exceeds {self.max_body} bytes",
                        code="request_too_large")  # fmt: skip


CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})


def _wrong_method(method: str, path: str, allowed: str) -> ApiError:
    use = f": use {allowed}" if allowed else ""
    return ApiError(405, f"{method} is not allowed on {path}{use}", code="method_not_allowed")

PLAIN_OK = M.REQUESTS.labels("plain", "200")


class FastPath:
    """ASGI: POST /v1/chat/completions to its handler directly; the rest to FastAPI."""

    def __init__(self, app: FastAPI, cfg: CollectorConfig, service: ChatService) -> None:
        self.app = app
        self.cfg = cfg
        self.service = service
        self.guard = Guard(cfg)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in CHAT_PATHS:
            if scope["method"] != "POST":
                response = _error(_wrong_method(scope["method"], scope["path"], "POST"), self.service)
                response.headers["allow"] = "POST"
                await response(scope, receive, send)
                return
            try:
                response = await self.chat(scope, receive)
            except Exception as exc:
                log.exception("unhandled error in a chat completion")
                response = _error(ApiError(500, f"internal error: {type(exc).__name__}",
                                           kind="server_error"), self.service)  # fmt: skip
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def chat(self, scope: Scope, receive: Receive) -> Response:
        mode = "plain"
        service = self.service
        try:
            headers = Headers(scope=scope)
            self.guard.check_auth(headers)
            raw = await self.guard.read_body(headers, receive)
            call = build_call(parse_body(raw), headers, self.cfg)
            if call.stream:
                mode = "stream"
                events, out = await service.open_stream(call)
                return StreamingResponse(events, media_type="text/event-stream",
                                         headers={**out, "cache-control": "no-cache"})  # fmt: skip
            body, out = await service.complete(call)
        except ApiError as err:
            M.REQUESTS.labels(mode, str(err.status)).inc()
            return _error(err, service)
        PLAIN_OK.inc()
        return Response(body, media_type=JSON, headers=out)


def build_app(
    cfg: CollectorConfig, service: ChatService, checks: dict[str, Callable[[], Awaitable[object]]],
    internal: InternalSettings | None = None,
) -> FastPath:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    guard = Guard(cfg)
    add_ops_routes(app, checks, internal or InternalSettings())

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            guard.check_auth(request.headers)
        except ApiError as err:
            return _error(err, service)
        return Response(dumps(model_list(service.model_name)), media_type=JSON,
                        headers=service.headers())  # fmt: skip

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, exc: StarletteHTTPException) -> Response:
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            err = ApiError(404, f"Invalid URL ({method} {path})", code="unknown_url")
        elif exc.status_code == 405:
            err = _wrong_method(method, path, (exc.headers or {}).get("Allow", ""))
        else:
            err = ApiError(exc.status_code, str(exc.detail))
        response = _error(err, service)
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    @app.exception_handler(Exception)
    async def unhandled(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", extra={"path": request.url.path})
        return _error(ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error"),
                      service)  # fmt: skip

    return FastPath(app, cfg, service)
