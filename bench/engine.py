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

3. `--engine vllm`: the real vLLM (its CPU build, `make vllm`) against our CPU engine in the
   same run, one engine at a time, with the same thread count (`--threads`, default 1) and
   the same client code: tokens/s of one request and of `--concurrency` concurrent ones,
   and the reload time, commit → serving: a version published to the bucket (SeaweedFS)
   until the engine answers with it, through the real watcher (download, full verification,
   load), median of `--reloads`, with the watcher's breakdown. Default model: the cached
   SmolLM2 (converted once by `nextstate up`'s default-model code).

    python bench/engine.py [--calls 300] [--model DIR] [--concurrency 8] [--tokens 128]
    python bench/engine.py --engine vllm [--model DIR] [--threads 1] [--reloads 3]
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
from shared import checkpoints as ckpt
from shared.engine_client import SGLangClient, make_engine_client
from shared.schemas import PolicyLoaded, SamplingParams
from shared.settings import Settings
from shared.store import Bucket
from shared.telemetry import embedded_server
from shared.vllm_engine import EngineChoice, VLLMLaunch
from tests.support.servers import RedisServer, S3Server, ServiceProcess, wait_until
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


async def engine_throughput(url: str, concurrency: int, tokens: int, kind: str = "sglang",
                            token: str | None = None) -> tuple[float, float]:
    sampling = {"temperature": 1.0, "max_tokens": tokens, "ignore_eos": True}
    async with make_engine_client(kind, url, timeout=600, api_key=token) as client:
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


TOKEN = "bench-engine-internal-token"


def reload_times(kind: str, url: str, model: Path, work: Path, reloads: int) -> tuple[list[float], list[PolicyLoaded]]:
    """Commit → serving through the real watcher: publish `model` as versions 1..reloads and
    time each LATEST commit until the engine reports that version."""
    s3, rds = S3Server().start(), RedisServer().start()
    env = {**s3.env(), "NEXTSTATE_REDIS__URL": rds.url, "NEXTSTATE_REDIS__PREFIX": "bench",
           "NEXTSTATE_RUN": f"bench-{kind}", "NEXTSTATE_INTERNAL__TOKEN": TOKEN}
    settings = Settings(run=f"bench-{kind}", redis={"url": rds.url, "prefix": "bench"},
                        bucket={"endpoint": s3.endpoint, "access_key": s3.access_key,
                                "secret_key": s3.secret_key, "name": s3.bucket})
    watcher = ServiceProcess("watcher", {
        **env, "NEXTSTATE_WATCHER__ENGINE_URL": url, "NEXTSTATE_WATCHER__ENGINE_KIND": kind,
        "NEXTSTATE_WATCHER__POLL_INTERVAL_S": "0.2", "NEXTSTATE_WATCHER__LOCAL_DIR": str(work / f"ckpts-{kind}"),
        "NEXTSTATE_WATCHER__BASE_MODEL": str(model), "NEXTSTATE_WATCHER__PORT": str(free_port()),
    })  # fmt: skip
    times: list[float] = []
    try:
        watcher.start()

        async def version() -> str:
            async with make_engine_client(kind, url, timeout=30, api_key=TOKEN) as client:
                return await client.weight_version()

        with Bucket(settings.bucket) as bucket:
            for v in range(1, reloads + 1):
                ckpt.publish_checkpoint(bucket, settings.run, v, model, step=v)
                committed = ckpt.read_latest(bucket, settings.run)
                assert committed is not None and committed.version == v
                wait_until(lambda v=v: asyncio.run(version()) == str(v), 600, f"{kind} serving v{v}", interval=0.05)
                times.append(time.time() - committed.committed_at)
        import redis

        r = redis.Redis.from_url(rds.url, decode_responses=True)
        loaded = [PolicyLoaded.from_json(f["data"]) for _, f in r.xrange("bench:policy")]
        return times, loaded
    finally:
        watcher.stop()
        rds.close()
        s3.close()


def compare_with_vllm(model: Path, threads: int, concurrency: int, tokens: int, reloads: int) -> None:
    """Our CPU engine, then vLLM, on the same model, threads and client code."""
    vllm = VLLMLaunch.from_choice(EngineChoice(threads=threads, max_running=max(concurrency, 8)))
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("ours", "vllm"):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            if kind == "ours":
                proc: Any = ServiceProcess("engine", env={
                    "NEXTSTATE_ENGINE__THREADS": str(threads), "NEXTSTATE_ENGINE__MAX_RUNNING": str(concurrency),
                    "NEXTSTATE_INTERNAL__TOKEN": TOKEN}, args=["--model", str(model), "--port", str(port)])  # fmt: skip
                started = time.perf_counter()
                proc.start().wait_http(f"{url}/health", timeout=600)
            else:
                from tests.support.vllm_server import VLLMServer

                proc = VLLMServer(model, Path(tmp) / "vllm.log", vllm, token=TOKEN, port=port)
                started = time.perf_counter()
                proc.start(timeout=600)
            ready_s = time.perf_counter() - started
            client_kind = "sglang" if kind == "ours" else "vllm"
            try:
                single, agg = asyncio.run(engine_throughput(url, concurrency, tokens, client_kind, TOKEN))
                times, loaded = reload_times(client_kind, url, model, Path(tmp), reloads)
            finally:
                proc.stop()
            rows[kind] = (ready_s, single, agg, times, loaded)
    print(f"engine comparison ({model.name}, {tokens} tokens each, {threads} thread(s), same client code):")
    for kind, (ready_s, single, agg, times, loaded) in rows.items():
        dl = statistics.median(p.download_s for p in loaded)
        load = statistics.median(p.load_s for p in loaded)
        print(f"  {kind:<5} ready in {ready_s:5.1f}s | one request {single:6.1f} tok/s | {concurrency} concurrent "
              f"{agg:6.1f} tok/s total | reload commit->serving median {statistics.median(times):.2f}s "
              f"(watcher: download+verify {dl:.2f}s, engine load {load:.2f}s; {len(times)} reloads)")
    (_, s0, a0, _, _), (_, s1, a1, _, _) = rows["ours"], rows["vllm"]
    print(f"  vllm / ours: one request {s1 / s0:.2f}x, {concurrency} concurrent {a1 / a0:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["cpu", "vllm"], default="cpu",
                    help="vllm: compare the real vLLM with our engine (throughput and reload time)")
    ap.add_argument("--threads", type=int, default=1, help="--engine vllm: threads of each engine")
    ap.add_argument("--reloads", type=int, default=3, help="--engine vllm: versions published per engine")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--model", type=Path, help="HF folder (default: the tiny test model)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    if args.engine == "vllm":
        from services.ctl.models import ensure_default_model

        compare_with_vllm(args.model or ensure_default_model(), args.threads, args.concurrency, args.tokens,
                          args.reloads)
        return
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
