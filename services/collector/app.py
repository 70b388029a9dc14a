"""The collector's HTTP surface: the three agent APIs, `/v1/models`, and the ops routes.

- `POST /v1/chat/completions` (OpenAI Chat Completions),
- `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`
  (OpenAI Responses; responses_api.py, input_items.py),
- `POST /v1/messages` (Anthropic Messages; anthropic_api.py; the key also as `x-api-key`) and
  `POST /v1/messages/count_tokens` (its prompt's length in the policy's tokens);
`GET /v1/models` and `/v1/models/{id}` (OpenAI's model cards with the context length, or
Anthropic's when the request carries `anthropic-version`); `GET /openapi.json` (openapi.py).

All three share one answer and capture path (completion.py). Every request to `/v1/*`
is checked in this order, each failure answered in its API's error shape (OpenAI's;
Anthropic's on `/v1/messages`): API key (401), body size (413, from Content-Length or
while reading), JSON (400), schema and semantics (400 naming the `param`). Every answer
carries `X-Policy-Version`: the engine weight version that produced it (for errors,
the last one seen). `/healthz` is liveness, `/readyz` checks that the engine and Redis
answer, `/metrics` is Prometheus (an internal endpoint: it needs the stack's internal
token, not a user key, unless NEXTSTATE_INTERNAL__METRICS_PUBLIC; shared/auth.py).

Routing errors answer in the same shape: another method on a chat path is a 405 (with
`Allow: POST`), an unknown path a 404 (`Invalid URL (GET /v1/nope)`, as OpenAI says it).

The three POST routes are the hot path: `FastPath` hands them straight to their handlers
as an ASGI app, ahead of FastAPI's routing and middleware stack (measured: a fifth of
the collector's own cost per request); every other route is served by FastAPI.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from services.collector import anthropic_api
from services.collector import metrics as M
from services.collector.anthropic_api import MessagesApi
from services.collector.completion import ChatService
from services.collector.openai_shapes import ApiError, dumps, model_card, model_list
from services.collector.openapi import document
from services.collector.request import build_call, parse_body
from services.collector.response_store import ResponseStore
from services.collector.responses_api import ResponsesApi
from services.collector.settings import CollectorConfig
from shared.settings import InternalSettings
from shared.telemetry import add_ops_routes

log = logging.getLogger(__name__)

JSON = "application/json"


def _error(err: ApiError, service: ChatService, shape: Callable[[ApiError], bytes] | None = None) -> Response:
    headers = service.headers()
    if err.status == 401:
        headers["www-authenticate"] = "Bearer"
    body = err.json_bytes() if shape is None else shape(err)
    return Response(body, status_code=err.status, media_type=JSON, headers=headers)


class Guard:
    """Bearer keys and the body-size limit."""

    def __init__(self, cfg: CollectorConfig) -> None:
        self.keys = [k.encode() for k in cfg.key_values()]
        self.max_body = cfg.max_body_bytes

    def check_auth(self, headers: Mapping[str, str], x_api_key: bool = False) -> None:
        """A bearer key (or, with `x_api_key`, Anthropic's `x-api-key` header)."""
        if not self.keys:
            return
        header = headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            token = headers.get("x-api-key", "") if x_api_key else ""
            if not token.strip():
                also = " or 'x-api-key: <key>'" if x_api_key else ""
                raise ApiError(401, f"missing API key: send 'Authorization: Bearer <key>'{also}",
                               code="invalid_api_key")  # fmt: skip
        given = token.strip().encode()
        ok = False
        for key in self.keys:  # compare with every key: timing does not reveal which matched
            ok |= hmac.compare_digest(given, key)
        if not ok:
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")

    async def read_body(self, headers: Mapping[str, str], receive: Receive) -> bytes:
        declared = headers.get("content-length")
        if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > self.max_body:
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

Reply = tuple[bytes | AsyncIterator[bytes], dict[str, str]]


@dataclass(frozen=True)
class ApiRoute:
    """A POST route of the Responses or Messages API."""

    api: str  # responses | messages
    handle: Callable[[bytes, Headers], Awaitable[Reply]]
    shape: Callable[[ApiError], bytes] | None = None  # the error body (None: OpenAI's)
    x_api_key: bool = False


def _wrong_method(method: str, path: str, allowed: str) -> ApiError:
    use = f": use {allowed}" if allowed else ""
    return ApiError(405, f"{method} is not allowed on {path}{use}", code="method_not_allowed")

PLAIN_OK = M.REQUESTS.labels("plain", "200")


class FastPath:
    """ASGI: the POST routes of the three APIs to their handlers directly; the rest to FastAPI."""

    def __init__(self, app: FastAPI, cfg: CollectorConfig, service: ChatService,
                 routes: Mapping[str, ApiRoute]) -> None:  # fmt: skip
        self.app = app
        self.cfg = cfg
        self.service = service
        self.guard = Guard(cfg)
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            route = self.routes.get(path)
            if path in CHAT_PATHS or route is not None:
                shape = route.shape if route is not None else None
                if scope["method"] != "POST":
                    response = _error(_wrong_method(scope["method"], path, "POST"), self.service, shape)
                    response.headers["allow"] = "POST"
                    await response(scope, receive, send)
                    return
                try:
                    response = await (self.chat(scope, receive) if route is None
                                      else self.api(route, scope, receive))  # fmt: skip
                except Exception as exc:
                    log.exception("unhandled error in a completion")
                    response = _error(ApiError(500, f"internal error: {type(exc).__name__}",
                                               kind="server_error"), self.service, shape)  # fmt: skip
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

    async def api(self, route: ApiRoute, scope: Scope, receive: Receive) -> Response:
        try:
            headers = Headers(scope=scope)
            self.guard.check_auth(headers, route.x_api_key)
            raw = await self.guard.read_body(headers, receive)
            body, out = await route.handle(raw, headers)
        except ApiError as err:
            M.API_REQUESTS.labels(route.api, "any", str(err.status)).inc()
            return _error(err, self.service, route.shape)
        if isinstance(body, bytes):
            M.API_REQUESTS.labels(route.api, "plain", "200").inc()
            return Response(body, media_type=JSON, headers=out)
        M.API_REQUESTS.labels(route.api, "stream", "200").inc()
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={**out, "cache-control": "no-cache"})  # fmt: skip


def build_app(
    cfg: CollectorConfig, service: ChatService, checks: dict[str, Callable[[], Awaitable[object]]],
    internal: InternalSettings | None = None, store: ResponseStore | None = None,
) -> FastPath:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    guard = Guard(cfg)
    add_ops_routes(app, checks, internal or InternalSettings())
    routes: dict[str, ApiRoute] = {}
    if store is not None:
        responses = ResponsesApi(service, store)
        for path in ("/v1/responses", "/responses"):
            routes[path] = ApiRoute("responses", responses.create)
        _stored_routes(app, guard, service, responses)
    messages = MessagesApi(service)
    for path in ("/v1/messages", "/messages"):
        routes[path] = ApiRoute("messages", messages.create, anthropic_api.error_bytes, x_api_key=True)
        routes[path + "/count_tokens"] = ApiRoute("count_tokens", messages.count_tokens,
                                                  anthropic_api.error_bytes, x_api_key=True)  # fmt: skip

    @app.get("/openapi.json")
    async def openapi() -> Response:
        """The three APIs' OpenAPI document (public, as vLLM's and OpenAI's are)."""
        return Response(dumps(document()), media_type=JSON)

    def anthropic_client(request: Request) -> bool:
        """Anthropic's SDK sends `anthropic-version` on every request; OpenAI's never does."""
        return "anthropic-version" in request.headers

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        anthropic = anthropic_client(request)
        try:
            guard.check_auth(request.headers, x_api_key=anthropic)
        except ApiError as err:
            return _error(err, service, anthropic_api.error_bytes if anthropic else None)
        name, window = service.model_name, service.context_length
        body = anthropic_api.model_page(name, window) if anthropic else model_list(name, window)
        return Response(dumps(body), media_type=JSON, headers=service.headers())

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        """Any name: completions answer every `model` with the one policy, so its card
        answers every name too (`root` is the name it is served under)."""
        anthropic = anthropic_client(request)
        try:
            guard.check_auth(request.headers, x_api_key=anthropic)
        except ApiError as err:
            return _error(err, service, anthropic_api.error_bytes if anthropic else None)
        window = service.context_length
        body = (anthropic_api.model_info(model_id, window) if anthropic
                else {**model_card(model_id, window), "root": service.model_name})  # fmt: skip
        return Response(dumps(body), media_type=JSON, headers=service.headers())

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, exc: StarletteHTTPException) -> Response:
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            err = ApiError(404, f"Invalid URL ({method} {path})", code="unknown_url")
        elif exc.status_code == 405:
            err = _wrong_method(method, path, (exc.headers or {}).get("Allow", ""))
        else:
            err = ApiError(exc.status_code, str(exc.detail))
        anthropic = path.startswith(("/v1/messages", "/messages"))
        response = _error(err, service, anthropic_api.error_bytes if anthropic else None)
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    @app.exception_handler(Exception)
    async def unhandled(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", extra={"path": request.url.path})
        return _error(ApiError(500, f"internal error: {type(exc).__name__}", kind="server_error"),
                      service)  # fmt: skip

    return FastPath(app, cfg, service, routes)


def _stored_routes(app: FastAPI, guard: Guard, service: ChatService, responses: ResponsesApi) -> None:
    """GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items: the stored
    response objects."""

    async def answer(request: Request, op: Callable[[str], Awaitable[bytes]], response_id: str) -> Response:
        try:
            guard.check_auth(request.headers)
            body = await op(response_id)
        except ApiError as err:
            return _error(err, service)
        return Response(body, media_type=JSON, headers=service.headers())

    for prefix in ("/v1/responses", "/responses"):
        @app.get(prefix + "/{response_id}/input_items")
        async def input_items(request: Request, response_id: str) -> Response:
            query = request.query_params
            includes = [*query.getlist("include"), *query.getlist("include[]")]
            return await answer(request, lambda rid: responses.input_items(rid, query, includes),
                                response_id)  # fmt: skip

        @app.get(prefix + "/{response_id}")
        async def retrieve(request: Request, response_id: str) -> Response:
            return await answer(request, responses.retrieve, response_id)

        @app.delete(prefix + "/{response_id}")
        async def delete(request: Request, response_id: str) -> Response:
            return await answer(request, responses.delete, response_id)
