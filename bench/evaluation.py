"""Evaluation overhead: a version's commit → the gate's decision, against running its suites directly.

Real processes: Redis, SeaweedFS, the serving engine and the evaluation engine (the tiny
test model, or `--hidden/--layers` for a bigger random Llama), the evaluator
(`python -m services.evaluator`, default suites `demo` and `drift`) and the watcher with
the gate on. For each of several versions the script commits a checkpoint the way the
trainer does (files, manifest, LATEST, a `checkpoints` announcement) and times commit →
the `Promotion` on the `promotions` stream. The baseline, in the same run and on the
same evaluation engine: the same version loaded and the same suites called directly in
this process (`services.evaluator.suites.resolve`), one after the other. The ratio is
what the pipeline (dispatch, rq, download and verify, results on a stream, the gate)
costs on top of the evaluation itself. Target (issue): ≤ 1.3×.

    python bench/evaluation.py [--versions 4] [--poll 2.0] [--samples 32]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import redis

from services.evaluator.settings import EvalConfig
from services.evaluator.suite import EvalContext
from services.evaluator.suites import resolve
from shared import checkpoints as ckpt
from shared.auth import bearer
from shared.engine_client import make_engine_client
from shared.keys import Keys
from shared.schemas import CheckpointPublished, Promotion
from shared.settings import Settings
from shared.store import Bucket
from tests.support.servers import RedisServer, S3Server, ServiceProcess, free_port, wait_until
from tests.support.tiny_model import build_tiny_model

TOKEN = "bench-evaluation-internal-token"


def perturbed(base: Path, dest: Path, seed: int) -> Path:
    """`base` with small noise on every weight: a plausible next version."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, dest)
    gen = torch.Generator().manual_seed(seed)
    for f in dest.glob("*.safetensors"):
        t = load_file(str(f))
        save_file({k: (v + 0.01 * torch.randn(v.shape, generator=gen)).contiguous() for k, v in t.items()},
                  str(f), metadata={"format": "pt"})
    return dest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", type=int, default=4)
    p.add_argument("--poll", type=float, default=2.0, help="the watcher's poll interval (its default: 2 s)")
    p.add_argument("--samples", type=int, default=32, help="tasks per suite (the evaluator's default: 32)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ns-bench-eval-"))
    base = build_tiny_model(work / "base", hidden=args.hidden, layers=args.layers)
    rds, s3 = RedisServer().start(), S3Server().start()
    tag = uuid.uuid4().hex[:6]
    env = {"NEXTSTATE_ENV": "test", "NEXTSTATE_RUN": f"bench-{tag}", "NEXTSTATE_REDIS__URL": rds.url,
           "NEXTSTATE_REDIS__PREFIX": f"be-{tag}", "NEXTSTATE_INTERNAL__TOKEN": TOKEN, **s3.env()}
    procs: list[ServiceProcess] = []
    try:
        urls = {}
        for name in ("engine", "eval"):
            port = free_port()
            procs.append(ServiceProcess("engine", env, ["--model", str(base), "--port", str(port)]).start())
            urls[name] = f"http://127.0.0.1:{port}"
            procs[-1].wait_http(f"{urls[name]}/health", timeout=300)
        ev_port, w_port = free_port(), free_port()
        procs.append(ServiceProcess("evaluator", {
            **env, "NEXTSTATE_EVAL__ENGINE_URL": urls["eval"], "NEXTSTATE_EVAL__TOKENIZER": str(base),
            "NEXTSTATE_EVAL__BASE_MODEL": str(base), "NEXTSTATE_EVAL__LOCAL_DIR": str(work / "eval-ckpt"),
            "NEXTSTATE_EVAL__SAMPLES": str(args.samples), "NEXTSTATE_EVAL__DEMO_TASK": "vowel", "NEXTSTATE_EVAL__PORT": str(ev_port),
            "NEXTSTATE_EVAL__BASELINE": "false",  # timed: the versions' evaluations, not the base's
            "NEXTSTATE_EVAL__CONSUMER_NAME": "evaluator"}).start())
        procs[-1].wait_http(f"http://127.0.0.1:{ev_port}/readyz", timeout=300)
        procs.append(ServiceProcess("watcher", {
            **env, "NEXTSTATE_WATCHER__ENGINE_URL": urls["engine"], "NEXTSTATE_WATCHER__POLL_INTERVAL_S": str(args.poll),
            "NEXTSTATE_WATCHER__LOCAL_DIR": str(work / "ckpt"), "NEXTSTATE_WATCHER__PORT": str(w_port),
            "NEXTSTATE_GATE__ENABLED": "true", "NEXTSTATE_GATE__DRIFT_MAX": "1000"}).start())
        procs[-1].wait_http(f"http://127.0.0.1:{w_port}/readyz", timeout=120)
        settings = Settings(run=env["NEXTSTATE_RUN"], redis={"url": rds.url, "prefix": env["NEXTSTATE_REDIS__PREFIX"]},
                            bucket={k.split("__")[1].lower(): v for k, v in s3.env().items()})
        keys = Keys(settings.redis.prefix)
        r = redis.Redis.from_url(rds.url, decode_responses=True)
        cfg = EvalConfig(samples=args.samples, local_dir=work / "direct-ckpt", demo_task="vowel")
        pipeline, direct = [], []
        with Bucket(settings.bucket) as bucket:
            bucket.ensure()
            for v in range(1, args.versions + 1):
                folder = perturbed(base, work / f"v{v}", seed=v)
                manifest = ckpt.publish_checkpoint(bucket, settings.run, v, folder, base_model=str(base))
                committed = time.time()
                r.xadd(keys.checkpoints, {"data": CheckpointPublished(
                    run=settings.run, version=v, manifest=ckpt.manifest_key(settings.run, v)).to_json()})

                def decided(v: int = v) -> float | None:
                    for entry_id, f in r.xrange(keys.promotions):
                        if Promotion.from_json(f["data"]).version == v:
                            return int(entry_id.split("-")[0]) / 1000
                    return None

                wait_until(lambda: decided() is not None, 600, f"the gate's decision on v{v}", interval=0.05)
                pipeline.append((decided() or 0) - committed)
                # Baseline: the same version, the same suites, called here one after the other.
                local = ckpt.download_checkpoint(bucket, manifest, cfg.local_dir)
                direct.append(asyncio.run(run_direct(urls["eval"], local.resolve(), v, base, cfg)))
                print(f"v{v}: commit -> decision {pipeline[-1]:6.2f} s   suites directly {direct[-1]:6.2f} s")
    finally:
        for proc in reversed(procs):
            proc.stop()
        s3.close()
        rds.close()
    pm, dm = statistics.median(pipeline), statistics.median(direct)
    print(f"median over {args.versions} versions (suites demo + drift, {args.samples} tasks each, watcher "
          f"poll {args.poll}s): commit -> decision {pm:.2f} s; the same suites run directly {dm:.2f} s; "
          f"ratio {pm / dm:.2f}x (target <= 1.3x)")


async def run_direct(eval_url: str, folder: Path, version: int, base: Path, cfg: EvalConfig) -> float:
    """Load `version` into the evaluation engine and run the default suites in this process."""
    t0 = time.perf_counter()
    async with make_engine_client("sglang", eval_url, api_key=TOKEN) as engine:
        ok, message = await engine.update_weights(str(folder), str(version))
        assert ok, message
    ctx = EvalContext(run="direct", version=version, engine_url=eval_url, headers=bearer(TOKEN),
                      tokenizer=str(base), base_model=str(base), cfg=cfg)
    for name in cfg.suites:  # each with the n the evaluator gives it
        await resolve(name)(replace(ctx, cfg=cfg.model_copy(update={"samples": cfg.samples_for(name)})))
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
