"""The SGLang client's wire handling, against httpx.MockTransport stand-ins of the server:
request shapes, response and stream parsing (cumulative and incremental), error mapping.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from shared.engine_client import (
    EngineClient,
    SGLangClient,
    VLLMClient,
    join_stream,
    make_engine_client,
)
from shared.errors import EngineRejected, EngineTimeout, EngineUnavailable
from shared.schemas import SamplingParams

Handler = Callable[[httpx.Request], httpx.Response]


def client(handler: Handler, **kwargs: Any) -> SGLangClient:
    return SGLangClient("http://engine", transport=httpx.MockTransport(handler), **kwargs)


def sse(*events: Any) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def meta(n: int, finish: Any = None, **extra: Any) -> dict[str, Any]:
    return {"id": "r1", "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": n,
            "weight_version": "7", **extra}  # fmt: skip


IDS = [11, 12, 13, 14]
LPS = [-0.5, -1.0, -1.5, -2.0]
TEXT = ["a", "ab", "abc", "abcd"]


def cumulative_events() -> list[dict[str, Any]]:
    return [
        {"text": TEXT[i], "output_ids": IDS[: i + 1],
         "meta_info": meta(i + 1, {"type": "stop", "matched": 14} if i == 3 else None,
                           output_token_logprobs=[[lp, t, None] for lp, t in zip(LPS[: i + 1], IDS, strict=False)])}
        for i in range(4)
    ]  # fmt: skip


def incremental_events() -> list[dict[str, Any]]:
    return [
        {"text": TEXT[i][-1], "output_ids": [IDS[i]],
         "meta_info": meta(i + 1, {"type": "stop", "matched": 14} if i == 3 else None,
                           output_token_logprobs=[[LPS[i], IDS[i], None]])}
        for i in range(4)
    ]  # fmt: skip


async def test_generate_sends_sglang_fields_and_parses_the_answer() -> None:
    seen: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        body = {"text": "abcd", "output_ids": IDS,
                "meta_info": meta(4, {"type": "stop", "matched": "\n"}, e2e_latency=0.1,
                                  output_token_logprobs=[[lp, t, None] for lp, t in zip(LPS, IDS, strict=True)])}  # fmt: skip
        return httpx.Response(200, json=body)

    async with client(handler) as c:
        sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=64, stop=["\n"], seed=5)
        res = await c.generate([1, 2, 3], sampling, stop_token_ids=[2], rid="turn-1")
        await c.generate([1], {"temperature": 0.0, "ignore_eos": True})
    assert seen[0] == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64,
                            "stop": ["\n"], "sampling_seed": 5, "stop_token_ids": [2]},
        "return_logprob": True, "stream": False, "rid": "turn-1",
    }  # fmt: skip
    assert seen[1]["sampling_params"] == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "ignore_eos": True}
    assert (res.text, res.output_ids, res.output_logprobs) == ("abcd", IDS, LPS)
    assert (res.finish_reason, res.matched_stop, res.weight_version) == ("stop", "\n", "7")
    assert (res.prompt_tokens, res.completion_tokens, res.rid) == (3, 4, "r1")


@pytest.mark.parametrize("events", [cumulative_events(), incremental_events()], ids=["cumulative", "incremental"])
async def test_streams_parse_the_same_either_way(events: list[dict[str, Any]]) -> None:
    async with client(lambda r: httpx.Response(200, content=sse(*events))) as c:
        chunks = [ch async for ch in c.stream([1, 2, 3], SamplingParams())]
        joined = await join_stream(c.stream([1, 2, 3], SamplingParams()))
    assert [ch.new_ids for ch in chunks] == [[t] for t in IDS]
    assert [ch.new_logprobs for ch in chunks] == [[lp] for lp in LPS]
    assert [ch.new_text for ch in chunks] == ["a", "b", "c", "d"]
    assert [ch.text for ch in chunks] == TEXT
    assert [ch.done for ch in chunks] == [False, False, False, True]
    assert chunks[-1].matched_stop == 14 and chunks[-1].weight_version == "7"
    assert (joined.output_ids, joined.output_logprobs, joined.text) == (IDS, LPS, "abcd")


async def test_a_stream_without_its_final_chunk_is_unavailable() -> None:
    partial = sse(*cumulative_events()[:2])
    async with client(lambda r: httpx.Response(200, content=partial)) as c:
        with pytest.raises(EngineUnavailable, match="final chunk"):
            async for _ in c.stream([1], SamplingParams()):
                pass


@pytest.mark.parametrize(("code", "exc"), [(500, EngineUnavailable), (None, EngineRejected)])
async def test_an_error_event_in_a_stream_is_raised(code: int | None, exc: type[Exception]) -> None:
    body = sse(cumulative_events()[0], {"error": {"message": "boom", **({"code": code} if code else {})}})
    async with client(lambda r: httpx.Response(200, content=body)) as c:
        with pytest.raises(exc, match="boom"):
            async for _ in c.stream([1], SamplingParams()):
                pass


def _raise(exc: Exception) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    return handler


@pytest.mark.parametrize(
    ("handler", "exc"),
    [
        (lambda r: httpx.Response(503, json={"message": "queue is full"}), EngineUnavailable),
        (lambda r: httpx.Response(500, text="oops"), EngineUnavailable),
        (lambda r: httpx.Response(400, json={"object": "error", "message": "bad ids", "code": 400}), EngineRejected),
        (lambda r: httpx.Response(404, json={"detail": "Not Found"}), EngineRejected),
        (_raise(httpx.ConnectError("refused")), EngineUnavailable),
        (_raise(httpx.ConnectTimeout("slow")), EngineUnavailable),
        (_raise(httpx.ReadTimeout("stalled")), EngineTimeout),
        (_raise(httpx.RemoteProtocolError("dropped")), EngineUnavailable),
    ],
)
async def test_errors_map_onto_the_shared_tree(handler: Handler, exc: type[Exception]) -> None:
    async with client(handler) as c:
        with pytest.raises(exc) as err:
            await c.generate([1], SamplingParams())
        with pytest.raises(exc):
            async for _ in c.stream([1], SamplingParams()):
                pass
    if isinstance(err.value, EngineRejected):
        assert err.value.status_code in (400, 404)
        assert "bad ids" in str(err.value) or "Not Found" in str(err.value)


async def test_score_asks_from_start_minus_one_and_drops_the_null() -> None:
    seen: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        ids = body["input_ids"][body["logprob_start_len"] :]
        entries = [[None, ids[0], None]] + [[-0.1 * (i + 1), t, None] for i, t in enumerate(ids[1:])]
        return httpx.Response(200, json={"text": "", "output_ids": [], "meta_info": meta(0, {"type": "length", "length": 0}, input_token_logprobs=entries)})

    async with client(handler) as c:
        assert await c.score([5, 6, 7, 8, 9], 3, temperature=0.5) == pytest.approx([-0.1, -0.2])
        assert await c.score([5, 6], 1) == pytest.approx([-0.1])
        with pytest.raises(ValueError):
            await c.score([5, 6], 0)
    assert seen[0]["logprob_start_len"] == 2
    assert seen[0]["sampling_params"] == {"max_new_tokens": 0, "temperature": 0.5}


async def test_score_checks_the_tokens_it_got_back() -> None:
    wrong = {"text": "", "output_ids": [], "meta_info": meta(0, input_token_logprobs=[[None, 1, None], [-1.0, 99, None]])}
    async with client(lambda r: httpx.Response(200, json=wrong)) as c:
        with pytest.raises(EngineUnavailable, match="score"):
            await c.score([1, 2], 1)


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (200, {"success": True, "message": "ok", "num_paused_requests": 0}, (True, "ok")),
        (400, {"success": False, "message": "bad folder", "num_paused_requests": 0}, (False, "bad folder")),
    ],
)
async def test_update_weights_returns_success_and_message(status: int, body: dict[str, Any], expected: tuple[bool, str]) -> None:
    seen: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(status, json=body)

    async with client(handler) as c:
        assert await c.update_weights("/ckpt/v3", "3", abort_all_requests=True) == expected
    assert seen == [{"model_path": "/ckpt/v3", "weight_version": "3", "abort_all_requests": True}]


async def test_update_weights_raises_when_the_engine_fails() -> None:
    async with client(lambda r: httpx.Response(500, text="crash")) as c:
        with pytest.raises(EngineUnavailable):
            await c.update_weights("/x", "1")
    async with client(lambda r: httpx.Response(422, json={"detail": "model_path missing"})) as c:
        with pytest.raises(EngineRejected):
            await c.update_weights("/x", "1")


async def test_model_info_falls_back_to_older_sglang_paths() -> None:
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        if request.url.path in ("/model_info", "/get_weight_version"):
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(200, json={"model_path": "/m", "weight_version": "4"})

    async with client(handler) as c:
        assert (await c.model_info())["weight_version"] == "4"
        assert await c.model_info() == {"model_path": "/m", "weight_version": "4"}
        assert await c.weight_version() == "4"
    assert paths == ["/model_info", "/get_model_info", "/get_model_info", "/get_weight_version", "/get_model_info"]


async def test_health_never_raises() -> None:
    async with client(_raise(httpx.ConnectError("down"))) as c:
        assert await c.health() is False
    async with client(lambda r: httpx.Response(503)) as c:
        assert await c.health() is False
    async with client(lambda r: httpx.Response(200)) as c:
        assert await c.health() is True


async def test_pause_and_resume_use_sglang_endpoints() -> None:
    seen: list[tuple[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json={"status": "ok"})

    async with client(handler) as c:
        await c.pause()
        await c.pause(mode="abort")
        await c.resume()
    assert seen == [("/pause_generation", {"mode": "in_place"}), ("/pause_generation", {"mode": "abort"}),
                    ("/continue_generation", {})]  # fmt: skip


async def test_the_factory_and_the_protocol() -> None:
    async with make_engine_client("sglang", "http://x:1", timeout=3.0) as sg, make_engine_client("vllm", "http://y:2", model="m") as vl:
        assert isinstance(sg, SGLangClient) and isinstance(vl, VLLMClient)
        assert isinstance(sg, EngineClient) and isinstance(vl, EngineClient)
        assert sg.timeout == 3.0 and vl.model == "m"
    with pytest.raises(ValueError):
        make_engine_client("tgi", "http://z")
