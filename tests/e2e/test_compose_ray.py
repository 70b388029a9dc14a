"""The trainer on a Ray cluster of containers: `docker compose` with COMPOSE_PROFILES=ray.

A Ray head, two Ray worker containers (one CPU each, so one rank each, gloo between
them) and the trainer's driver on a node of its own; the rest of the cpu stack as users
run it. Four batches (five samples, four, one — rank 1 gets nothing — and three) are put
on `batches`: the group commits one version per batch whose metrics and published weights
equal the single-process trainer's on the same batches, computed in a container of the
same image. Both worker containers ran a rank. Then agents' traffic trains through it
and a version it trained is served.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import time
from collections.abc import Iterator

import pytest

from shared import checkpoints as ckpt
from shared import keys as K
from shared.keys import Keys
from shared.schemas import TrainBatch, TrainSample
from shared.store import Bucket
from tests.support.composestack import ComposeStack, docker_unavailable
from tests.support.load import Load
from tests.support.tiny_model import build_tiny_model
from tests.support.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(2400)]

SIZES = (5, 4, 1, 3)
# As tests/integration/test_trainer_ray.py: two ranks' partial gradients summed differ from
# one process's in the last bits; a step missed or doubled moves weights ~1e-3.
METRIC_RTOL, METRIC_ATOL, WEIGHT_ATOL = 1e-5, 1e-6, 1e-5
COMPARED = ("loss", "pg_loss", "kl", "clip_frac", "ratio_mean", "adv_mean", "grad_norm",
            "tokens", "train_tokens", "reward_mean", "samples")

# Run in a container of the trainer's image: the local trainer on the same batches, from
# the same settings (the service's environment), compared with the published version.
REFERENCE = """
import json, sys
from pathlib import Path
from safetensors.torch import load_file
from services.trainer.build import build_trainer
from services.trainer.resume import ResumePoint
from services.trainer.model import export_state_dict
from services.trainer.settings import TrainerSettings
from shared import checkpoints as ckpt
from shared.schemas import TrainBatch
from shared.store import Bucket

data = json.loads(sys.stdin.read())
settings = TrainerSettings()
cfg = settings.trainer.model_copy(update={"backend": "local"})
local = build_trainer(cfg, ResumePoint(version=0, step=0, next_version=1, consumed=[]))
metrics = [local.step(TrainBatch.from_json(b).samples, v) for v, b in enumerate(data["batches"])]
with Bucket(settings.bucket) as bucket:
    manifest = ckpt.read_manifest(bucket, ckpt.manifest_key(settings.run, data["version"]))
    folder = ckpt.download_checkpoint(bucket, manifest, Path("/tmp/published"))
published = load_file(str(folder / "model.safetensors"))
state = export_state_dict(local.model)
if getattr(local.model.config, "tie_word_embeddings", False):
    state.pop("lm_head.weight", None)
assert state.keys() == published.keys(), sorted(set(state) ^ set(published))
worst = max(float((state[k] - published[k]).abs().max()) for k in state)
print(json.dumps({"metrics": metrics, "worst": worst}))
"""


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


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    why = docker_unavailable()
    if why:
        pytest.skip(f"docker compose is unavailable here: {why}")
    work = tmp_path_factory.mktemp("compose-ray")
    model = build_tiny_model(work / "model")
    s = ComposeStack(model=model, workdir=work, profile="ray", settings={
        "BUFFER_BATCH_SIZE": "4", "BUFFER_MAX_WAIT_S": "5", "EVAL_SAMPLES": "2", "TRAINER_LR": "1e-3",
    }).init()
    try:
        s.build()
        yield s
    finally:
        s.close()
        print(f"compose ray timings: { {k: round(v, 1) for k, v in s.timings.items()} }")


def latest(s: ComposeStack) -> int:
    with Bucket(s.bucket_settings()) as b:
        pointer = ckpt.read_latest(b, s.run)
    return pointer.version if pointer else 0


async def test_a_step_across_two_worker_containers_equals_the_single_process_step(stack: ComposeStack) -> None:
    s = stack
    s.timings["up"] = await asyncio.to_thread(s.up)
    workers = s.container_ids("ray-worker")
    assert len(workers) == 2
    batches = [TrainBatch(id=f"ray-batch-{i}", run=s.run, samples=samples(i, n)) for i, n in enumerate(SIZES)]
    t0 = time.monotonic()
    with s.redis() as r:
        for b in batches:
            r.xadd(Keys(s.prefix).batches, {K.FIELD: b.to_json()})
    await until(lambda: latest(s) >= len(batches), 300, f"LATEST {len(batches)}")
    s.timings["4 steps on Ray"] = time.monotonic() - t0
    with Bucket(s.bucket_settings()) as b:
        manifests = [ckpt.read_manifest(b, ckpt.manifest_key(s.run, v)) for v in range(1, len(batches) + 1)]
    assert [m.consumed_batch_ids for m in manifests] == [[b.id] for b in batches]
    # each worker container ran a rank of the group
    for w in workers:
        top = subprocess.run(["docker", "top", w, "-o", "pid,args"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        assert "RayTrainWorker" in top, f"no training rank in {w}:\n{top}"

    t0 = time.monotonic()
    ref = s.compose("run", "--rm", "--no-deps", "-T", "--entrypoint", "python", "trainer-ray", "-c", REFERENCE,
                    input=json.dumps({"batches": [b.to_json() for b in batches], "version": len(batches)}),
                    timeout=600).stdout
    s.timings["single-process reference"] = time.monotonic() - t0
    result = json.loads(ref.strip().splitlines()[-1])
    for step, (got, want) in enumerate(zip([m.metrics for m in manifests], result["metrics"], strict=True)):
        for k in COMPARED:
            if k in want:
                assert got[k] == pytest.approx(want[k], rel=METRIC_RTOL, abs=METRIC_ATOL), (step, k)
    assert result["worst"] < WEIGHT_ATOL, result["worst"]

    # and the loop trains through the group: agents' turns become a version that is served
    load = Load(url=s.url, agents=3, turns=3, max_tokens=4, api_key=s.api_key).start()
    try:
        t0 = time.monotonic()
        await until(lambda: latest(s) > len(batches), 300, "a version trained from traffic on Ray")
        trained = latest(s)
        await until(lambda: any(x.weight_version.isdigit() and int(x.weight_version) > len(batches)
                                for x in load.served), 180, "a version trained on Ray served")
        s.timings["traffic -> version served"] = time.monotonic() - t0
    finally:
        await load.stop()
    print(f"compose ray: 4 steps equal the local trainer's (worst weight diff {result['worst']:.2e}); "
          f"version {trained} trained from {len(load.served)} served responses; timings "
          f"{json.dumps({k: round(v, 1) for k, v in s.timings.items()})}")
