"""Engine client overhead and CPU engine throughput.

1. Client overhead: `SGLangClient.generate` against a stand-in that answers a canned
   /generate body instantly, compared with a bare pooled httpx POST + JSON parse of the
   same body, and with a new httpx client per request (what we avoid). Printed as p50
   per call; the client's own cost is the difference to the bare POST. Target: ≤ 3 ms.
2. Engine: the real `python -m services.engine` (the tiny test model, or `--model` any
   HF folder such as the cached SmolLM2) — tokens/s of one request, and aggregate
   tokens/s of `--concurrency` concurrent ones, with decode steps batched (the default)
   and with each request stepping alone (`NEXTSTATE_ENGINE__BATCH_DECODE=false`, the
   baseline, same script): the ratio is what batching buys.

    python bench/engine.py [--calls 300] [--model DIR] [--concurrency 8] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
from fastapi import FastAPI

from services.ctl.infra import free_port
from shared.engine_client import SGLangClient
from shared.schemas import SamplingParams
from shared.telemetry import embedded_server
from tests.support.servers import ServiceProcess, wait_until
from tests.support.tiny_model import build_tiny_model

N_OUT = 64
CANNED = {
    "text": "x" * 200,
    "output_ids": list(range(N_OUT)),
    "meta_info": {
        "id": "r", "finish_reason": {"type": "length", "length": N_OUT}, "prompt_tokens": 500,
        "completion_tokens": N_OUT, "weight_version": "1",
        "output_token_logprobs": [[-1.2345678, i, None] for i in range(N_OUT)],
    },
}  # fmt: skip
PROMPT = list(range(10, 510))


def canned_server() -> tuple[str, Any]:
    app = FastAPI()

    @app.post("/generate")
    async def generate() -> dict[str, Any]:
        return CANNED

    port = free_port()
    server = embedded_server(app, "127.0.0.1", port)
    threading.Thread(target=server.run, daemon=True).start()
    wait_until(lambda: bool(server.started), 10, "canned server")
    return f"http://127.0.0.1:{port}", server


def p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


async def client_overhead(url: str, calls: int) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 1.0, "max_new_tokens": N_OUT},
            "return_logprob": True, "stream": False}  # fmt: skip
    raw, ours, fresh = [], [], []
    async with httpx.AsyncClient(base_url=url) as http, SGLangClient(url) as client:
        sampling = SamplingParams(temperature=1.0, max_tokens=N_OUT)
        for _ in range(20):  # warm up both
            (await http.post("/generate", json=body)).json()
            await client.generate(PROMPT, sampling)
        for _ in range(calls):
            t = time.perf_counter()
            (await http.post("/generate", json=body)).json()
            raw.append(time.perf_counter() - t)
            t = time.perf_counter()
            await client.generate(PROMPT, sampling)
            ours.append(time.perf_counter() - t)
        for _ in range(min(calls, 50)):
            t = time.perf_counter()
            async with httpx.AsyncClient(base_url=url) as one:
                (await one.post("/generate", json=body)).json()
            fresh.append(time.perf_counter() - t)
    print(f"client: bare pooled POST p50 {p50_ms(raw):.2f} ms | SGLangClient.generate p50 "
          f"{p50_ms(ours):.2f} ms (own cost {p50_ms(ours) - p50_ms(raw):+.2f} ms) | "
          f"new client per call p50 {p50_ms(fresh):.2f} ms")  # fmt: skip


async def engine_throughput(url: str, concurrency: int, tokens: int) -> tuple[float, float]:
    sampling = {"temperature": 1.0, "max_tokens": tokens, "ignore_eos": True}
    async with SGLangClient(url, timeout=600) as client:
        await client.generate(PROMPT[:20], {**sampling, "max_tokens": 8})
        t = time.perf_counter()
        one = await client.generate(PROMPT[:20], {**sampling, "seed": 1})
        single = len(one.output_ids) / (time.perf_counter() - t)
        t = time.perf_counter()
        many = await asyncio.gather(
            *(client.generate(PROMPT[: 10 + 3 * i], {**sampling, "seed": i}) for i in range(concurrency))
        )
        agg = sum(len(r.output_ids) for r in many) / (time.perf_counter() - t)
    return single, agg


def run_engine(model: Path, batch: bool, concurrency: int, tokens: int) -> tuple[float, float]:
    port = free_port()
    env = {"NEXTSTATE_ENGINE__BATCH_DECODE": str(batch).lower(), "NEXTSTATE_ENGINE__MAX_RUNNING": str(concurrency)}
    proc = ServiceProcess("engine", env=env, args=["--model", str(model), "--port", str(port)])
    try:
        proc.start().wait_http(f"http://127.0.0.1:{port}/health", timeout=180)
        return asyncio.run(engine_throughput(f"http://127.0.0.1:{port}", concurrency, tokens))
    finally:
        proc.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--model", type=Path, help="HF folder (default: the tiny test model)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    url, server = canned_server()
    try:
        asyncio.run(client_overhead(url, args.calls))
    finally:
        server.should_exit = True
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_tiny_model(Path(tmp) / "tiny")
        name = model.name if args.model else "tiny model"
        results = {batch: run_engine(model, batch, args.concurrency, args.tokens) for batch in (False, True)}
    (s0, a0), (s1, a1) = results[False], results[True]
    print(f"engine ({name}, {args.tokens} tokens each):")
    print(f"  each request alone (baseline): one request {s0:.0f} tok/s | {args.concurrency} concurrent {a0:.0f} tok/s total")
    print(f"  batched decode:                one request {s1:.0f} tok/s | {args.concurrency} concurrent {a1:.0f} tok/s total")
    print(f"  batched / alone at {args.concurrency} concurrent: {a1 / a0:.2f}x")


if __name__ == "__main__":
    main()
