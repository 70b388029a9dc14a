"""The internal credential without processes: settings, the guard and middleware (ASGI in
process), the ops routes, the clients' header, the judge model's key, `up`'s token."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from services.judge.settings import JudgeSettings
from shared.auth import MISSING, WRONG, Guard, InternalAuth, bearer, presented
from shared.engine_client import make_engine_client
from shared.errors import EngineRejected, SettingsError
from shared.settings import InternalSettings, Settings, load_settings
from shared.telemetry import ops_app

TOKEN = "0123456789abcdef-internal"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("NEXTSTATE_")]:
        monkeypatch.delenv(name)


# -- settings ---------------------------------------------------------------------------------
def test_the_token_is_optional_outside_prod_and_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(Settings).internal == InternalSettings()
    monkeypatch.setenv("NEXTSTATE_INTERNAL__TOKEN", "   ")  # empty: unset
    assert load_settings(Settings).internal.token is None
    monkeypatch.setenv("NEXTSTATE_INTERNAL__TOKEN", TOKEN)
    monkeypatch.setenv("NEXTSTATE_INTERNAL__METRICS_PUBLIC", "true")
    s = load_settings(Settings)
    assert (s.internal.secret(), s.internal.metrics_public) == (TOKEN, True)
    assert TOKEN not in repr(s) and TOKEN not in str(s.model_dump())


@pytest.mark.parametrize("bad", ["short", "has a space in it, long enough", "ünïcödé-token-0123456"])
def test_a_weak_or_unsendable_token_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv("NEXTSTATE_INTERNAL__TOKEN", bad)
    with pytest.raises(SettingsError, match="NEXTSTATE_INTERNAL__TOKEN: at least 16 printable"):
        load_settings(Settings)


def test_prod_refuses_to_start_without_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"NEXTSTATE_ENV": "prod", "NEXTSTATE_BUCKET__ACCESS_KEY": "a",
                 "NEXTSTATE_BUCKET__SECRET_KEY": "b"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    with pytest.raises(SettingsError, match="NEXTSTATE_INTERNAL__TOKEN is not set") as err:
        load_settings(Settings)
    assert "NEXTSTATE_ENV=prod" in str(err.value)
    monkeypatch.setenv("NEXTSTATE_INTERNAL__TOKEN", TOKEN)
    assert load_settings(Settings).internal.secret() == TOKEN


# -- the guard and the middleware ---------------------------------------------------------------
def test_presented_reads_bearer_any_case_then_x_api_key() -> None:
    assert presented({"authorization": f"Bearer {TOKEN}"}) == TOKEN
    assert presented({"authorization": f"bearer   {TOKEN} "}) == TOKEN
    assert presented({"x-api-key": TOKEN}) == TOKEN
    assert presented({"authorization": f"Basic {TOKEN}"}) is None
    assert presented({"authorization": "Bearer "}) is None and presented({}) is None
    assert bearer(TOKEN) == {"authorization": f"Bearer {TOKEN}"} and bearer(None) == {}


def app_with(internal: InternalSettings) -> FastAPI:
    app = ops_app({}, None)  # the ops routes, behind the middleware like the engine's
    app.post("/update_weights_from_disk")(lambda: {"success": True})
    app.add_middleware(InternalAuth, guard=Guard.of(internal))
    return app


async def call(app: Any, method: str, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        return await c.request(method, path, headers=headers or {})


def assert_refused(resp: httpx.Response, message: str) -> None:
    assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
    err = resp.json()["error"]
    assert err["message"] == message and err["type"] == "invalid_request_error" and err["code"] == 401


async def test_middleware_refuses_missing_and_wrong_and_passes_the_token() -> None:
    app = app_with(InternalSettings(token=TOKEN))
    assert_refused(await call(app, "POST", "/update_weights_from_disk"), MISSING)
    assert_refused(await call(app, "POST", "/update_weights_from_disk", bearer("x" * 25)), WRONG)
    assert_refused(await call(app, "POST", "/update_weights_from_disk", bearer(TOKEN + "x")), WRONG)
    assert (await call(app, "POST", "/update_weights_from_disk", bearer(TOKEN))).json() == {"success": True}
    assert (await call(app, "POST", "/update_weights_from_disk", {"x-api-key": TOKEN})).status_code == 200
    assert_refused(await call(app, "GET", "/metrics"), MISSING)
    assert_refused(await call(app, "GET", "/no/such/route"), MISSING)  # nothing to learn without it
    for probe in ("/healthz", "/readyz"):
        assert (await call(app, "GET", probe)).status_code == 200


async def test_metrics_public_and_dev_mode() -> None:
    public = app_with(InternalSettings(token=TOKEN, metrics_public=True))
    assert (await call(public, "GET", "/metrics")).status_code == 200
    assert_refused(await call(public, "POST", "/update_weights_from_disk"), MISSING)
    dev = app_with(InternalSettings())  # no token: everything open (dev and test only)
    assert (await call(dev, "POST", "/update_weights_from_disk")).status_code == 200
    assert (await call(dev, "GET", "/metrics")).status_code == 200


async def test_a_refusal_uses_the_apps_own_error_builder() -> None:
    app = FastAPI()
    app.get("/get_data")(lambda: {"count": 0})

    def buffer_error(message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "auth", "code": 401}, "x": 1}, 401)

    app.add_middleware(InternalAuth, guard=Guard.of(InternalSettings(token=TOKEN)), refuse=buffer_error)
    resp = await call(app, "GET", "/get_data")
    assert resp.status_code == 401 and resp.json()["x"] == 1 and resp.headers["www-authenticate"] == "Bearer"


async def test_ops_routes_protect_metrics_without_a_middleware() -> None:
    """An app with an API of its own (the collector) protects only its ops /metrics."""
    app = ops_app({}, InternalSettings(token=TOKEN))
    app.get("/v1/models")(lambda: {"data": []})  # its own keys, not ours
    assert_refused(await call(app, "GET", "/metrics"), MISSING)
    assert_refused(await call(app, "GET", "/metrics", bearer("y" * 20)), WRONG)
    assert (await call(app, "GET", "/metrics", bearer(TOKEN))).text.startswith("# HELP")
    assert (await call(app, "GET", "/v1/models")).status_code == 200
    assert (await call(app, "GET", "/healthz")).status_code == 200
    public = ops_app({}, InternalSettings(token=TOKEN, metrics_public=True))
    assert (await call(public, "GET", "/metrics")).status_code == 200


# -- clients ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sglang", "vllm"])
async def test_engine_clients_send_the_bearer_token_on_every_call(kind: str) -> None:
    seen: list[tuple[str, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("authorization")))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(200, json={"success": True, "weight_version": "3"})

    async with make_engine_client(kind, "http://e", api_key=TOKEN, transport=httpx.MockTransport(handler)) as c:
        await c.health()
        await c.weight_version()
        await c.model_info()
    assert seen and all(auth == f"Bearer {TOKEN}" for _, auth in seen), seen


async def test_a_401_from_the_engine_says_which_variable_to_set() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": MISSING, "type": "invalid_request_error"}})

    async with make_engine_client("sglang", "http://e", transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(EngineRejected, match="NEXTSTATE_INTERNAL__TOKEN") as err:
            await c.model_info()
    assert err.value.status_code == 401


@pytest.mark.parametrize(("url", "engine_url", "key", "expected"), [
    ("http://engine:30000", "http://engine:30000", None, TOKEN),          # the engine judges itself
    ("http://engine:30000/v1", "http://engine:30000/", None, TOKEN),      # /v1, trailing slash
    ("https://api.example.com/v1", "http://engine:30000", None, None),   # a hosted API: never ours
    ("http://engine:30001", "http://engine:30000", None, None),          # another server
    ("http://engine:30000", None, None, None),                           # no engine configured
    ("http://engine:30000", "http://engine:30000", "own-key", "own-key"),  # its own key wins
])  # fmt: skip
def test_the_judge_model_key(
    monkeypatch: pytest.MonkeyPatch, url: str, engine_url: str | None, key: str | None, expected: str | None
) -> None:
    monkeypatch.setenv("NEXTSTATE_INTERNAL__TOKEN", TOKEN)
    monkeypatch.setenv("NEXTSTATE_JUDGE__URL", url)
    if engine_url is not None:
        monkeypatch.setenv("NEXTSTATE_JUDGE__ENGINE_URL", engine_url)
    if key is not None:
        monkeypatch.setenv("NEXTSTATE_JUDGE__API_KEY", key)
    got = load_settings(JudgeSettings).judge.api_key
    assert (got.get_secret_value() if got is not None else None) == expected


@pytest.mark.parametrize(("url", "key", "expected"), [
    ("http://judge-model:30000", None, TOKEN),            # the stack's judge-model engine
    ("http://judge-model:30000/v1", "hosted-key", TOKEN),  # takes nothing else: a stray key is not sent
    ("https://api.example.com/v1", "hosted-key", "hosted-key"),  # a hosted judge: never the token
    ("https://api.example.com/v1", None, None),
])  # fmt: skip
def test_the_judge_model_engine_gets_the_internal_token(
    monkeypatch: pytest.MonkeyPatch, url: str, key: str | None, expected: str | None
) -> None:
    monkeypatch.setenv("NEXTSTATE_INTERNAL__TOKEN", TOKEN)
    monkeypatch.setenv("NEXTSTATE_JUDGE__URL", url)
    monkeypatch.setenv("NEXTSTATE_JUDGE__ENGINE_URL", "http://engine:30000")
    monkeypatch.setenv("NEXTSTATE_JUDGE__JUDGE_ENGINE_URL", "http://judge-model:30000")
    if key is not None:
        monkeypatch.setenv("NEXTSTATE_JUDGE__API_KEY", key)
    got = load_settings(JudgeSettings).judge.api_key
    assert (got.get_secret_value() if got is not None else None) == expected


# -- nextstate up ---------------------------------------------------------------------------------
def test_up_generates_a_token_per_start_unless_one_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.ctl.up import internal_token

    monkeypatch.setenv("NEXTSTATE_INTERNAL__TOKEN", "")  # unset, and undone after the test
    first = internal_token()
    assert os.environ["NEXTSTATE_INTERNAL__TOKEN"] == first  # what every service inherits
    assert load_settings(Settings).internal.secret() == first  # a valid token
    monkeypatch.delenv("NEXTSTATE_INTERNAL__TOKEN")
    assert internal_token() != first
    monkeypatch.setenv("NEXTSTATE_INTERNAL__TOKEN", TOKEN)
    assert internal_token() == TOKEN


def test_up_records_the_token_owner_only(tmp_path: Path) -> None:
    from services.ctl.__main__ import build_parser
    from services.ctl.up import Stack

    args = build_parser().parse_args(["up", "--home", str(tmp_path)])
    stack = Stack(args, load_settings(Settings))
    stack.add_secrets(internal_token=TOKEN)
    assert json.loads(stack.secrets_path.read_text())["internal_token"] == TOKEN
    assert stat.S_IMODE(stack.secrets_path.stat().st_mode) == 0o600
