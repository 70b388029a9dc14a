"""The real vLLM (CPU build, 0.32) serving LoRA versions: started as `nextstate up --engine vllm
--lora R` starts it (shared/vllm_engine.py: --enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING), on a
tiny Llama built on the spot, with the real trainer's adapter versions in a real bucket.

- the watcher (a real process) loads each adapter version by name and unloads the one it
  replaced; the collector (a real process, `vllm` client naming the served adapter) answers on
  it: `X-Policy-Version` and the captured turn say the version; the trainer recomputes vLLM's
  log-probs of base + adapter within 1e-4;
- a corrupt adapter is refused without vLLM being asked to load it, the good one keeps serving;
- a rollback puts the older adapter back.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import torch

from services.trainer.batching import collate
from services.trainer.build import build_trainer
from services.trainer.checkpoint import Publishing, commit_snapshot, take_snapshot
from services.trainer.model import window_logprobs
from services.trainer.resume import ResumePoint
from services.trainer.settings import TrainerConfig
from services.trainer.step import Trainer
from shared import checkpoints as ckpt
from shared.runs import model_fingerprint
from shared.schemas import PolicyLoaded, TrainSample, Turn
from shared.store import Bucket
from tests.conftest import settings_from
from tests.integration.test_vllm_real import poll
from tests.support.servers import ServiceProcess, free_port
from tests.support.vllm_server import TOKEN, VLLMServer, require_vllm, tiny_vllm_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

RANK = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_vllm_model(tmp_path_factory.mktemp("vllm-lora-model") / "tiny")


@pytest.fixture(scope="module")
def vllm(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    spec = require_vllm().model_copy(update={"lora_rank": RANK})
    server = VLLMServer(model, tmp_path_factory.mktemp("vllm-lora-log") / "vllm.log", spec)
    try:
        yield server.start()
    finally:
        server.stop()


def samples(seed: int) -> list[TrainSample]:
    rng = random.Random(seed)
    return [TrainSample(
        session_id="s", tokens=[rng.randrange(500) for _ in range(12)], response_length=6, loss_mask=[1] * 6,
        reward=rng.choice([1.0, -1.0]), rollout_logprobs=[-3.0] * 6, temperature=1.0,
    ) for _ in range(3)]  # fmt: skip


def commit(trainer: Trainer, bucket: Bucket, run: str, version: int, model: Path, work: Path) -> None:
    trainer.step(samples(version))
    snap = take_snapshot(trainer, version, version, [f"b{version}"], [f"b{version}"], {}, parent=version - 1,
                         fmt="adapter")
    pub = Publishing(base_model=str(model), base_fingerprint=model_fingerprint(model), keep=5)
    commit_snapshot(bucket, run, snap, trainer.model, work_dir=work, static_dir=None, base_model=str(model),
                    keep=5, publishing=pub)


def test_vllm_serves_each_adapter_version_by_name_and_refuses_a_corrupt_one(
    vllm: VLLMServer, model: Path, s3_env: dict[str, str], redis_url: str, tmp_path: Path,
) -> None:  # fmt: skip
    settings = settings_from(s3_env)
    run, prefix = s3_env["NEXTSTATE_RUN"], s3_env["NEXTSTATE_REDIS__PREFIX"]
    bucket = Bucket(settings.bucket)
    cfg = TrainerConfig(model=str(model), lr=5e-2, device="cpu", kl_beta=0.0, lora=True, lora_rank=RANK,
                        lora_alpha=2 * RANK)
    trainer = build_trainer(cfg, ResumePoint(version=0, step=0, next_version=1, consumed=[]))
    commit(trainer, bucket, run, 1, model, tmp_path / "work")
    manifest = ckpt.read_manifest(bucket, ckpt.manifest_key(run, 1))
    assert (manifest.format, manifest.adapter.rank if manifest.adapter else None) == ("adapter", RANK)
    assert {f.path for f in manifest.files} == {"adapter_config.json", "adapter_model.safetensors"}

    common = {**s3_env, "NEXTSTATE_INTERNAL__TOKEN": TOKEN}
    wport, cport = free_port(), free_port()
    watcher = ServiceProcess("watcher", {
        **common, "NEXTSTATE_WATCHER__ENGINE_KIND": "vllm", "NEXTSTATE_WATCHER__ENGINE_URL": vllm.url,
        "NEXTSTATE_WATCHER__LOCAL_DIR": str(tmp_path / "local"), "NEXTSTATE_WATCHER__BASE_MODEL": str(model),
        "NEXTSTATE_WATCHER__POLL_INTERVAL_S": "0.5", "NEXTSTATE_WATCHER__PORT": str(wport),
    }).start()  # fmt: skip
    collector = ServiceProcess("collector", {
        **common, "NEXTSTATE_COLLECTOR__ENGINE_KIND": "vllm", "NEXTSTATE_COLLECTOR__ENGINE_URL": vllm.url,
        "NEXTSTATE_COLLECTOR__ENGINE_ADAPTERS": "true", "NEXTSTATE_COLLECTOR__TOKENIZER": str(model),
        "NEXTSTATE_COLLECTOR__PORT": str(cport),
        "NEXTSTATE_COLLECTOR__SPOOL_PATH": str(Path(tempfile.mkdtemp()) / "spool.jsonl"),
    }).start()  # fmt: skip
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    auth = {"authorization": f"Bearer {TOKEN}"}

    def loaded() -> list[int]:
        return [PolicyLoaded.from_json(f["data"]).version for _, f in r.xrange(f"{prefix}:policy")]

    def adapters() -> list[str]:
        data = httpx.get(f"{vllm.url}/v1/models", headers=auth, timeout=10).json()["data"]
        return [m["id"] for m in data if m.get("parent")]

    def chat(session: str) -> httpx.Response:
        return httpx.post(f"http://127.0.0.1:{cport}/v1/chat/completions", timeout=120, headers={
            "X-Session-Done": "1"}, json={  # a turn with no next state to wait for: captured at once
            "model": "policy", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6,
            "temperature": 1.0, "seed": 3, "user": session})

    try:
        collector.wait_http(f"http://127.0.0.1:{cport}/readyz", timeout=120)
        poll(lambda: loaded() == [1], 120, "v1 loaded", watcher.logs)
        assert adapters() == ["1"]
        answer = chat("a")
        assert answer.status_code == 200 and answer.headers["x-policy-version"] == "1", answer.text
        turn = poll(lambda: [Turn.from_json(f["data"]) for _, f in r.xrange(f"{prefix}:turns")], 60, "a turn")[0]
        assert (turn.weight_version, turn.policy_version) == ("1", 1)
        # vLLM sampled from base + v1's adapter: the trainer's PEFT model gives the same log-probs.
        sample = TrainSample(session_id="s", tokens=turn.prompt_ids + turn.response_ids,
                             response_length=len(turn.response_ids), loss_mask=[1] * len(turn.response_ids),
                             reward=1.0, rollout_logprobs=turn.response_logprobs, temperature=1.0)
        mb = collate([sample], "rl")
        assert mb is not None
        with torch.no_grad():
            ours = window_logprobs(trainer.model, mb)  # the trainer's adapter is still v1's
        m = mb.mask.bool()
        assert (ours[m] - mb.old_logprobs[m]).abs().max().item() < 1e-4

        # v2: loaded by name, v1 unloaded; the collector follows.
        commit(trainer, bucket, run, 2, model, tmp_path / "work")
        poll(lambda: loaded() == [1, 2], 120, "v2 loaded", watcher.logs)
        assert adapters() == ["2"]
        assert chat("b").headers["x-policy-version"] == "2"

        # v3: its adapter's bytes differ from the manifest: refused, never sent to vLLM.
        loads = vllm.count("POST /v1/load_lora_adapter")
        commit(trainer, bucket, run, 3, model, tmp_path / "work")
        key = ckpt.version_prefix(run, 3) + "adapter_model.safetensors"
        data = bytearray(bucket.get_bytes(key))
        data[-1] ^= 0xFF
        bucket.put_bytes(key, bytes(data))
        refused = poll(lambda: r.hgetall(f"{prefix}:refused-versions").get("3"), 120, "v3 refused", watcher.logs)
        assert "checksum" in refused
        assert vllm.count("POST /v1/load_lora_adapter") == loads and adapters() == ["2"]
        assert chat("c").headers["x-policy-version"] == "2"

        # A rollback to v1: its adapter is loaded again, v2's unloaded.
        ckpt.set_latest(bucket, run, 1)
        poll(lambda: loaded() == [1, 2, 1], 120, "the rollback to v1", watcher.logs)
        assert adapters() == ["1"] and chat("d").headers["x-policy-version"] == "1"
    finally:
        collector.stop()
        assert watcher.stop() in (0, None), watcher.logs()
        bucket.close()
