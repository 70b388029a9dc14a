"""The trainer data-parallel: the same steps as the single-process trainer, on 2 ranks.

- Two gloo ranks in spawned processes (no Ray): `ShardedTrainer` steps equal the local
  `Trainer` steps — metrics and weights — with rank 0's resumed state sent to rank 1 first,
  a batch smaller than the group (rank 1 trains nothing), a failure on one rank only
  (both drop the step), and LoRA.
- `python -m services.trainer` with BACKEND=ray on a local Ray cluster (2 CPU workers),
  real Redis and S3: one version per batch whose metrics and published weights match the
  single-process trainer on the same batches; SIGTERM stops the group, exit 0, and every
  process Ray started is gone.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from services.trainer.build import build_trainer
from services.trainer.model import export_state_dict
from services.trainer.ray_group import Leader, follow
from services.trainer.ray_step import ShardedTrainer, StepFailed, sync_state
from services.trainer.resume import ResumePoint
from services.trainer.settings import TrainerConfig
from services.trainer.step import Trainer
from shared import keys as K
from shared.checkpoints import (
    download_checkpoint,
    list_versions,
    manifest_key,
    read_latest,
    read_manifest,
)
from shared.keys import Keys
from shared.schemas import TrainBatch, TrainSample
from shared.settings import Settings
from shared.store import Bucket
from tests.support.servers import ServiceProcess, free_port, wait_until

pytestmark = pytest.mark.integration

FRESH = ResumePoint(version=0, step=0, next_version=1, consumed=[])
COMPARED = ("loss", "pg_loss", "kl", "clip_frac", "ratio_mean", "adv_mean", "grad_norm",
            "tokens", "train_tokens", "reward_mean", "samples")
# Summing two ranks' partial gradients differs from one process's sum in the last bits;
# a few AdamW steps at lr 1e-3 keep that near 1e-7 (a step missed or doubled moves weights ~1e-3).
METRIC_RTOL, METRIC_ATOL = 1e-5, 1e-6
WEIGHT_ATOL = 1e-5


def samples(seed: int, n: int) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, r = rng.randint(2, 24), rng.randint(2, 12)
        out.append(TrainSample(
            session_id=f"s{seed}", tokens=[rng.randrange(500) for _ in range(p + r)], response_length=r,
            loss_mask=[1] * r, reward=rng.choice([1.0, -1.0]), policy_version=0,
            rollout_logprobs=[-rng.uniform(5.7, 6.8) for _ in range(r)], temperature=0.7,  # near the model's own: -log(vocab)
        ))  # fmt: skip
    return out


# Five samples, four, ONE (rank 1 gets nothing), three.
SIZES = (5, 4, 1, 3)


def config(tiny_model: Path, **kw: Any) -> TrainerConfig:
    return TrainerConfig(model=str(tiny_model), lr=1e-3, device="cpu", kl_beta=0.02,
                         micro_batch_tokens=64, **kw)


def assert_metrics_match(got: dict[str, float], want: dict[str, float], step: int) -> None:
    for k in COMPARED:
        if k in want:
            assert got[k] == pytest.approx(want[k], rel=METRIC_RTOL, abs=METRIC_ATOL), (step, k)


def assert_weights_match(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    worst = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert worst < WEIGHT_ATOL, worst


# -- two gloo ranks, no Ray ------------------------------------------------------------------------
class FlakyTrainer(ShardedTrainer):
    """Fails inside its own shard's forward on rank 1 when told to (the others do not)."""

    fail = False

    def reference_logprobs(self, mb: Any) -> torch.Tensor | None:
        if self.fail and dist.get_rank() == 1:
            raise RuntimeError("injected failure on rank 1")
        return super().reference_logprobs(mb)


def _rank(rank: int, world: int, init: str, tiny_model: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        cfg = config(Path(tiny_model))
        base = build_trainer(cfg, FRESH)
        if rank == 0:  # rank 0 "resumed": its weights and Adam state are one step ahead
            base.step(samples(100, 3))
        trainer = FlakyTrainer(base)
        sync_state(trainer)
        result: dict[str, Any] = {"metrics": [], "failed": []}
        for i, n in enumerate(SIZES):
            result["metrics"].append(trainer.step(samples(i, n)))
        before = export_state_dict(trainer.model)
        trainer.fail = True
        try:
            trainer.step(samples(50, 4))
        except (StepFailed, RuntimeError) as exc:
            result["failed"].append(type(exc).__name__)
        trainer.fail = False
        result["unchanged"] = all(torch.equal(v, before[k]) for k, v in export_state_dict(trainer.model).items())
        result["grads_cleared"] = all(p.grad is None for p in trainer.params)
        result["metrics"].append(trainer.step(samples(60, 4)))  # and training goes on
        result["weights"] = export_state_dict(trainer.model)

        lora = ShardedTrainer(build_trainer(config(Path(tiny_model), lora=True, lora_rank=4), FRESH))
        sync_state(lora)
        result["lora_metrics"] = [lora.step(samples(70 + i, n)) for i, n in enumerate(SIZES)]
        result["lora_weights"] = export_state_dict(lora.model)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(target: Callable[..., None], args: list[tuple[Any, ...]], timeout: float) -> list[int | None]:
    """Run one spawned process per rank; kill any still alive after `timeout`; exit codes."""
    ctx = multiprocessing.get_context("spawn")
    ranks = [ctx.Process(target=target, args=a) for a in args]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(timeout)
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()
                p.join(5)
    return [p.exitcode for p in ranks]


def test_sharded_steps_equal_single_process_steps(tiny_model: Path, tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'pg'}"
    assert run_ranks(_rank, [(r, 2, init, str(tiny_model), str(tmp_path)) for r in (0, 1)], 120) == [0, 0]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))

    local = build_trainer(config(tiny_model), FRESH)
    local.step(samples(100, 3))
    want = [local.step(samples(i, n)) for i, n in enumerate(SIZES)]
    want.append(local.step(samples(60, 4)))  # the failed batch trained nowhere
    for step, (got, exp) in enumerate(zip(r0["metrics"], want, strict=True)):
        assert_metrics_match(got, exp, step)
    assert_weights_match(r0["weights"], export_state_dict(local.model))
    for k, v in r0["weights"].items():  # the ranks hold bit-identical weights
        assert torch.equal(v, r1["weights"][k]), k
    assert r0["failed"] == ["StepFailed"] and r1["failed"] == ["RuntimeError"]
    assert r0["unchanged"] and r1["unchanged"] and r0["grads_cleared"] and r1["grads_cleared"]

    lora = build_trainer(config(tiny_model, lora=True, lora_rank=4), FRESH)
    lora_want = [lora.step(samples(70 + i, n)) for i, n in enumerate(SIZES)]
    for step, (got, exp) in enumerate(zip(r0["lora_metrics"], lora_want, strict=True)):
        assert_metrics_match(got, exp, step)
    assert_weights_match(r0["lora_weights"], export_state_dict(lora.model))


def _idle_rank(rank: int, init: str, heartbeat_s: float) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=timedelta(seconds=IDLE_TIMEOUT_S))
    try:
        if rank == 0:
            leader = Leader(heartbeat_s)
            leader.start()
            # Idle for twice the group's timeout, counted in heartbeats sent.
            wait_until(lambda: leader.beats * heartbeat_s >= 2 * IDLE_TIMEOUT_S, 30, "heartbeats")
            leader.close()
        else:
            assert follow(cast(ShardedTrainer, None)) == 0  # only noops, then stop
    finally:
        dist.destroy_process_group()


IDLE_TIMEOUT_S = 2


def test_heartbeats_keep_an_idle_group_alive_past_its_timeout(tmp_path: Path) -> None:
    # Without heartbeats rank 1 fails here: "Timed out waiting 2000ms for recv operation".
    init = f"file://{tmp_path / 'pg'}"
    assert run_ranks(_idle_rank, [(r, init, 0.25) for r in (0, 1)], 60) == [0, 0]


# -- the service on a local Ray cluster ------------------------------------------------------------
def descendants(root: int) -> set[int]:
    """Every live process under `root` (Ray's GCS, raylet, agents, workers, actors)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """Ray's temp dir: short on purpose (its AF_UNIX socket paths must stay under 107 bytes,
    which pytest's tmp_path would exceed); removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="nsray-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_ray_backend_trains_like_the_local_trainer(
    s3_env: dict[str, str], s3_settings: Settings, tiny_model: Path, tmp_path: Path, ray_tmp: Path
) -> None:
    port = free_port()
    env = {
        **s3_env,
        "NEXTSTATE_STREAMS__BLOCK_MS": "100",
        "NEXTSTATE_TRAINER__MODEL": str(tiny_model),
        "NEXTSTATE_TRAINER__LR": "1e-3",
        "NEXTSTATE_TRAINER__MICRO_BATCH_TOKENS": "64",
        "NEXTSTATE_TRAINER__KEEP_VERSIONS": "10",
        "NEXTSTATE_TRAINER__THREADS": "1",
        "NEXTSTATE_TRAINER__PORT": str(port),
        "NEXTSTATE_TRAINER__WORK_DIR": str(tmp_path / "work"),
        "NEXTSTATE_TRAINER__BACKEND": "ray",
        "NEXTSTATE_TRAINER__RAY_ADDRESS": "local",  # a cluster of its own, whatever RAY_ADDRESS says
        "NEXTSTATE_TRAINER__NUM_WORKERS": "2",
        "NEXTSTATE_TRAINER__RAY_STORAGE": str(tmp_path / "ray-results"),
        "RAY_TMPDIR": str(ray_tmp),
        # A new local cluster saves its auth token as ~/.ray/auth_token: a HOME of the test's own.
        "HOME": str(ray_tmp / "home"),
    }
    run = s3_settings.run
    keys = Keys(s3_settings.redis.prefix)
    r: Any = redis.Redis.from_url(s3_settings.redis.url, decode_responses=True, socket_timeout=5)
    bucket = Bucket(s3_settings.bucket)
    batches = [TrainBatch(id=f"batch-{i}", run=run, samples=samples(i, n)) for i, n in enumerate(SIZES)]
    proc = ServiceProcess("trainer", env).start()
    assert proc.proc is not None
    ray_pids: set[int] = set()
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/readyz", timeout=120)
        ray_pids = descendants(proc.proc.pid)
        for b in batches:
            r.xadd(keys.batches, {K.FIELD: b.to_json()})

        def latest() -> int:
            pointer = read_latest(bucket, run)
            return pointer.version if pointer else 0

        wait_until(lambda: latest() >= len(batches), 60, f"LATEST {len(batches)}\n{proc.logs()}")
        wait_until(lambda: int(r.xpending(keys.batches, K.GROUP_TRAINER)["pending"]) == 0, 30, "acks")
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert f"nextstate_trainer_steps_total {float(len(batches))}" in metrics
        ray_pids |= descendants(proc.proc.pid)
        assert proc.stop(timeout=60) == 0, proc.logs()
        wait_until(lambda: not any(alive(p) for p in ray_pids), 30,
                   f"Ray's processes to exit: {sorted(p for p in ray_pids if alive(p))}")
        logs = proc.logs(tail=200_000)
        assert re.search(r"rank 0 says stop .*rank=1 steps=4", logs), logs[-4000:]  # rank 1 took part
    finally:
        if proc.proc is not None:
            proc.kill()
        for pid in ray_pids:  # only on failure: what this test's trainer started
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        r.close()

    try:
        # One version per batch, in order, each holding its batch and the step's metrics.
        assert list_versions(bucket, run) == [1, 2, 3, 4]
        manifests = [read_manifest(bucket, manifest_key(run, v)) for v in (1, 2, 3, 4)]
        assert [m.consumed_batch_ids for m in manifests] == [[b.id] for b in batches]
        assert [m.step for m in manifests] == [1, 2, 3, 4]

        local = build_trainer(config(tiny_model), FRESH)
        for version, (b, m) in enumerate(zip(batches, manifests, strict=True)):
            assert_metrics_match(m.metrics, local.step(b.samples, version), version)
        folder = download_checkpoint(bucket, manifests[-1], tmp_path / "dl")
        assert_weights_match(load_file(str(folder / "model.safetensors")), _published(local))
    finally:
        bucket.close()


def _published(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The local trainer's weights as a published folder holds them (tied copies dropped)."""
    state = export_state_dict(trainer.model)
    if getattr(trainer.model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state
