"""The closed control plane with real processes: every internal endpoint refuses a request
without the internal token (or with a wrong one) with a 401 in its API's error shape,
answers with it, and leaves the probes open; every client in the stack sends it.

One engine with a token serves the module: its native, control and OpenAI routes; the
SGLang client and the OpenAI SDK against it; a collector in front of it (user keys on
/v1, the internal token on its /metrics); a judge whose judge model is that engine. One
buffer with a token: /get_data, /receive, /metrics, `nextstate import` and slime's
rollout source. And a service in prod without the token refuses to start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from shared.auth import MISSING, WRONG, bearer
from shared.engine_client import SGLangClient
from shared.errors import EngineRejected, SettingsError
from shared.schemas import SamplingParams, ScoredTurn, Turn
from shared.settings import Settings
from shared.streams import Bus
from tests.conftest import settings_from
from tests.integration.test_buffer_service import process_env
from tests.integration.test_engine import PROMPT, start_engine
from tests.support.collector_harness import collector_process, wait_ready
from tests.support.servers import REPO, ServiceProcess, free_port
from tests.support.tiny_model import build_tokenizer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

TOKEN = "integration-internal-token-0123"
AUTH = bearer(TOKEN)
WRONG_AUTH = bearer("not-the-internal-token-0123")
USER_KEY = "user-key-for-agents-0123"


def assert_refused(resp: httpx.Response, message: str = MISSING) -> None:
    """401 in OpenAI's error shape, with a bearer challenge."""
    assert resp.status_code == 401, resp.text
    assert resp.headers["www-authenticate"] == "Bearer"
    err = resp.json()["error"]
    assert err["message"] == message and err["type"] == "invalid_request_error" and err["code"] == 401


def own_env(redis_url: str) -> dict[str, str]:
    unique = uuid.uuid4().hex[:10]
    return {"NEXTSTATE_ENV": "test", "NEXTSTATE_RUN": f"run-{unique}", "NEXTSTATE_REDIS__URL": redis_url,
            "NEXTSTATE_REDIS__PREFIX": f"t-{unique}", "NEXTSTATE_INTERNAL__TOKEN": TOKEN}


# -- the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[str]:
    proc, url = start_engine(tiny_model, NEXTSTATE_INTERNAL__TOKEN=TOKEN, NEXTSTATE_ENGINE__MAX_RUNNING="4")
    yield url
    assert proc.stop() == 0, proc.logs()


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}),
    ("POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "stream": True}),
    ("POST", "/v1/chat/completions", CHAT),
    ("GET", "/v1/models", None),
    ("GET", "/model_info", None),
    ("GET", "/get_weight_version", None),
    ("GET", "/get_server_info", None),
    ("POST", "/flush_cache", None),
    ("GET", "/health_generate", None),
    ("GET", "/metrics", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_every_engine_route_needs_the_token(engine: str, method: str, path: str, body: Any) -> None:
    with httpx.Client(base_url=engine, timeout=60) as http:
        assert_refused(http.request(method, path, json=body))
        assert_refused(http.request(method, path, json=body, headers=WRONG_AUTH), WRONG)
        ok = http.request(method, path, json=body, headers=AUTH)
        assert ok.status_code == 200, ok.text


def test_control_routes_do_nothing_without_the_token(engine: str, tiny_model: Path) -> None:
    with httpx.Client(base_url=engine, timeout=120) as http:
        def state() -> dict[str, Any]:
            return dict(http.get("/get_server_info", headers=AUTH).json())

        update = {"model_path": str(tiny_model), "weight_version": "7"}
        assert_refused(http.post("/update_weights_from_disk", json=update))
        assert_refused(http.post("/update_weights_from_disk", json=update, headers=WRONG_AUTH), WRONG)
        assert state()["weight_version"] == "0"
        assert_refused(http.post("/pause_generation", json={"mode": "in_place"}))
        assert state()["paused"] is False
        assert http.post("/pause_generation", json={"mode": "in_place"}, headers=AUTH).status_code == 200
        try:
            assert state()["paused"] is True
            assert_refused(http.post("/continue_generation", json={}, headers=WRONG_AUTH), WRONG)
            assert state()["paused"] is True
        finally:
            assert http.post("/continue_generation", json={}, headers=AUTH).status_code == 200
        assert state()["paused"] is False
        done = http.post("/update_weights_from_disk", json={**update, "weight_version": "0"}, headers=AUTH)
        assert done.status_code == 200 and done.json()["success"], done.text


def test_probes_stay_open(engine: str) -> None:
    for path in ("/health", "/healthz", "/readyz"):
        assert httpx.get(f"{engine}{path}", timeout=10).status_code == 200, path


async def test_the_sglang_client_sends_the_token(engine: str, tiny_model: Path) -> None:
    async with SGLangClient(engine, timeout=60, api_key=TOKEN) as client:
        res = await client.generate(PROMPT, SamplingParams(max_tokens=3, seed=1))
        chunks = [c async for c in client.stream(PROMPT, SamplingParams(max_tokens=3, seed=1))]
        assert [i for c in chunks for i in c.new_ids] == res.output_ids
        assert len(await client.score(PROMPT + res.output_ids, len(PROMPT))) == 3
        assert (await client.model_info())["model_path"] == str(tiny_model)
        await client.pause()
        await client.resume()
        ok, msg = await client.update_weights(str(tiny_model), "0")
        assert ok, msg
    async with SGLangClient(engine, timeout=60) as anonymous:
        assert await anonymous.health()  # the probe is open
        with pytest.raises(EngineRejected, match="NEXTSTATE_INTERNAL__TOKEN") as err:
            await anonymous.generate(PROMPT, SamplingParams(max_tokens=3))
        assert err.value.status_code == 401


async def test_the_openai_sdk_uses_it_as_its_api_key(engine: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{engine}/v1", api_key=TOKEN, max_retries=0, timeout=60) as sdk:
        resp = await sdk.chat.completions.create(model="any", max_tokens=2,
                                                 messages=[{"role": "user", "content": "hi"}])
        assert resp.usage is not None and resp.usage.completion_tokens <= 2
    async with openai.AsyncOpenAI(base_url=f"{engine}/v1", api_key="wrong-key", max_retries=0) as sdk:
        with pytest.raises(openai.AuthenticationError, match="incorrect credential"):
            await sdk.models.list()


async def test_the_collector_sends_it_and_guards_its_metrics(engine: str, redis_url: str) -> None:
    proc, url = collector_process(own_env(redis_url), engine, api_keys=USER_KEY)
    try:
        wait_ready(None, (proc, url))
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            user = bearer(USER_KEY)
            done = await http.post("/v1/chat/completions", headers=user, json={**CHAT, "model": "m"})
            assert done.status_code == 200, done.text  # the collector called the engine with the token
            assert (await http.get("/v1/models", headers=user)).status_code == 200
            # Its OpenAI routes take user keys, not the internal token; /metrics the reverse.
            assert (await http.get("/v1/models", headers=AUTH)).status_code == 401
            assert_refused(await http.get("/metrics"))
            assert_refused(await http.get("/metrics", headers=user), WRONG)
            assert "nextstate_collector" in (await http.get("/metrics", headers=AUTH)).text
            assert (await http.get("/healthz")).status_code == 200
            assert (await http.get("/readyz")).status_code == 200  # its engine check passes the token too
    finally:
        assert proc.stop() == 0, proc.logs()


async def test_a_judge_whose_judge_model_is_the_engine(engine: str, redis_url: str) -> None:
    """The judge sends the internal token to the engine as its judge model (no API_KEY set)
    and guards its own ops /metrics with it."""
    env = own_env(redis_url)
    port = free_port()
    judge = ServiceProcess("judge", {
        **env, "NEXTSTATE_JUDGE__TYPE": "prm", "NEXTSTATE_JUDGE__URL": engine,
        "NEXTSTATE_JUDGE__ENGINE_URL": engine, "NEXTSTATE_JUDGE__MODEL": "policy",
        "NEXTSTATE_JUDGE__MAX_TOKENS": "4", "NEXTSTATE_JUDGE__VOTES": "1",
        "NEXTSTATE_JUDGE__PORT": str(port), "NEXTSTATE_JUDGE__CONSUMER_NAME": "auth-judge",
    })  # fmt: skip
    ops = f"http://127.0.0.1:{port}"
    settings = settings_from(env)
    turn = Turn(session_id="auth", messages=[{"role": "user", "content": "hi"}],
                response={"role": "assistant", "content": "hello"}, prompt_ids=[1, 2], response_ids=[3],
                response_logprobs=[-0.1], next_state=[{"role": "user", "content": "thanks"}])  # fmt: skip
    async with Bus(settings) as bus:
        await bus.publish("turns", turn)
        try:
            judge.start().wait_http(f"{ops}/readyz", timeout=60)  # its judge-model check: /v1/models

            async def scored() -> list[ScoredTurn] | None:
                rows = await bus.redis.xrange(bus.keys.scored)
                return [ScoredTurn.from_json(f["data"]) for _, f in rows] or None

            (s,) = await eventually(scored, 60, "the turn judged")
            assert s.judged and [v.error for v in s.votes] == [None], s.votes
            async with httpx.AsyncClient(base_url=ops, timeout=10) as http:
                assert_refused(await http.get("/metrics"))
                assert "nextstate_judge" in (await http.get("/metrics", headers=AUTH)).text
                assert (await http.get("/healthz")).status_code == 200
        finally:
            assert judge.stop() == 0, judge.logs()


# -- the buffer ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def buffer(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Settings]]:
    tokenizer = tmp_path_factory.mktemp("auth-tok")
    build_tokenizer(tokenizer)
    env = own_env(redis_url)
    penv, url = process_env(env, tokenizer=tokenizer)
    proc = ServiceProcess("buffer", penv).start().wait_http(f"{url}/readyz", timeout=60)
    yield url, settings_from(env)
    assert proc.stop() == 0, proc.logs()


RECORD = {"session_id": "auth-s", "turns": [{"prompt": "p", "response": "r", "next_state": "thanks"}]}


@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/get_data", None), ("POST", "/receive", [RECORD]), ("GET", "/metrics", None),
])  # fmt: skip
def test_every_buffer_route_needs_the_token(
    buffer: tuple[str, Settings], method: str, path: str, body: Any
) -> None:
    url, _ = buffer
    with httpx.Client(base_url=url, timeout=30) as http:
        assert_refused(http.request(method, path, json=body))
        assert_refused(http.request(method, path, json=body, headers=WRONG_AUTH), WRONG)
        ok = http.request(method, path, json=body, headers=AUTH)
        assert ok.status_code == 200, ok.text
        for probe in ("/healthz", "/readyz"):
            assert http.get(probe).status_code == 200


@pytest.fixture
async def bus(buffer: tuple[str, Settings]) -> AsyncIterator[Bus]:
    async with Bus(buffer[1]) as b:
        yield b


def import_cli(url: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NEXTSTATE_")}
    return subprocess.run(
        [sys.executable, "-m", "services.ctl.importer", "--mock", "2", "--seed", "5", "--url", url],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**clean, **env},
    )


async def test_nextstate_import_finds_the_token(buffer: tuple[str, Settings], bus: Bus, tmp_path: Path) -> None:
    url, _ = buffer
    nowhere = {"NEXTSTATE_HOME": str(tmp_path / "empty")}  # no `nextstate up` to read it from
    refused = import_cli(url, nowhere)
    assert refused.returncode == 1 and "HTTP 401" in refused.stderr
    assert "Set NEXTSTATE_INTERNAL__TOKEN" in refused.stderr
    assert import_cli(url, {**nowhere, "NEXTSTATE_INTERNAL__TOKEN": TOKEN}).returncode == 0
    # From the running stack's secrets.json (what `nextstate up` records), for a local buffer.
    root = tmp_path / "home" / "up" / "auth-run"
    root.mkdir(parents=True)
    (root / "stack.json").write_text(json.dumps({"pid": os.getpid(), "run": "auth-run", "started_at": 1}))
    (root / "secrets.json").write_text(json.dumps({"internal_token": TOKEN}))
    found = import_cli(url, {"NEXTSTATE_HOME": str(tmp_path / "home")})
    assert found.returncode == 0, found.stderr
    rows = await bus.redis.xrange(bus.keys.turns)
    assert {Turn.from_json(f["data"]).session_id for _, f in rows} >= {"mock-5-0", "mock-5-1"}


def test_slimes_rollout_source_sends_the_token(buffer: tuple[str, Settings]) -> None:
    sys.path.insert(0, str(REPO / "deploy/slime"))
    import nextstate_rollout as R

    cfg = R.SlimeConfig(buffer_url=buffer[0], wait_s=0, timeout_s=10)
    with_token, without = R.RolloutSource(cfg, token=TOKEN), R.RolloutSource(cfg)
    try:
        assert with_token.pull() == []
        with pytest.raises(SettingsError, match="NEXTSTATE_INTERNAL__TOKEN"):
            without.pull()
    finally:
        with_token.close()
        without.close()


# -- prod -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["services.buffer"], ["services.engine", "--model", "/nowhere"],
                                  ["services.watcher"]], ids=["buffer", "engine", "watcher"])
def test_prod_without_the_token_refuses_to_start(argv: list[str]) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NEXTSTATE_")}
    env = {**clean, "NEXTSTATE_ENV": "prod", "NEXTSTATE_BUCKET__ACCESS_KEY": "real-access",
           "NEXTSTATE_BUCKET__SECRET_KEY": "real-secret"}
    out = subprocess.run([sys.executable, "-m", *argv], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "NEXTSTATE_INTERNAL__TOKEN is not set" in out.stderr
