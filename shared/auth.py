"""The closed control plane: one internal bearer token on every internal endpoint.

Servers (the engine, the buffer, every service's ops port) refuse a request without
`Authorization: Bearer <NEXTSTATE_INTERNAL__TOKEN>` (or `x-api-key: <token>`, as SGLang
also accepts) with 401; clients (engine clients, watcher, judge, importer, slime's
rollout) send it. Open without it: the probes `/healthz`, `/health`, `/readyz` (they
carry no data), and `/metrics` when `NEXTSTATE_INTERNAL__METRICS_PUBLIC=true`. With no
token configured (dev and test only; prod refuses to start) everything is open.

    app.add_middleware(InternalAuth, guard=Guard.of(settings.internal), refuse=my_error)
    headers = bearer(settings.internal.secret())     # {"authorization": "Bearer …"} or {}

`InternalAuth` is plain ASGI (no BaseHTTPMiddleware): streaming responses and
client-disconnect detection pass through untouched. The comparison is constant-time.
The agents' own API (the collector's `/v1/*`) keeps its own user keys.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from shared.settings import InternalSettings

PROBES = frozenset({"/healthz", "/health", "/readyz"})
METRICS = "/metrics"
MISSING = "missing credential: send 'Authorization: Bearer <NEXTSTATE_INTERNAL__TOKEN>'"
WRONG = "incorrect credential: the bearer token is not this stack's NEXTSTATE_INTERNAL__TOKEN"

# Builds the 401 answer in the API's own error shape from a message.
Refuse = Callable[[str], Response]


def bearer(token: str | None) -> dict[str, str]:
    """The header a client sends: `{"authorization": "Bearer <token>"}`, or none without a token."""
    return {"authorization": f"Bearer {token}"} if token else {}


def presented(headers: Mapping[str, str]) -> str | None:
    """The credential a request carries: a bearer token, else an `x-api-key` value."""
    scheme, _, value = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    key = headers.get("x-api-key", "").strip()
    return key or None


@dataclass(frozen=True)
class Guard:
    """Which requests need the token, and whether one carries it."""

    token: bytes | None
    metrics_public: bool = False

    @classmethod
    def of(cls, internal: InternalSettings) -> Guard:
        secret = internal.secret()
        return cls(secret.encode() if secret else None, internal.metrics_public)

    def is_open(self, path: str) -> bool:
        return self.token is None or path in PROBES or (self.metrics_public and path == METRICS)

    def refusal(self, path: str, headers: Mapping[str, str]) -> str | None:
        """None when the request may pass; else what is wrong with its credential."""
        if self.is_open(path):
            return None
        assert self.token is not None
        given = presented(headers)
        if given is None:
            return MISSING
        if not hmac.compare_digest(given.encode(), self.token):
            return WRONG
        return None


def unauthorized(message: str) -> JSONResponse:
    """The default 401 in OpenAI's error shape (for apps without an error builder of their own)."""
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": 401}}
    return JSONResponse(body, status_code=401)


def challenge(response: Response) -> Response:
    response.headers["www-authenticate"] = "Bearer"
    return response


class InternalAuth:
    """ASGI middleware: every path but the open ones needs the internal token."""

    def __init__(self, app: ASGIApp, guard: Guard, refuse: Refuse = unauthorized) -> None:
        self.app = app
        self.guard = guard
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        problem = self.guard.refusal(scope["path"], Headers(scope=scope))
        if problem is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "unauthorized"})
        else:
            await challenge(self.refuse(problem))(scope, receive, send)
