"""Weight sync: from the LATEST commit to the engine answering with the new version.

Real processes: SeaweedFS (S3), redis-server, the CPU engine and the watcher, with a
~150 MB checkpoint (a random Llama, fp32). For each of several versions the script
publishes it through the checkpoint protocol (files, manifest, LATEST last) and times
LATEST's commit → the engine's `/model_info` reporting that weight_version. Beside it,
in the same run and bucket, the baseline: a raw upload + download of the same bytes
with the minio client (what moving the weights costs at minimum). The watcher's own
breakdown (download+verify, engine load) comes from its `PolicyLoaded` messages.

Target (issue): sync ≤ 1.5 × (raw upload + download) + the poll interval.

    python bench/sync.py [--versions 4] [--poll 2.0] [--hidden 512] [--layers 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx
import redis
from minio import Minio

from shared import checkpoints as ckpt
from shared.schemas import PolicyLoaded
from shared.settings import Settings
from shared.store import Bucket
from tests.support.servers import RedisServer, S3Server, ServiceProcess, free_port, wait_until
from tests.support.tiny_model import build_tokenizer


def build_model(path: Path, seed: int, hidden: int, layers: int, vocab: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    build_tokenizer(path)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3,
                         num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(str(path))
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def raw_roundtrip(client: Minio, bucket: str, folder: Path, prefix: str) -> float:
    """Upload every file of `folder`, then download it back: the bare cost of the bytes."""
    files = [f for f in folder.iterdir() if f.is_file()]
    t0 = time.perf_counter()
    for f in files:
        client.fput_object(bucket, f"{prefix}/{f.name}", str(f))
    with tempfile.TemporaryDirectory() as d:
        for f in files:
            client.fget_object(bucket, f"{prefix}/{f.name}", str(Path(d) / f.name))
    return time.perf_counter() - t0


def main(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="ns-bench-sync-"))
    s3 = S3Server().start()
    rds = RedisServer().start()
    procs: list[ServiceProcess] = []
    try:
        models = []
        for v in range(args.versions + 1):
            size = build_model(work / f"m{v}", v, args.hidden, args.layers, args.vocab)
            models.append(work / f"m{v}")
        print(f"checkpoint: {size / 1e6:.0f} MB per version ({args.layers} layers, hidden {args.hidden})")
        env = {**s3.env(), "NEXTSTATE_REDIS__URL": rds.url, "NEXTSTATE_REDIS__PREFIX": "bench",
               "NEXTSTATE_RUN": "bench-sync"}
        settings = Settings(run="bench-sync", redis={"url": rds.url, "prefix": "bench"},
                            bucket={"endpoint": s3.endpoint, "access_key": s3.access_key,
                                    "secret_key": s3.secret_key, "name": s3.bucket})
        eport, wport = free_port(), free_port()
        engine = ServiceProcess("engine", env, ["--model", str(models[0]), "--port", str(eport)]).start()
        procs.append(engine)
        engine.wait_http(f"http://127.0.0.1:{eport}/health", timeout=300)
        watcher = ServiceProcess("watcher", {
            **env, "NEXTSTATE_WATCHER__ENGINE_URL": f"http://127.0.0.1:{eport}",
            "NEXTSTATE_WATCHER__POLL_INTERVAL_S": str(args.poll),
            "NEXTSTATE_WATCHER__LOCAL_DIR": str(work / "ckpts"),
            "NEXTSTATE_WATCHER__PORT": str(wport),
        }).start()
        procs.append(watcher)
        watcher.wait_http(f"http://127.0.0.1:{wport}/readyz", timeout=60)

        raw_client = Minio(s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key, secure=False)
        syncs: list[float] = []
        raws: list[float] = []
        with Bucket(settings.bucket) as bucket, httpx.Client(timeout=10) as http:
            for v in range(1, args.versions + 1):
                raws.append(raw_roundtrip(raw_client, s3.bucket, models[v], f"raw/{v}"))
                ckpt.publish_checkpoint(bucket, settings.run, v, models[v], step=v)
                committed = ckpt.read_latest(bucket, settings.run)
                assert committed is not None and committed.version == v

                def serving(v: int = v) -> bool:
                    return http.get(f"http://127.0.0.1:{eport}/model_info").json()["weight_version"] == str(v)

                wait_until(serving, 300, f"engine serving v{v}", interval=0.02)
                syncs.append(time.time() - committed.committed_at)
                print(f"  v{v}: sync {syncs[-1]:.2f}s   raw upload+download {raws[-1]:.2f}s")
        r = redis.Redis.from_url(rds.url, decode_responses=True)
        loaded = [PolicyLoaded.from_json(f["data"]) for _, f in r.xrange("bench:policy")]
        sync, raw = statistics.median(syncs), statistics.median(raws)
        dl = statistics.median(p.download_s for p in loaded)
        load = statistics.median(p.load_s for p in loaded)
        budget = 1.5 * raw + args.poll
        print(f"median sync (LATEST commit -> engine answers v)   {sync:.2f}s")
        print(f"  watcher breakdown: download+verify {dl:.2f}s, engine load+swap {load:.2f}s, "
              f"the rest is the poll wait (interval {args.poll}s)")
        print(f"median raw upload+download of the same bytes      {raw:.2f}s")
        print(f"ratio sync / raw = {sync / raw:.2f} (the poll wait, on average half the interval, included)")
        print(f"target: sync <= 1.5 x raw + poll interval = {budget:.2f}s -> "
              f"{'met' if sync <= budget else 'NOT met'}")
    finally:
        for p in reversed(procs):
            p.stop()
        rds.close()
        s3.close()
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--poll", type=float, default=2.0)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    main(ap.parse_args())
