"""Trainer checkpoints against a real S3 (SeaweedFS): commit, verify, load, resume, retention.
(The resume state's own cadence and lineage: tests/integration/test_trainer_resume_state.py.)"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from services.trainer.build import build_trainer
from services.trainer.checkpoint import commit_snapshot, take_snapshot
from services.trainer.model import load_causal_lm, write_tokenizer
from services.trainer.resume import ResumePoint, apply_point, find_resume_point
from services.trainer.settings import TrainerConfig
from services.trainer.step import Trainer
from services.trainer.trainer_state import (
    STATE_META,
    read_state_meta,
    state_key,
    take_resume_state,
    write_resume_state,
)
from shared.checkpoints import (
    download_checkpoint,
    latest_key,
    list_versions,
    manifest_key,
    read_latest,
    read_manifest,
    set_latest,
)
from shared.schemas import LatestPointer, TrainSample
from shared.settings import Settings
from shared.store import Bucket

pytestmark = pytest.mark.integration

CPU = torch.device("cpu")


def samples(seed: int, n: int = 3) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, r = rng.randint(2, 10), rng.randint(2, 8)
        out.append(TrainSample(
            session_id="s", tokens=[rng.randrange(500) for _ in range(p + r)], response_length=r,
            loss_mask=[1] * r, reward=rng.choice([1.0, -1.0]),
            rollout_logprobs=[-rng.uniform(5.7, 6.8) for _ in range(r)], temperature=0.8,  # near the model's own: -log(vocab)
        ))  # fmt: skip
    return out


def config(tiny_model: Path, **kw: Any) -> TrainerConfig:
    return TrainerConfig(model=str(tiny_model), lr=1e-2, device="cpu", **kw)


def train_and_commit(
    bucket: Bucket, run: str, trainer: Trainer, tmp: Path, static: Path, tiny_model: Path,
    version: int, step: int, keep: int = 5, resume: bool = True,
) -> None:
    """Train one step into `version` (parent: the version before), commit it, and (`resume`)
    write its resume state after the commit, as the service's lanes do."""
    batch_id = f"b{version}"
    m = trainer.step(samples(version))
    snap = take_snapshot(trainer, version, step, [batch_id], [f"b{i}" for i in range(1, version + 1)], m,
                         parent=version - 1, ancestors=range(1, version - 1))
    commit_snapshot(bucket, run, snap, trainer.model, work_dir=tmp, static_dir=static,
                    base_model=str(tiny_model), keep=keep)
    if resume:
        write_resume_state(bucket, run, take_resume_state(trainer, version, step), tmp)


def logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=torch.tensor([ids])).logits
        return out


def test_full_commit_verifies_loads_differs_and_resumes(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    run = s3_settings.run
    cfg = config(tiny_model, kl_beta=0.02)
    trainer = build_trainer(cfg, ResumePoint(version=0, step=0, next_version=1, consumed=[]))
    static = write_tokenizer(tiny_model, tmp_path / "static")
    train_and_commit(bucket, run, trainer, tmp_path, static, tiny_model, version=1, step=1)
    train_and_commit(bucket, run, trainer, tmp_path, static, tiny_model, version=2, step=2)

    latest = read_latest(bucket, run)
    assert latest is not None and latest.version == 2
    manifest = read_manifest(bucket, latest.manifest)
    assert (manifest.step, manifest.consumed_batch_ids, manifest.base_model) == (2, ["b2"], str(tiny_model))
    assert {"loss", "pg_loss", "clip_frac", "kl", "grad_norm", "tokens_per_s"} <= manifest.metrics.keys()
    names = {f.path for f in manifest.files}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names

    folder = download_checkpoint(bucket, manifest, tmp_path / "dl")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    AutoTokenizer.from_pretrained(str(folder))
    ids = samples(99, 1)[0].tokens
    assert torch.allclose(logits(loaded, ids), logits(trainer.model, ids), atol=1e-5)
    assert not torch.allclose(logits(loaded, ids), logits(load_causal_lm(tiny_model, CPU, torch.float32), ids), atol=1e-3)

    resume = find_resume_point(bucket, run, tmp_path / "resume")
    assert (resume.version, resume.step, resume.next_version) == (2, 2, 3)
    assert resume.consumed == ["b1", "b2"] and resume.model_dir is not None
    again = build_trainer(cfg, resume)
    assert torch.allclose(logits(again.model, ids), logits(trainer.model, ids), atol=1e-6)
    live = trainer.optimizer.state_dict()["state"]
    restored = again.optimizer.state_dict()["state"]
    assert live.keys() == restored.keys()
    for k in live:
        assert float(restored[k]["step"]) == 2.0
        assert torch.equal(live[k]["exp_avg_sq"], restored[k]["exp_avg_sq"])
    # The next step continues identically whether or not the process restarted.
    batch = samples(3)
    trainer.step(batch)
    again.step(batch)
    assert torch.allclose(logits(again.model, ids), logits(trainer.model, ids), atol=1e-5)


def test_lora_publishes_merged_weights_and_resumes_its_adapter(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    run = s3_settings.run
    cfg = config(tiny_model, lora=True, lora_rank=4, lora_alpha=8, kl_beta=0.02)
    trainer = build_trainer(cfg, ResumePoint(version=0, step=0, next_version=1, consumed=[]))
    assert trainer.reference is None  # the base with adapters off is the reference
    train_and_commit(bucket, run, trainer, tmp_path, write_tokenizer(tiny_model, tmp_path / "st"),
                     tiny_model, version=1, step=1)
    manifest = read_manifest(bucket, read_latest(bucket, run).manifest)  # type: ignore[union-attr]
    folder = download_checkpoint(bucket, manifest, tmp_path / "dl")
    plain = load_causal_lm(folder, CPU, torch.float32)
    assert not hasattr(plain, "peft_config")
    ids = samples(7, 1)[0].tokens
    assert torch.allclose(logits(plain, ids), logits(trainer.model, ids), atol=1e-5)

    resume = find_resume_point(bucket, run, tmp_path / "resume", need_weights=False)
    assert resume.model_dir is None and resume.tensors is not None and resume.tensors["adapter"]
    again = build_trainer(cfg, resume)
    assert torch.allclose(logits(again.model, ids), logits(trainer.model, ids), atol=1e-6)


def test_interrupted_commit_is_finished_but_a_rollback_is_not_undone(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    run = s3_settings.run
    trainer = build_trainer(config(tiny_model, kl_beta=0.0),
                            ResumePoint(version=0, step=0, next_version=1, consumed=[]))
    static = write_tokenizer(tiny_model, tmp_path / "static")
    train_and_commit(bucket, run, trainer, tmp_path, static, tiny_model, version=1, step=1)
    pointer_v1 = bucket.get_bytes(latest_key(run))
    train_and_commit(bucket, run, trainer, tmp_path, static, tiny_model, version=2, step=2)
    # A crash between manifest and LATEST: the pointer still says v1, written before v2's manifest.
    bucket.put_bytes(latest_key(run), pointer_v1)
    resume = find_resume_point(bucket, run, tmp_path / "r1")
    assert (resume.version, resume.consumed, resume.next_version) == (2, ["b1", "b2"], 3)
    assert read_latest(bucket, run).version == 2  # type: ignore[union-attr]

    # An operator's rollback is a newer pointer: the trainer resumes from it, numbering goes on.
    set_latest(bucket, run, 1)
    resume = find_resume_point(bucket, run, tmp_path / "r2")
    assert (resume.version, resume.step, resume.next_version) == (1, 1, 3)
    assert LatestPointer.model_validate_json(bucket.get_bytes(latest_key(run))).version == 1
    assert resume.latest is not None and resume.latest.version == 1

    # A version of the lineage the rollback abandoned (trained from v2), its manifest written
    # after the rollback's pointer (its upload was in flight): not a commit to finish.
    m = trainer.step(samples(3))
    snap = take_snapshot(trainer, 3, 3, ["b3"], ["b1", "b2", "b3"], m, parent=2)
    commit_snapshot(bucket, run, snap, trainer.model, work_dir=tmp_path, static_dir=static,
                    base_model=str(tiny_model), keep=5)
    bucket.put_bytes(latest_key(run), pointer_v1)  # LATEST on v1, written before that manifest
    resume = find_resume_point(bucket, run, tmp_path / "r3")
    assert (resume.version, resume.next_version) == (1, 4)
    assert read_latest(bucket, run).version == 1  # type: ignore[union-attr]
    # The trainer's own commit on v1 (parent 1), cut off before LATEST, is finished.
    snap = take_snapshot(trainer, 4, 2, ["b4"], ["b1", "b4"], m, parent=1)
    commit_snapshot(bucket, run, snap, trainer.model, work_dir=tmp_path, static_dir=static,
                    base_model=str(tiny_model), keep=5)
    bucket.put_bytes(latest_key(run), pointer_v1)
    resume = find_resume_point(bucket, run, tmp_path / "r4")
    assert (resume.version, resume.consumed, resume.next_version) == (4, ["b1", "b4"], 5)
    assert read_latest(bucket, run).version == 4  # type: ignore[union-attr]


def test_a_rebase_loads_the_version_asked_for_in_place(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    run = s3_settings.run
    cfg = config(tiny_model, kl_beta=0.0)
    trainer = build_trainer(cfg, ResumePoint(version=0, step=0, next_version=1, consumed=[]))
    static = write_tokenizer(tiny_model, tmp_path / "static")
    for v in (1, 2, 3):
        train_and_commit(bucket, run, trainer, tmp_path, static, tiny_model, version=v, step=v)
    ids = samples(99, 1)[0].tokens
    v1 = build_trainer(cfg, find_resume_point(bucket, run, tmp_path / "a", at=1))

    point = find_resume_point(bucket, run, tmp_path / "b", at=1)
    assert (point.version, point.step, point.consumed, point.next_version) == (1, 1, ["b1"], 4)
    reference, params = trainer.reference, trainer.params
    apply_point(trainer, point, str(tiny_model))
    assert trainer.reference is reference  # nothing else reloaded: the same parameters train on
    assert all(a is b for a, b in zip(trainer.optimizer.param_groups[0]["params"], params, strict=True))
    assert torch.allclose(logits(trainer.model, ids), logits(v1.model, ids), atol=1e-6)
    assert {float(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()} == {1.0}
    # It trains on exactly as a trainer started from v1 would.
    batch = samples(4)
    trainer.step(batch)
    v1.step(batch)
    assert torch.allclose(logits(trainer.model, ids), logits(v1.model, ids), atol=1e-5)

    # A version that does not verify is passed over for the next lower one; v0: the base model.
    bucket.delete(manifest_key(run, 1))
    point = find_resume_point(bucket, run, tmp_path / "c", at=1)
    assert point.version == 0 and [r.version for r in point.refused] == [1]
    apply_point(trainer, point, str(tiny_model))
    base = load_causal_lm(tiny_model, CPU, torch.float32)
    assert torch.allclose(logits(trainer.model, ids), logits(base, ids), atol=1e-6)
    assert trainer.optimizer.state_dict()["state"] == {}


def test_retention_keeps_versions_and_their_trainer_states(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    run = s3_settings.run
    trainer = build_trainer(config(tiny_model, kl_beta=0.0),
                            ResumePoint(version=0, step=0, next_version=1, consumed=[]))
    static = write_tokenizer(tiny_model, tmp_path / "static")
    for v in (1, 2, 3):
        train_and_commit(bucket, run, trainer, tmp_path, static, tiny_model, version=v, step=v, keep=2)
    assert list_versions(bucket, run) == [2, 3]
    assert read_state_meta(bucket, run, 1) is None
    assert bucket.exists(state_key(run, 3, STATE_META))
    assert not any(p.name.startswith("snapshot-") for p in tmp_path.iterdir())  # local scratch cleaned
