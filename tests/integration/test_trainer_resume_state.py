"""Versions are weights only; the resume state comes at its own cadence (services/trainer/
trainer_state.py). Against a real S3 (SeaweedFS), tiny models trained and committed for real:
a restart takes the newest version's weights and the newest resume state of *its lineage*;
a damaged resume state costs the optimizer, never the version; a rebase onto a version with
none starts a fresh optimizer on its weights; retention keeps the resume state kept versions
need; with LoRA published merged, the version's own adapter comes back from its record."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from services.trainer.build import build_trainer
from services.trainer.checkpoint import commit_snapshot, take_snapshot
from services.trainer.model import write_tokenizer
from services.trainer.resume import ResumePoint, apply_point, find_resume_point
from services.trainer.settings import TrainerConfig
from services.trainer.step import Trainer
from services.trainer.trainer_state import (
    STATE_ADAPTER,
    STATE_META,
    STATE_TENSORS,
    state_key,
    take_resume_state,
    write_resume_state,
)
from shared.checkpoints import list_versions, set_latest
from shared.schemas import TrainSample
from shared.settings import Settings
from shared.store import Bucket

pytestmark = pytest.mark.integration

NEAR_UNIFORM = -6.25  # log(1/518): the tiny random model's log-probs, so no sample is too far to train


def samples(seed: int, n: int = 3) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, r = rng.randint(2, 10), rng.randint(2, 8)
        out.append(TrainSample(
            session_id="s", tokens=[rng.randrange(500) for _ in range(p + r)], response_length=r,
            loss_mask=[1] * r, reward=rng.choice([1.0, -1.0]),
            rollout_logprobs=[NEAR_UNIFORM + rng.uniform(-0.05, 0.05) for _ in range(r)], temperature=1.0,
        ))  # fmt: skip
    return out


def config(tiny_model: Path, **kw: Any) -> TrainerConfig:
    return TrainerConfig(model=str(tiny_model), lr=1e-2, device="cpu", kl_beta=0.0, **kw)


def fresh(cfg: TrainerConfig) -> Trainer:
    return build_trainer(cfg, ResumePoint(version=0, step=0, next_version=1, consumed=[]))


class Lineage:
    """Trains and commits versions the way the service does: each version's record names its
    parent and ancestors; a resume state only where asked, after the commit."""

    def __init__(self, bucket: Bucket, run: str, trainer: Trainer, tmp: Path, tiny_model: Path, keep: int = 10):
        self.bucket, self.run, self.trainer, self.tmp, self.keep = bucket, run, trainer, tmp, keep
        self.base = str(tiny_model)
        self.static = write_tokenizer(tiny_model, tmp / "static")
        self.head, self.ancestry, self.step, self.consumed = 0, list[int](), 0, list[str]()

    def commit(self, version: int, *, resume: bool = False) -> None:
        self.trainer.step(samples(version), self.head)
        self.step += 1
        self.consumed.append(f"b{version}")
        snap = take_snapshot(self.trainer, version, self.step, [f"b{version}"], self.consumed, {},
                             parent=self.head, ancestors=self.ancestry)
        commit_snapshot(self.bucket, self.run, snap, self.trainer.model, work_dir=self.tmp,
                        static_dir=self.static, base_model=self.base, keep=self.keep)
        if resume:
            write_resume_state(self.bucket, self.run, take_resume_state(self.trainer, version, self.step), self.tmp)
        self.head, self.ancestry = version, snap.ancestors

    def has_resume_state(self, version: int) -> bool:
        return self.bucket.exists(state_key(self.run, version, STATE_TENSORS))


def logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=torch.tensor([ids])).logits
        return out


def adam_steps(optimizer: Any) -> set[float]:
    return {float(s["step"]) for s in optimizer.state_dict()["state"].values()}


IDS = samples(99, 1)[0].tokens


def test_a_restart_takes_the_newest_weights_and_the_resume_state_of_their_lineage(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    run, cfg = s3_settings.run, config(tiny_model)
    line = Lineage(bucket, run, fresh(cfg), tmp_path, tiny_model)
    line.commit(1, resume=True)
    line.commit(2)
    line.commit(3)
    assert [line.has_resume_state(v) for v in (1, 2, 3)] == [True, False, False]  # versions: weights only

    point = find_resume_point(bucket, run, tmp_path / "r1")
    assert (point.version, point.resumed, point.step, point.ancestors) == (3, 1, 3, [1, 2])
    assert point.consumed == ["b1", "b2", "b3"]  # what every version since holds: never trained again
    again = build_trainer(cfg, point)
    assert torch.allclose(logits(again.model, IDS), logits(line.trainer.model, IDS), atol=1e-6)  # v3's weights
    assert adam_steps(again.optimizer) == {1.0}  # v1's optimizer

    # Another lineage: a rollback to v1, then v4 trained from it. v2 gets a resume state now,
    # but it is not v4's ancestor: v4 resumes with v1's.
    write_resume_state(bucket, run, take_resume_state(line.trainer, 2, 2), tmp_path)
    rolled = Lineage(bucket, run, build_trainer(cfg, find_resume_point(bucket, run, tmp_path / "r2", at=1)),
                     tmp_path, tiny_model)
    rolled.head, rolled.ancestry, rolled.step, rolled.consumed = 1, [], 1, ["b1"]
    rolled.commit(4)
    set_latest(bucket, run, 4)
    point = find_resume_point(bucket, run, tmp_path / "r3")
    assert (point.version, point.resumed, point.ancestors, point.consumed) == (4, 1, [1], ["b1", "b4"])
    assert find_resume_point(bucket, run, tmp_path / "r4", at=3).resumed == 2  # v3's lineage: v2's


def test_a_damaged_resume_state_costs_the_optimizer_not_the_version(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    run, cfg = s3_settings.run, config(tiny_model)
    line = Lineage(bucket, run, fresh(cfg), tmp_path, tiny_model)
    line.commit(1, resume=True)
    line.commit(2, resume=True)
    bucket.put_bytes(state_key(run, 2, STATE_TENSORS), b"not a torch file")

    point = find_resume_point(bucket, run, tmp_path / "r")
    assert (point.version, point.resumed) == (2, 1)
    assert [(r.version, r.reason) for r in point.refused] == [(2, "resume")]
    again = build_trainer(cfg, point)
    assert torch.allclose(logits(again.model, IDS), logits(line.trainer.model, IDS), atol=1e-6)
    assert adam_steps(again.optimizer) == {1.0}


def test_a_rebase_onto_a_version_without_resume_state_starts_a_fresh_optimizer(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    run, cfg = s3_settings.run, config(tiny_model)
    line = Lineage(bucket, run, fresh(cfg), tmp_path, tiny_model)
    line.commit(1)
    v1 = logits(line.trainer.model, IDS)
    line.commit(2)
    line.commit(3, resume=True)
    assert adam_steps(line.trainer.optimizer) == {3.0}

    point = find_resume_point(bucket, run, tmp_path / "r", at=1)
    assert (point.version, point.resumed, point.tensors) == (1, None, None)
    apply_point(line.trainer, point, str(tiny_model))
    assert torch.allclose(logits(line.trainer.model, IDS), v1, atol=1e-6)
    assert line.trainer.optimizer.state_dict()["state"] == {}
    line.trainer.step(samples(7), 1)  # and it trains on from there
    assert adam_steps(line.trainer.optimizer) == {1.0}


def test_retention_keeps_the_resume_state_kept_versions_need(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    run = s3_settings.run
    line = Lineage(bucket, run, fresh(config(tiny_model)), tmp_path, tiny_model, keep=2)
    line.commit(1, resume=True)
    for v in (2, 3, 4):
        line.commit(v)
    assert list_versions(bucket, run) == [3, 4]
    assert line.has_resume_state(1) and bucket.exists(state_key(run, 1, STATE_META))  # v3, v4 resume from it
    assert not bucket.exists(state_key(run, 2, STATE_META))
    line.commit(5, resume=True)
    assert list_versions(bucket, run) == [4, 5] and line.has_resume_state(1)  # v4 still needs it
    line.commit(6)
    assert list_versions(bucket, run) == [5, 6]
    assert not line.has_resume_state(1) and line.has_resume_state(5)
    assert find_resume_point(bucket, run, tmp_path / "r").resumed == 5


def test_lora_merged_resumes_the_versions_own_adapter_beside_an_older_resume_state(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    run = s3_settings.run
    cfg = config(tiny_model, lora=True, lora_rank=4, lora_alpha=8, lora_publish="merged")
    line = Lineage(bucket, run, fresh(cfg), tmp_path, tiny_model)
    line.commit(1, resume=True)
    line.commit(2)
    assert bucket.exists(state_key(run, 2, STATE_ADAPTER))  # megabytes: every version keeps its adapter

    point = find_resume_point(bucket, run, tmp_path / "r", need_weights=False)
    assert (point.version, point.resumed, point.model_dir) == (2, 1, None)  # no merged weights downloaded
    assert point.tensors is not None and point.tensors["adapter"]
    again = build_trainer(cfg, point)
    assert torch.allclose(logits(again.model, IDS), logits(line.trainer.model, IDS), atol=1e-6)
    assert adam_steps(again.optimizer) == {1.0}
