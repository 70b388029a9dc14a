"""One small async interface to the inference engine, for the collector, judge and watcher.

    async with make_engine_client("sglang", "http://127.0.0.1:30000") as engine:
        result = await engine.generate(prompt_ids, SamplingParams(temperature=1.0, seed=7))
        async for chunk in engine.stream(prompt_ids, sampling): ...
        teacher = await engine.score(prompt_ids + result.output_ids, start=len(prompt_ids))
        ok, message = await engine.update_weights("/ckpt/v000042", "42")
        answer = await engine.load_adapter("43", "/ckpt/v000043")   # a LoRA version, by name
        ok, message = await serve_version(engine, path, manifest)    # either, as the manifest says

`SGLangClient` speaks SGLang's native API (which our CPU engine implements);
`VLLMClient` speaks vLLM's OpenAI server (see vllm.py for what it supports).
`serve_version` (versions.py) puts a committed version into an engine whatever its format.
"""

from __future__ import annotations

from typing import Any, Literal

from shared.engine_client.base import (
    AdapterAnswer,
    ChunkJoiner,
    EngineClient,
    GenerateChunk,
    GenerateResult,
    SamplingLike,
    join_stream,
)
from shared.engine_client.sglang import SGLangClient
from shared.engine_client.vllm import VLLMClient
from shared.errors import EngineNotSupported

EngineKind = Literal["sglang", "vllm"]

__all__ = [
    "AdapterAnswer",
    "ChunkJoiner",
    "EngineClient",
    "EngineKind",
    "EngineNotSupported",
    "GenerateChunk",
    "GenerateResult",
    "SGLangClient",
    "SamplingLike",
    "VLLMClient",
    "join_stream",
    "make_engine_client",
]


def make_engine_client(kind: EngineKind | str, url: str, **kwargs: Any) -> SGLangClient | VLLMClient:
    """An engine client for `kind` ("sglang" — also our CPU engine — or "vllm") at `url`.

    kwargs: timeout, connect_timeout, max_connections, update_timeout, default_max_tokens,
    api_key (sent as `Authorization: Bearer`: the stack's NEXTSTATE_INTERNAL__TOKEN),
    adapters (name the served LoRA adapter in every request), and for vLLM `model` (default:
    the first served model).
    """
    if kind == "sglang":
        return SGLangClient(url, **kwargs)
    if kind == "vllm":
        return VLLMClient(url, **kwargs)
    raise ValueError(f"unknown engine kind {kind!r}: sglang or vllm")
