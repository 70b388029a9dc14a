"""Weight sync: bytes per version and commit -> serving, for each way a version can travel.

Real processes: SeaweedFS (S3), redis-server, the CPU engine and the watcher. For each
path — `fp32` (the whole model in float32), `bf16` (the whole model in bfloat16), `delta`
(float32, a snapshot then XOR + zstd deltas against the version before: shared/deltas.py)
and `adapter` (a rank-16 PEFT LoRA adapter on every linear layer) — the script publishes
`--versions` versions through the checkpoint protocol (files, manifest, LATEST last),
exactly as the trainer's commit does (`publish_checkpoint` with its `Layout`), and times:

    prepare   writing the version's files (safetensors in its dtype; the delta encoding)
    publish   the upload, the manifest and LATEST (the trainer's commit)
    sync      LATEST's commit -> the engine answering with that version (the watcher's
              download, rebuild and verification, and the engine's load; from its
              `PolicyLoaded`: `download_s` and `load_s`)
    raw       a bare upload + download of the same stored bytes with the minio client, in
              the same run and bucket: what moving those bytes costs at least

Successive full versions differ as after one Adam step of the trainer's default learning
rate (1e-6: every weight moves by about lr); successive adapters are fresh random ones.
Each path gets a fresh bucket (SeaweedFS does not give deleted space back at once) and its
own run; the engine and watcher restart with it. The table's figures are medians over the
versions after the first (the first is a snapshot on the delta path, and pays the
watcher's one-time hashing of the base model for its fingerprint check); a delta version's
bytes are also given amortized over a chain of K = `--snapshot-every`.

From the measured rates, the cost per version of a 4B and an 8B model (Qwen3-4B / -8B
shapes) on each path, from the snapshot to the engine serving it: bytes scale with the
parameters (an adapter's with its layers' shapes); writing, upload, download + rebuild +
verification and the engine's load scale with the bytes they handle; the watcher's poll
wait does not.

    python bench/sync.py --model smollm2 --rounds 2     # SmolLM2-135M (services/ctl/models.py)
    python bench/sync.py --model random-1b --versions 3 --raw-once --engine-dtype bfloat16
    python bench/sync.py --model PATH --paths fp32,adapter
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx
import redis
import torch
from minio import Minio
from safetensors.torch import save_file

from services.watcher.compat import tensor_shapes
from shared import checkpoints as ckpt
from shared import deltas
from shared.runs import model_fingerprint
from shared.schemas import AdapterSpec, PolicyLoaded
from shared.settings import Settings
from shared.store import Bucket
from tests.support.servers import RedisServer, S3Server, ServiceProcess, free_port, wait_until

PATHS = ("fp32", "bf16", "delta", "adapter")
LR = 1e-6
RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Qwen3's shapes (their config.json): hidden, intermediate, layers, heads, kv heads, head dim, params.
LARGE = {"4B": (2560, 9728, 36, 32, 8, 128, 4.02e9), "8B": (4096, 12288, 36, 32, 8, 128, 8.19e9)}


@dataclass
class Row:
    version: int
    stored: int  # bytes in the bucket for this version
    prepare: float
    publish: float
    sync: float = 0.0
    download: float = 0.0
    load: float = 0.0
    raw: float | None = None


@dataclass
class Result:
    path: str
    rows: list[Row] = field(default_factory=list)

    def med(self, attr: str) -> float:
        rows = self.rows[1:] or self.rows
        values = [getattr(r, attr) for r in rows if getattr(r, attr) is not None]
        return statistics.median(values) if values else float("nan")


# -- models ---------------------------------------------------------------------------------
def random_1b(path: Path) -> Path:
    """A random Llama of ~0.95B parameters (hidden 2048, 16 layers, 32k vocabulary, untied
    head), saved once as an HF folder with the tiny test tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support.tiny_model import build_tokenizer

    if (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path)
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(path))
    return path


def resolve_model(name: str, work: Path) -> Path:
    if name == "smollm2":
        from services.ctl.models import ensure_default_model

        return ensure_default_model()
    if name == "random-1b":
        return random_1b(work / "random-1b")
    return Path(name).resolve()


def load_weights(model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(model.glob("*.safetensors")):
        state.update({k: v.float() for k, v in load_file(str(f)).items()})
    return state


def linear_shapes(model: Path) -> dict[str, tuple[int, int]]:
    """module -> (out, in) of every adapted linear layer (from the safetensors headers)."""
    out = {}
    for k, shape in tensor_shapes(model).items():
        module = k.removesuffix(".weight")
        if k.endswith(".weight") and module.rsplit(".", 1)[-1] in TARGETS and len(shape) == 2:
            out[module] = (int(shape[0]), int(shape[1]))
    return out


def parameters(model: Path) -> int:
    return sum(math.prod(shape) for shape in tensor_shapes(model).values())


# -- versions ---------------------------------------------------------------------------------
def step(state: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    """One Adam-like step in place: every weight moves by lr (sign of a random gradient)."""
    with torch.no_grad():
        for v in state.values():
            v.sub_(LR * torch.sign(torch.randn(v.shape, generator=gen)))


def write_full(state: dict[str, torch.Tensor], model: Path, dest: Path, dtype: torch.dtype) -> None:
    dest.mkdir(parents=True)
    for f in model.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dest / f.name)
    cast = {k: v.to(dtype).contiguous() for k, v in state.items()}
    save_file(cast, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    (dest / "config.json").write_text(json.dumps(config, indent=2))


def write_adapter(shapes: dict[str, tuple[int, int]], model: Path, dest: Path, gen: torch.Generator) -> AdapterSpec:
    dest.mkdir(parents=True)
    tensors = {}
    for module, (n_out, n_in) in shapes.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(RANK, n_in, generator=gen) * 0.01
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(n_out, RANK, generator=gen) * 0.01
    save_file(tensors, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK,
              "lora_dropout": 0.0, "bias": "none", "target_modules": sorted(TARGETS),
              "base_model_name_or_path": str(model), "use_rslora": False, "use_dora": False}
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return AdapterSpec(rank=RANK, alpha=2 * RANK, target_modules=sorted(TARGETS))


def raw_roundtrip(client: Minio, bucket: str, files: list[Path], prefix: str) -> float:
    """Upload `files`, then download them back: the bare cost of their bytes."""
    t0 = time.perf_counter()
    for f in files:
        client.fput_object(bucket, f"{prefix}/{f.name}", str(f))
    with tempfile.TemporaryDirectory(dir=files[0].parent.parent) as d:
        for f in files:
            client.fget_object(bucket, f"{prefix}/{f.name}", str(Path(d) / f.name))
    return time.perf_counter() - t0


# -- one path -------------------------------------------------------------------------------------
def run_path(path: str, model: Path, args: argparse.Namespace, work: Path, rds: RedisServer) -> Result:
    """Fresh bucket, engine and watcher; publish `args.versions` versions of `path`, time each."""
    s3 = S3Server(workdir=Path(tempfile.mkdtemp(prefix="ns-bench-weed-", dir=work))).start()
    run = f"bench-{path}"
    env = {**s3.env(), "NEXTSTATE_REDIS__URL": rds.url, "NEXTSTATE_REDIS__PREFIX": f"bench-{path}",
           "NEXTSTATE_RUN": run, "NEXTSTATE_ENV": "test"}
    settings = Settings(run=run, redis={"url": rds.url, "prefix": f"bench-{path}"},
                        bucket={"endpoint": s3.endpoint, "access_key": s3.access_key,
                                "secret_key": s3.secret_key, "name": s3.bucket})
    eport, wport = free_port(), free_port()
    procs: list[ServiceProcess] = []
    result = Result(path)
    local = work / f"local-{path}"
    files_dir = work / f"versions-{path}"
    try:
        engine = ServiceProcess("engine", {**env, "NEXTSTATE_ENGINE__DTYPE": args.engine_dtype,
                                           "NEXTSTATE_ENGINE__MAX_LORA_RANK": str(RANK)},
                                ["--model", str(model), "--port", str(eport)]).start()
        procs.append(engine)
        engine.wait_http(f"http://127.0.0.1:{eport}/health", timeout=900)
        watcher = ServiceProcess("watcher", {
            **env, "NEXTSTATE_WATCHER__ENGINE_URL": f"http://127.0.0.1:{eport}",
            "NEXTSTATE_WATCHER__POLL_INTERVAL_S": str(args.poll), "NEXTSTATE_WATCHER__LOCAL_DIR": str(local),
            "NEXTSTATE_WATCHER__BASE_MODEL": str(model), "NEXTSTATE_WATCHER__KEEP_LOCAL": "1",
            "NEXTSTATE_WATCHER__RELOAD_TIMEOUT_S": "1800", "NEXTSTATE_WATCHER__PORT": str(wport),
            # bf16 versions of a float32 base: the engine casts them, as one told --dtype would
            # (docs/weights.md, "An engine that casts what it loads").
            **({"NEXTSTATE_WATCHER__SERVED_DTYPE": "bfloat16"} if path == "bf16" else {}),
        }).start()  # fmt: skip
        procs.append(watcher)
        watcher.wait_http(f"http://127.0.0.1:{wport}/readyz", timeout=120)
        fingerprint = model_fingerprint(model)
        raw_client = Minio(s3.endpoint, access_key=s3.access_key, secret_key=s3.secret_key, secure=False)
        state = load_weights(model) if path != "adapter" else {}
        shapes = linear_shapes(model) if path == "adapter" else {}
        gen = torch.Generator().manual_seed(1)
        previous: Path | None = None
        with Bucket(settings.bucket) as bucket, httpx.Client(timeout=10) as http:
            for v in range(1, args.versions + 1):
                folder = files_dir / ckpt.version_dirname(v)
                t0 = time.perf_counter()
                if path == "adapter":
                    spec = write_adapter(shapes, model, folder, gen)
                    layout = ckpt.Layout(format="adapter", dtype="float32", base_fingerprint=fingerprint, adapter=spec)
                    stored = [folder / "adapter_model.safetensors", folder / "adapter_config.json"]
                else:
                    step(state, gen)
                    write_full(state, model, folder, torch.bfloat16 if path == "bf16" else torch.float32)
                    layout = ckpt.Layout(format="full", dtype="bfloat16" if path == "bf16" else "float32",
                                         base_fingerprint=fingerprint)
                    stored = [folder / "model.safetensors"]
                    chain = (v - 1) % args.snapshot_every
                    if path == "delta" and chain and previous is not None:
                        out = work / f"delta-{v}{deltas.SUFFIX}"
                        deltas.encode(folder / "model.safetensors", previous / "model.safetensors", out)
                        base_sha = ckpt.digest_file(previous / "model.safetensors").sha256
                        layout = ckpt.Layout(format="full", dtype="float32", base_fingerprint=fingerprint,
                                             deltas=(ckpt.Delta("model.safetensors", out, v - 1, base_sha),),
                                             snapshot=v - chain)
                        stored = [out]
                prepared = time.perf_counter()
                manifest = ckpt.publish_checkpoint(bucket, run, v, folder, step=v, layout=layout,
                                                   base_model=str(model))
                published = time.perf_counter()
                committed = ckpt.read_latest(bucket, run)
                assert committed is not None and committed.version == v

                def serving(v: int = v) -> bool:
                    return http.get(f"http://127.0.0.1:{eport}/get_weight_version").json()["weight_version"] == str(v)

                wait_until(serving, 1800, f"engine serving v{v}", interval=0.02)
                row = Row(v, sum(f.size for f in manifest.stored()), prepared - t0, published - prepared,
                          time.time() - committed.committed_at)
                if not args.raw_once or v == 2 or args.versions == 1:
                    row.raw = raw_roundtrip(raw_client, s3.bucket, stored, f"raw/{v}")
                result.rows.append(row)
                print(f"  {path:8} v{v}: {row.stored / 1e6:9.1f} MB  prepare {row.prepare:6.2f}s  publish "
                      f"{row.publish:6.2f}s  sync {row.sync:6.2f}s"
                      + (f"  raw up+down {row.raw:6.2f}s" if row.raw is not None else ""), flush=True)
                # Keep what the next version needs (its delta's base), drop the rest.
                for f in stored:
                    if f.parent == work:
                        f.unlink()
                if previous is not None:
                    shutil.rmtree(previous, ignore_errors=True)
                previous = folder
                if path != "delta":
                    ckpt.prune_bucket(bucket, run, keep=1)
        r = redis.Redis.from_url(rds.url, decode_responses=True)
        loaded = {p.version: p for p in (PolicyLoaded.from_json(f["data"])
                                         for _, f in r.xrange(f"bench-{path}:policy"))}
        for row in result.rows:
            if row.version in loaded:
                row.download, row.load = loaded[row.version].download_s, loaded[row.version].load_s
    finally:
        for p in reversed(procs):
            p.stop()
        s3.close()
        shutil.rmtree(local, ignore_errors=True)
        shutil.rmtree(files_dir, ignore_errors=True)
    return result


# -- the report -------------------------------------------------------------------------------------
def adapter_bytes(hidden: int, inter: int, layers: int, heads: int, kv: int, head_dim: int) -> float:
    """fp32 bytes of a rank-16 adapter on every linear layer of a Llama/Qwen-shaped model."""
    q, k = heads * head_dim, kv * head_dim
    per_layer = sum(RANK * (a + b) for a, b in ((hidden, q), (hidden, k), (hidden, k), (q, hidden),
                                                 (hidden, inter), (hidden, inter), (inter, hidden)))
    return 4.0 * layers * per_layer


def report(results: list[Result], model: Path, args: argparse.Namespace) -> None:
    params = parameters(model)
    k = args.snapshot_every
    print(f"\nmodel {model.name}: {params / 1e9:.3f}B parameters; {args.rounds} round(s) of {args.versions} "
          f"versions per path, medians of v2..v{args.versions}; engine dtype {args.engine_dtype}; load average "
          f"at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| path | bytes / version | prepare | publish | commit -> serving (download+verify, load) "
          "| raw up+down of the same bytes | (publish + sync) / raw |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    by = {r.path: r for r in results}
    for r in results:
        stored = r.med("stored")
        note = ""
        if r.path == "delta" and "fp32" in by:
            amortized = (by["fp32"].med("stored") + (k - 1) * stored) / k
            note = f" ({amortized / 1e6:.1f} MB a version over a chain of {k})"
        raw = r.med("raw")
        print(f"| {r.path} | {stored / 1e6:.1f} MB{note} | {r.med('prepare'):.2f} s | {r.med('publish'):.2f} s "
              f"| {r.med('sync'):.2f} s ({r.med('download'):.2f} + {r.med('load'):.2f}) | {raw:.2f} s "
              f"| {(r.med('publish') + r.med('sync')) / raw:.2f} |")
    print("\nper version of a larger model at these rates: bytes scale with the parameters (an adapter's "
          "with its shapes); writing, upload, download + rebuild + verify and the engine's load with the bytes "
          "they handle; the poll wait (sync - download - load) stays:")
    print("| path | " + " | ".join(f"{n}: bytes, snapshot -> serving (raw up+down)" for n in LARGE) + " |")
    print("| --- | " + " | ".join("---" for _ in LARGE) + " |")
    ours_adapter = adapter_bytes_of(model)
    for r in results:
        cells = []
        for _name, shape in LARGE.items():
            scale = adapter_bytes(*shape[:6]) / ours_adapter if r.path == "adapter" else shape[6] / params
            moved = r.med("prepare") + r.med("publish") + r.med("download") + r.med("load")
            wait = max(0.0, r.med("sync") - r.med("download") - r.med("load"))
            cells.append(f"{r.med('stored') * scale / 1e9:.2f} GB, {moved * scale + wait:.0f} s "
                         f"({r.med('raw') * scale:.0f} s)")
        print(f"| {r.path} | " + " | ".join(cells) + " |")


def adapter_bytes_of(model: Path) -> float:
    return 4.0 * sum(RANK * (o + i) for o, i in linear_shapes(model).values())


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="ns-bench-sync-", dir=args.work))
    rds = RedisServer().start()
    try:
        model = resolve_model(args.model, Path(args.work or tempfile.gettempdir()))
        print(f"model {model} (load average {os.getloadavg()[0]:.1f})", flush=True)
        paths = args.paths.split(",")
        if unknown := [p for p in paths if p not in PATHS]:
            raise SystemExit(f"unknown paths {unknown}: {', '.join(PATHS)}")
        merged = {p: Result(p) for p in paths}
        for i in range(args.rounds):  # each round in another order: a burst of load hits every path alike
            for path in paths[i % len(paths):] + paths[:i % len(paths)]:
                got = run_path(path, model, args, work, rds)
                merged[path].rows += got.rows[1:] if i else got.rows
        results = [merged[p] for p in paths]
        report(results, model, args)
    finally:
        rds.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 | random-1b | an HF folder")
    ap.add_argument("--paths", default=",".join(PATHS), help="comma list of fp32, bf16, delta, adapter")
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="run every path this many times, the order rotated")
    ap.add_argument("--snapshot-every", type=int, default=4, help="the delta path's chain length K")
    ap.add_argument("--poll", type=float, default=0.5, help="the watcher's poll interval")
    ap.add_argument("--engine-dtype", default="float32", help="the CPU engine's dtype (bfloat16 halves its memory)")
    ap.add_argument("--raw-once", action="store_true", help="the raw round trip on v2 only (disk: a fresh "
                    "bucket per path still holds every version uploaded)")
    ap.add_argument("--work", default=None, help="scratch folder (default: the system's temp)")
    main(ap.parse_args())
