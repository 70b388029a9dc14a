"""VLLMClient against a small real HTTP stand-in for vLLM's server (0.32).

The stand-in speaks the subset of vLLM's API the client uses — `/inference/v1/generate`
(token ids in, `output_mode: "text"`, log-probs as `token_id:<id>` tokens, per-token
`weight_versions`, streaming with a usage chunk), `/v1/completions` for `prompt_logprobs`,
`/v1/models`, `/health`, and the development-mode endpoints (`/pause`, `/resume`,
`/collective_rpc`, `/reset_prefix_cache`, `/update_weight_version`, `/weight_info`) — with a
deterministic toy "model". It behaves as the real server does where these tests depend on
it: vLLM's first version is "default", and a `reload_weights` that fails answers 500 and
leaves the model half-reloaded: the next generation kills the engine (that request and
every later one answer 500, `/health` 503) unless a reload that works comes first. tests/integration/test_vllm_real.py runs the same client against the real vLLM.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.ctl.infra import free_port
from shared.engine_client import EngineNotSupported, VLLMClient, join_stream
from shared.errors import EngineDied, EngineRejected, EngineUnavailable
from shared.schemas import SamplingParams
from shared.telemetry import embedded_server
from tests.support.servers import wait_until

pytestmark = pytest.mark.integration

EOS = 2
DEV_ROUTES = ("/pause", "/resume", "/collective_rpc", "/update_weight_version", "/weight_info", "/reset_prefix_cache")
DEAD = {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                  "type": "InternalServerError", "param": None, "code": 500}}


@dataclass
class FakeVLLM:
    """State of the stand-in: the toy model's "weights" (an offset) and what it saw."""

    dev_mode: bool = True
    offset: int = 0
    version: str = "default"
    paused: str | None = None
    poisoned: bool = False  # a reload_weights failed: the model is half-reloaded
    broken_reloads: bool = False  # every reload_weights fails (the restore too)
    dead: bool = False  # a generation on a half-reloaded model killed the engine core
    requests: list[dict[str, Any]] = field(default_factory=list)
    client_ports: set[int] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)

    def next_token(self, prev: int) -> int:
        return (prev * 7 + 3 + self.offset) % 40 + 10

    @staticmethod
    def logprob(pos: int) -> float:
        return -0.25 * (pos % 4 + 1)


def completion(fake: FakeVLLM, params: dict[str, Any], prompt: list[int]) -> list[dict[str, Any]]:
    """The toy model's output, one dict per token: id, text, logprob, finish, stop_reason."""
    stops = params.get("stop") or []
    stop_ids = set(params.get("stop_token_ids") or [])
    out: list[dict[str, Any]] = []
    prev, text = prompt[-1], ""
    for pos in range(params.get("max_tokens") or 16):
        tok = fake.next_token(prev)
        piece = f"<{tok}>"
        text += piece
        item: dict[str, Any] = {"id": tok, "text": piece, "logprob": fake.logprob(pos), "finish": None, "stop_reason": None}
        out.append(item)
        prev = tok
        hit = next((s for s in stops if s in text), None)
        if tok in stop_ids:
            item.update(finish="stop", stop_reason=tok, text="")
            break
        if hit is not None:
            item.update(finish="stop", stop_reason=hit, text=piece[: len(piece) - (len(text) - text.find(hit))])
            break
    else:
        out[-1]["finish"] = "length"
    return out


def fake_app(fake: FakeVLLM) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Response:
        if request.client is not None:
            fake.client_ports.add(request.client.port)
        fake.calls.append(request.url.path)
        if request.url.path in DEV_ROUTES and not fake.dev_mode:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        if fake.dead:
            return Response(status_code=503) if request.url.path == "/health" else JSONResponse(DEAD, status_code=500)
        response: Response = await call_next(request)
        return response

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "toy", "object": "model", "root": "/models/toy", "max_model_len": 4096}]}

    @app.post("/inference/v1/generate")
    async def generate(request: Request) -> Response:
        body = await request.json()
        fake.requests.append(body)
        params, prompt = body["sampling_params"], body["token_ids"]
        assert isinstance(prompt, list) and all(isinstance(t, int) for t in prompt), "token-id prompts"
        assert body["output_mode"] == "text"
        if params.get("max_tokens", 1) < 1:
            return JSONResponse({"error": {"message": "max_tokens must be at least 1", "type": "BadRequestError", "code": 400}}, status_code=400)
        if fake.poisoned:
            fake.dead = True
            return JSONResponse(DEAD, status_code=500)
        toks = completion(fake, params, prompt)

        def choice(items: list[dict[str, Any]], finish: str | None, stop_reason: Any, last: bool) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "text": "".join(i["text"] for i in items), "finish_reason": finish,
                                 "stop_reason": stop_reason, "token_ids": [i["id"] for i in items]}
            if params.get("logprobs") is not None:
                c["logprobs"] = {"content": [{"token": f"token_id:{i['id']}", "logprob": i["logprob"], "bytes": None,
                                              "top_logprobs": [{"token": f"token_id:{i['id']}", "logprob": i["logprob"]}]}
                                             for i in items]}
            c["weight_versions"] = [{"version": fake.version, "start": 0, "end": len(toks)}] if last else None
            return c

        if not body.get("stream"):
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(toks), "total_tokens": len(prompt) + len(toks)}
            ch = choice(toks, toks[-1]["finish"], toks[-1]["stop_reason"], True)
            return JSONResponse({"request_id": "generate-tokens-1", "model": "toy", "choices": [ch], "usage": usage})

        async def events() -> AsyncIterator[bytes]:
            for n, item in enumerate(toks):
                done = n == len(toks) - 1
                chunk = {"request_id": "generate-tokens-1", "choices": [choice([item], item["finish"], item["stop_reason"], done)]}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(toks)}
            yield b"data: " + json.dumps({"request_id": "generate-tokens-1", "choices": [], "usage": usage}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        fake.requests.append(body)
        if body.get("model") != "toy":
            return JSONResponse({"error": {"message": f"model {body.get('model')} not found", "type": "NotFoundError", "code": 404}}, status_code=404)
        assert body.get("prompt_logprobs") == 0 and body.get("max_tokens") == 1, "only used to re-score prompts"
        prompt = body["prompt"]
        rows: list[Any] = [None] + [{str(t): {"logprob": -0.01 * j, "rank": 1, "decoded_token": f"<{t}>"}} for j, t in enumerate(prompt[1:], 1)]
        ch = {"index": 0, "text": "<1>", "finish_reason": "length", "prompt_logprobs": rows}
        return JSONResponse({"id": "cmpl-1", "object": "text_completion", "model": "toy", "choices": [ch]})

    @app.post("/pause")
    async def pause(mode: str = "abort") -> dict[str, Any]:
        fake.paused = mode
        return {"status": "paused"}

    @app.post("/resume")
    async def resume() -> dict[str, Any]:
        fake.paused = None
        return {"status": "resumed"}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> Response:
        body = await request.json()
        assert body["method"] == "reload_weights" and fake.paused is not None
        path = Path(body["kwargs"]["weights_path"])
        if fake.broken_reloads:
            fake.poisoned = True
            return JSONResponse({"error": {"message": "Worker failed", "type": "InternalServerError", "code": 500}}, status_code=500)
        if str(path) == "/models/toy":  # the served model's own folder
            fake.offset, fake.poisoned = 0, False
            return JSONResponse({"results": [None]})
        if not (path / "config.json").is_file():
            fake.poisoned = True  # as vLLM 0.32: half-reloaded, the next generation kills it
            msg = f"Call to collective_rpc method failed: Worker failed with error 'no weights at {path}'"
            return JSONResponse({"error": {"message": msg, "type": "InternalServerError", "code": 500}}, status_code=500)
        fake.offset, fake.poisoned = json.loads((path / "config.json").read_text())["offset"], False
        return JSONResponse({"results": [None]})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        return Response(status_code=200)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict[str, Any]:
        fake.version = (await request.json())["new_version"]
        return {"success": True, "new_version": fake.version}

    @app.get("/weight_info")
    async def weight_info() -> dict[str, Any]:
        return {"weight_version": fake.version}

    return app


@pytest.fixture
def vllm() -> Iterator[tuple[FakeVLLM, str]]:
    fake = FakeVLLM()
    port = free_port()
    server = embedded_server(fake_app(fake), "127.0.0.1", port)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: bool(server.started), 10, "the vLLM stand-in")
    yield fake, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


async def test_generate_and_stream_token_in_token_out(vllm: tuple[FakeVLLM, str]) -> None:
    fake, url = vllm
    sampling = SamplingParams(temperature=0.8, top_p=0.9, top_k=5, max_tokens=6, seed=3)
    async with VLLMClient(url, timeout=10) as client:
        res = await client.generate([1, 2, 3], sampling, stop_token_ids=[EOS], rid="r-1")
        streamed = await join_stream(client.stream([1, 2, 3], sampling, stop_token_ids=[EOS]))
    sent = fake.requests[0]
    assert sent["token_ids"] == [1, 2, 3] and sent["request_id"] == "r-1" and sent["stream"] is False
    params = sent["sampling_params"]
    assert params["logprobs"] == 0 and params["stop_token_ids"] == [EOS]
    assert (params["temperature"], params["top_p"], params["top_k"], params["seed"], params["max_tokens"]) == (0.8, 0.9, 5, 3, 6)
    assert len(res.output_ids) == 6 == len(res.output_logprobs) and res.finish_reason == "length"
    assert res.text == "".join(f"<{t}>" for t in res.output_ids)
    assert res.output_logprobs == [FakeVLLM.logprob(i) for i in range(6)]
    assert res.weight_version == "0"  # vLLM's "default" before any reload: the base model
    assert (streamed.output_ids, streamed.output_logprobs, streamed.text, streamed.weight_version) == \
        (res.output_ids, res.output_logprobs, res.text, "0")
    assert fake.requests[1]["stream"] is True and fake.requests[1]["stream_options"] == {"include_usage": True}


async def test_stops_report_what_matched(vllm: tuple[FakeVLLM, str]) -> None:
    _, url = vllm
    async with VLLMClient(url, timeout=10) as client:
        ref = await client.generate([1], SamplingParams(max_tokens=8))
        by_id = await client.generate([1], SamplingParams(max_tokens=8), stop_token_ids=[ref.output_ids[2]])
        by_str = await client.generate([1], SamplingParams(max_tokens=8, stop=[f"<{ref.output_ids[3]}>"]))
    assert by_id.finish_reason == "stop" and by_id.matched_stop == ref.output_ids[2]
    assert by_id.output_ids == ref.output_ids[:3]
    assert by_str.matched_stop == f"<{ref.output_ids[3]}>" and by_str.output_ids == ref.output_ids[:4]


async def test_score_uses_prompt_logprobs_at_temperature_one(vllm: tuple[FakeVLLM, str]) -> None:
    fake, url = vllm
    async with VLLMClient(url, timeout=10) as client:
        assert await client.score([5, 6, 7, 8], 2) == pytest.approx([-0.02, -0.03])
        sent = len(fake.requests)
        with pytest.raises(EngineNotSupported, match=r"temperature 0\.7"):
            await client.score([5, 6, 7, 8], 2, temperature=0.7)  # vLLM's prompt log-probs are raw
    assert len(fake.requests) == sent


async def test_update_weights_drives_the_dev_mode_endpoints(vllm: tuple[FakeVLLM, str], tmp_path: Path) -> None:
    fake, url = vllm
    ckpt = tmp_path / "v5"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"offset": 5}))
    async with VLLMClient(url, timeout=10) as client:
        before = await client.generate([1], SamplingParams(max_tokens=4))
        assert await client.weight_version() == "0"
        ok, msg = await client.update_weights(str(ckpt), "5", abort_all_requests=True)
        assert ok, msg
        assert fake.paused is None
        after = await client.generate([1], SamplingParams(max_tokens=4))
        assert after.output_ids != before.output_ids and after.weight_version == "5"
        assert await client.weight_version() == "5" and (await client.model_info())["weight_version"] == "5"
    reload_calls = [c for c in fake.calls if c in DEV_ROUTES and c != "/weight_info"]
    assert reload_calls == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"]


def checkpoint(root: Path, offset: int) -> Path:
    folder = root / f"v{offset}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"offset": offset}))
    return folder


async def test_a_failed_reload_puts_the_last_weights_back_and_resumes(vllm: tuple[FakeVLLM, str], tmp_path: Path) -> None:
    """vLLM 0.32 is left half-reloaded by a reload that fails, and dies of its next generation:
    the client reloads what it loaded last before it resumes, so the engine serves on."""
    fake, url = vllm
    async with VLLMClient(url, timeout=10) as client:
        ok, msg = await client.update_weights(str(checkpoint(tmp_path, 5)), "5")
        assert ok, msg
        before = await client.generate([1], SamplingParams(max_tokens=4))
        fake.calls.clear()
        ok, msg = await client.update_weights(str(tmp_path / "missing"), "6")
        assert not ok and "could not reload" in msg and "restored" in msg and "as version 5" in msg, msg
        after = await client.generate([1], SamplingParams(max_tokens=4))
        assert (after.output_ids, after.weight_version) == (before.output_ids, "5")
        assert await client.health() and fake.paused is None
    assert [c for c in fake.calls if c in DEV_ROUTES and c != "/weight_info"] == [
        "/pause", "/collective_rpc", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"]


async def test_a_fresh_client_puts_the_served_models_own_weights_back(vllm: tuple[FakeVLLM, str], tmp_path: Path) -> None:
    _, url = vllm
    async with VLLMClient(url, timeout=10) as client:
        ok, msg = await client.update_weights(str(tmp_path / "missing"), "6")
        assert not ok and "restored '/models/toy' as version 0" in msg, msg
        assert (await client.generate([1], SamplingParams(max_tokens=2))).weight_version == "0"


async def test_a_reload_that_cannot_be_put_right_is_engine_died_and_still_resumed(vllm: tuple[FakeVLLM, str], tmp_path: Path) -> None:
    fake, url = vllm
    async with VLLMClient(url, timeout=10) as client:
        v5 = checkpoint(tmp_path, 5)
        assert (await client.update_weights(str(v5), "5"))[0]
        (v5 / "config.json").unlink()  # what it loaded last is gone too
        with pytest.raises(EngineDied, match=r"could not reload .*could not restore .*must be restarted"):
            await client.update_weights(str(tmp_path / "missing"), "6")
        assert fake.paused is None  # resumed: requests fail fast rather than wait on a paused engine
        with pytest.raises(EngineUnavailable, match="EngineCore"):
            await client.generate([1], SamplingParams(max_tokens=2))
        assert not await client.health()


async def test_without_dev_mode_reload_is_not_supported(vllm: tuple[FakeVLLM, str]) -> None:
    fake, url = vllm
    fake.dev_mode = False
    async with VLLMClient(url, timeout=10) as client:
        with pytest.raises(EngineNotSupported, match="VLLM_SERVER_DEV_MODE"):
            await client.update_weights("/x", "1")
        with pytest.raises(EngineNotSupported):
            await client.pause()
        assert await client.weight_version() == "0"
        assert await client.health()
    assert "/collective_rpc" not in fake.calls


async def test_requests_share_one_pooled_connection(vllm: tuple[FakeVLLM, str]) -> None:
    fake, url = vllm
    async with VLLMClient(url, timeout=10, model="toy") as client:
        for _ in range(20):
            await client.generate([1, 2], SamplingParams(max_tokens=2))
        assert len(fake.client_ports) == 1  # one kept-alive connection for sequential calls
        await asyncio.gather(*(client.generate([1], SamplingParams(max_tokens=2)) for _ in range(4)))
        with pytest.raises(EngineRejected, match="max_tokens"):
            await client.generate([1], SamplingParams(max_tokens=0))
    assert len(fake.client_ports) <= 4  # never a connection per request


def test_the_watcher_reports_an_engine_that_dies_of_a_reload_loudly(
    vllm: tuple[FakeVLLM, str], s3_env: dict[str, str], redis_url: str, tmp_path: Path,
) -> None:  # fmt: skip
    """A verified version whose reload vLLM cannot complete, nor be put right after: the
    watcher (a real process) logs CRITICAL, refuses the version as `engine-died`, and the
    client resumed vLLM (no request is left waiting on a paused engine)."""
    import redis

    from shared import checkpoints as ckpt
    from shared.store import Bucket
    from tests.conftest import settings_from
    from tests.support.servers import ServiceProcess

    fake, url = vllm
    fake.broken_reloads = True
    run, prefix = s3_env["NEXTSTATE_RUN"], s3_env["NEXTSTATE_REDIS__PREFIX"]
    folder = checkpoint(tmp_path, 7)
    ckpt.publish_checkpoint(Bucket(settings_from(s3_env).bucket), run, 1, folder, step=1)
    watcher = ServiceProcess("watcher", {
        **s3_env, "NEXTSTATE_WATCHER__ENGINE_KIND": "vllm", "NEXTSTATE_WATCHER__ENGINE_URL": url,
        "NEXTSTATE_WATCHER__LOCAL_DIR": str(tmp_path / "local"), "NEXTSTATE_WATCHER__POLL_INTERVAL_S": "0.3",
        "NEXTSTATE_WATCHER__PORT": str(free_port()),
    }).start()  # fmt: skip
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        wait_until(lambda: "1" in r.hgetall(f"{prefix}:refused-versions"), 60, "v1 refused")
        assert "engine-died" in r.hgetall(f"{prefix}:refused-versions")["1"]
        wait_until(lambda: "CRITICAL" in watcher.logs(100_000), 10, "the CRITICAL line")
        assert "THE ENGINE IS DOWN" in watcher.logs(100_000)
        assert fake.paused is None and "/resume" in fake.calls
    finally:
        assert watcher.stop() in (0, None), watcher.logs()
