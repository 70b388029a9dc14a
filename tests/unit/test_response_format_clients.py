"""Constrained decoding and top log-probs through shared/engine_client, against
httpx.MockTransport stand-ins: SGLang gets its own `json_schema` / `regex` sampling params
and `top_logprobs_num`; vLLM gets `structured_outputs` and `logprobs: k+1` in its sampling params. The calling code
is the same for both."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from shared.engine_client import SGLangClient, VLLMClient, join_stream
from shared.schemas import SamplingParams

SCHEMA = '{"type":"object","properties":{"a":{"type":"integer"}}}'
IDS = [11, 12, 13]
LPS = [-0.5, -1.0, -0.25]
TOP = [[[-0.5, 11, None], [-1.5, 40, None]], [[-0.7, 41, None], [-1.0, 12, None]],
       [[-0.25, 13, None], [-2.0, 42, None]]]  # fmt: skip


def sglang(seen: list[dict[str, Any]], stream: bool = False) -> SGLangClient:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        k = body.get("top_logprobs_num", 0)

        def meta(n: int, done: bool) -> dict[str, Any]:
            m: dict[str, Any] = {"id": "r", "prompt_tokens": 2, "completion_tokens": n, "weight_version": "1",
                                 "finish_reason": {"type": "stop", "matched": 13} if done else None,
                                 "output_token_logprobs": [[lp, t, None] for lp, t in zip(LPS[:n], IDS, strict=False)]}  # fmt: skip
            if k:
                m["output_top_logprobs"] = [row[:k] for row in TOP[:n]]
            return m

        if not body["stream"]:
            return httpx.Response(200, json={"text": "{}", "output_ids": IDS, "meta_info": meta(3, True)})
        events = [{"text": "{}"[: n], "output_ids": IDS[:n], "meta_info": meta(n, n == 3)} for n in (1, 2, 3)]
        data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        return httpx.Response(200, content=data, headers={"content-type": "text/event-stream"})

    return SGLangClient("http://engine", transport=httpx.MockTransport(handler))


def test_sglang_gets_its_own_grammar_params_and_top_logprobs() -> None:
    seen: list[dict[str, Any]] = []

    async def run() -> None:
        async with sglang(seen) as eng:
            res = await eng.generate([1, 2], SamplingParams(json_schema=SCHEMA), top_logprobs_num=2)
            assert res.output_top_logprobs == [[(11, -0.5), (40, -1.5)], [(41, -0.7), (12, -1.0)],
                                               [(13, -0.25), (42, -2.0)]]  # fmt: skip
            streamed = await join_stream(eng.stream([1, 2], SamplingParams(regex="a+"), top_logprobs_num=1))
            assert streamed.output_top_logprobs == [[(11, -0.5)], [(41, -0.7)], [(13, -0.25)]]
            assert streamed.output_logprobs == LPS
            plain = await eng.generate([1, 2], SamplingParams())
            assert plain.output_top_logprobs == []

    asyncio.run(run())
    constrained, regex, plain = seen
    assert constrained["sampling_params"]["json_schema"] == SCHEMA
    assert constrained["top_logprobs_num"] == 2 and constrained["return_logprob"] is True
    assert regex["sampling_params"]["regex"] == "a+" and regex["top_logprobs_num"] == 1
    assert "json_schema" not in plain["sampling_params"] and "regex" not in plain["sampling_params"]
    assert "top_logprobs_num" not in plain


def test_vllm_gets_structured_outputs_and_logprobs_k() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/inference/v1/generate"
        body = json.loads(request.content)
        seen.append(body)
        k = body["sampling_params"]["logprobs"]
        # vLLM lists the sampled token first, then the best others, cut at the number asked
        content = [{"token": f"token_id:{i}", "logprob": lp,
                    "top_logprobs": ([{"token": f"token_id:{i}", "logprob": lp}]
                                     + [{"token": f"token_id:{t}", "logprob": v} for v, t, _ in row if t != i])[:k]}
                   for row, i, lp in zip(TOP, IDS, LPS, strict=True)]  # fmt: skip
        choice = {"text": "{}", "token_ids": IDS, "finish_reason": "stop", "logprobs": {"content": content},
                  "weight_versions": [{"version": "default", "start": 0, "end": len(IDS)}]}  # fmt: skip
        return httpx.Response(200, json={"request_id": "x", "choices": [choice], "usage": {}})

    async def run() -> None:
        async with VLLMClient("http://vllm", model="m", transport=httpx.MockTransport(handler)) as eng:
            res = await eng.generate([1, 2], SamplingParams(json_schema=SCHEMA), top_logprobs_num=1)
            # k+1 asked, so the k best are there whether or not the sampled token is among them
            assert res.output_top_logprobs == [[(11, -0.5)], [(41, -0.7)], [(13, -0.25)]]
            assert res.weight_version == "0"  # vLLM's initial "default": the base model
            await eng.generate([1, 2], SamplingParams(regex="a+"))
            await eng.generate([1, 2], SamplingParams())

    asyncio.run(run())
    constrained, regex, plain = (body["sampling_params"] for body in seen)
    assert constrained["structured_outputs"] == {"json": json.loads(SCHEMA)} and constrained["logprobs"] == 2
    assert regex["structured_outputs"] == {"regex": "a+"} and regex["logprobs"] == 0
    assert "structured_outputs" not in plain
