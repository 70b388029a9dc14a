"""VLLMClient against a small real HTTP stand-in for vLLM's OpenAI server.

The stand-in speaks the subset of vLLM's API the client uses — `/v1/completions`
(token-id prompts, `logprobs`, `return_tokens_as_token_ids`, `return_token_ids`,
`prompt_logprobs`, streaming with a usage chunk), `/v1/models`, `/health`, and the
development-mode endpoints (`/pause`, `/resume`, `/collective_rpc`, `/reset_prefix_cache`,
`/update_weight_version`, `/weight_info`) — with a deterministic toy "model".
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
from shared.errors import EngineRejected
from shared.schemas import SamplingParams
from shared.telemetry import embedded_server
from tests.support.servers import wait_until

pytestmark = pytest.mark.integration

EOS = 2


@dataclass
class FakeVLLM:
    """State of the stand-in: the toy model's "weights" (an offset) and what it saw."""

    dev_mode: bool = True
    token_ids_field: bool = True  # newer vLLM: choices[].token_ids with return_token_ids
    offset: int = 0
    version: str | None = None
    paused: str | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    client_ports: set[int] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)

    def next_token(self, prev: int) -> int:
        return (prev * 7 + 3 + self.offset) % 40 + 10

    @staticmethod
    def logprob(pos: int) -> float:
        return -0.25 * (pos % 4 + 1)


def completion(fake: FakeVLLM, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The toy model's output, one dict per token: id, text, logprob, finish, stop_reason."""
    prompt = body["prompt"]
    assert isinstance(prompt, list) and all(isinstance(t, int) for t in prompt), "token-id prompts"
    stops = body.get("stop") or []
    stop_ids = set(body.get("stop_token_ids") or [])
    out: list[dict[str, Any]] = []
    prev, text = prompt[-1], ""
    for pos in range(body.get("max_tokens") or 16):
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
        if request.url.path in ("/pause", "/resume", "/collective_rpc", "/update_weight_version", "/weight_info", "/reset_prefix_cache") and not fake.dev_mode:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        response: Response = await call_next(request)
        return response

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "toy", "object": "model", "root": "/models/toy", "max_model_len": 4096}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        fake.requests.append(body)
        if body.get("model") != "toy":
            return JSONResponse({"error": {"message": f"model {body.get('model')} not found", "type": "NotFoundError", "code": 404}}, status_code=404)
        if body.get("max_tokens", 1) < 1:
            return JSONResponse({"error": {"message": "max_tokens must be at least 1", "type": "BadRequestError", "code": 400}}, status_code=400)
        prompt = body["prompt"]
        if body.get("prompt_logprobs") is not None:
            rows: list[Any] = [None] + [{str(t): {"logprob": -0.01 * j, "rank": 1, "decoded_token": f"<{t}>"}} for j, t in enumerate(prompt[1:], 1)]
        else:
            rows = []
        toks = completion(fake, body)
        as_ids = bool(body.get("return_tokens_as_token_ids"))

        def choice(items: list[dict[str, Any]], finish: str | None, stop_reason: Any) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "text": "".join(i["text"] for i in items), "finish_reason": finish, "stop_reason": stop_reason}
            if body.get("logprobs") is not None:
                c["logprobs"] = {
                    "tokens": [f"token_id:{i['id']}" if as_ids else f"<{i['id']}>" for i in items],
                    "token_logprobs": [i["logprob"] for i in items],
                    "top_logprobs": None,
                    "text_offset": [0] * len(items),
                }
            if fake.token_ids_field and body.get("return_token_ids"):
                c["token_ids"] = [i["id"] for i in items]
            return c

        if not body.get("stream"):
            ch = choice(toks, toks[-1]["finish"], toks[-1]["stop_reason"])
            if rows:
                ch["prompt_logprobs"] = rows
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(toks), "total_tokens": len(prompt) + len(toks)}
            return JSONResponse({"id": "cmpl-1", "object": "text_completion", "model": "toy", "choices": [ch], "usage": usage})

        async def events() -> AsyncIterator[bytes]:
            for item in toks:
                chunk = {"id": "cmpl-1", "object": "text_completion", "model": "toy", "choices": [choice([item], item["finish"], item["stop_reason"])]}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(toks)}
            yield b"data: " + json.dumps({"id": "cmpl-1", "choices": [], "usage": usage}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

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
        if not (path / "config.json").is_file():
            return JSONResponse({"error": f"no checkpoint at {path}"}, status_code=500)
        fake.offset = json.loads((path / "config.json").read_text())["offset"]
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
        res = await client.generate([1, 2, 3], sampling, stop_token_ids=[EOS])
        streamed = await join_stream(client.stream([1, 2, 3], sampling, stop_token_ids=[EOS]))
        fake.token_ids_field = False  # older vLLM: ids only through "token_id:<id>" tokens
        older = await client.generate([1, 2, 3], sampling)
    sent = fake.requests[0]
    assert sent["prompt"] == [1, 2, 3] and sent["model"] == "toy"
    assert sent["logprobs"] == 0 and sent["return_tokens_as_token_ids"] is True
    assert (sent["temperature"], sent["top_p"], sent["top_k"], sent["seed"], sent["max_tokens"]) == (0.8, 0.9, 5, 3, 6)
    assert sent["stop_token_ids"] == [EOS]
    assert len(res.output_ids) == 6 == len(res.output_logprobs) and res.finish_reason == "length"
    assert res.text == "".join(f"<{t}>" for t in res.output_ids)
    assert res.output_logprobs == [FakeVLLM.logprob(i) for i in range(6)]
    assert (streamed.output_ids, streamed.output_logprobs, streamed.text) == (res.output_ids, res.output_logprobs, res.text)
    assert older.output_ids == res.output_ids
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


async def test_score_uses_prompt_logprobs(vllm: tuple[FakeVLLM, str]) -> None:
    fake, url = vllm
    async with VLLMClient(url, timeout=10) as client:
        assert await client.score([5, 6, 7, 8], 2) == pytest.approx([-0.02, -0.03])
    assert fake.requests[-1]["prompt_logprobs"] == 0 and fake.requests[-1]["max_tokens"] == 1


async def test_update_weights_drives_the_dev_mode_endpoints(vllm: tuple[FakeVLLM, str], tmp_path: Path) -> None:
    fake, url = vllm
    ckpt = tmp_path / "v5"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"offset": 5}))
    async with VLLMClient(url, timeout=10) as client:
        before = await client.generate([1], SamplingParams(max_tokens=4))
        assert await client.weight_version() == "0"  # the stand-in has no version yet
        ok, msg = await client.update_weights(str(ckpt), "5", abort_all_requests=True)
        assert ok, msg
        after = await client.generate([1], SamplingParams(max_tokens=4))
        assert after.output_ids != before.output_ids and after.weight_version == "5"
        assert await client.weight_version() == "5" and (await client.model_info())["weight_version"] == "5"
        ok, msg = await client.update_weights(str(tmp_path / "missing"), "6")
        assert not ok and "could not reload" in msg
        assert await client.weight_version() == "5"
    reload_calls = [c for c in fake.calls if c in ("/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume")]
    assert reload_calls[:5] == ["/pause", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"]
    assert reload_calls[5:] == ["/pause", "/collective_rpc", "/resume"]  # resumed even on failure
    assert fake.paused is None


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
