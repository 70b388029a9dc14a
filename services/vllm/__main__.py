"""`python -m services.vllm [vLLM server arguments]`: vLLM's OpenAI server, every route behind
the internal token.

Run by the vLLM venv's Python (`.venv-vllm`, `make vllm`): it imports vLLM and the standard
library only. vLLM's own `--api-key` (or `VLLM_API_KEY`) guards just `/v1`, `/v2`,
`/inference` and `/cohere`; with `VLLM_SERVER_DEV_MODE=1`, which weight reloads need, its
development routes stay open — `/pause`, `/resume`, `/update_weight_version`,
`/reset_prefix_cache`, and `/collective_rpc`, which calls any worker method. Here the
check covers every path except the open probes (`/health`, `/ping`), as every other internal
endpoint of the stack does (shared/auth.py). The token is NEXTSTATE_INTERNAL__TOKEN, handed
to vLLM as `VLLM_API_KEY` so that it never appears on a command line; without one nothing is
guarded (development only, as for our own engine).

shared/vllm_engine.py builds the command and environment (CPU settings) for `up`, the bench
and the tests.
"""

from __future__ import annotations

import os
import sys
from typing import Any

OPEN_PATHS = frozenset({"/health", "/ping"})


def guard_every_route() -> None:
    """Swap vLLM's authentication middleware for one that guards every path but OPEN_PATHS.

    vLLM imports the class from its module when it builds the app, after this runs."""
    from starlette.datastructures import Headers
    from starlette.responses import JSONResponse
    from vllm.entrypoints.serve.middleware import authenticate

    base = authenticate.AuthenticationMiddleware

    class GuardEveryRoute(base):  # type: ignore[misc, valid-type]
        def __call__(self, scope: Any, receive: Any, send: Any) -> Any:
            if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
                path = scope["path"].removeprefix(scope.get("root_path", ""))
                if path not in OPEN_PATHS and not self.verify_token(Headers(scope=scope)):
                    body = {"error": {"message": "missing or wrong internal token (Authorization: "
                                                 "Bearer $NEXTSTATE_INTERNAL__TOKEN)",
                                      "type": "authentication_error", "code": 401}}
                    return JSONResponse(body, status_code=401)(scope, receive, send)
            return self.app(scope, receive, send)

    authenticate.AuthenticationMiddleware = GuardEveryRoute


def main() -> None:
    token = os.environ.get("NEXTSTATE_INTERNAL__TOKEN", "").strip()
    if token:
        os.environ["VLLM_API_KEY"] = token
    if any(a == "--api-key" or a.startswith("--api-key=") for a in sys.argv[1:]):
        sys.exit("python -m services.vllm: pass the token as NEXTSTATE_INTERNAL__TOKEN, not --api-key "
                 "(a command line is readable by every user of the machine)")
    guard_every_route()
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    sys.argv[0] = "python -m services.vllm"
    serve()


if __name__ == "__main__":
    main()
