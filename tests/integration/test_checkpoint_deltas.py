"""Full versions as deltas against a real S3 (SeaweedFS): the trainer publishes a chain, a reader
rebuilds it bit for bit, a broken link falls back to the snapshot, retention keeps the chain."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from services.trainer.build import build_trainer
from services.trainer.checkpoint import (
    Chain,
    Publishing,
    commit_snapshot,
    take_snapshot,
)
from services.trainer.model import write_tokenizer
from services.trainer.resume import ResumePoint
from services.trainer.settings import TrainerConfig
from shared.checkpoints import (
    download_checkpoint,
    list_versions,
    manifest_key,
    read_manifest,
    version_prefix,
)
from shared.errors import BrokenDelta
from shared.schemas import TrainSample
from shared.settings import Settings
from shared.store import Bucket

pytestmark = pytest.mark.integration


def samples(seed: int) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(3):
        p, r = rng.randint(2, 10), rng.randint(2, 8)
        out.append(TrainSample(
            session_id="s", tokens=[rng.randrange(500) for _ in range(p + r)], response_length=r,
            loss_mask=[1] * r, reward=rng.choice([1.0, -1.0]),
            rollout_logprobs=[-rng.uniform(5.7, 6.8) for _ in range(r)], temperature=0.8,  # near the model's own: -log(vocab)
        ))  # fmt: skip
    return out


def test_a_snapshot_every_k_versions_and_retention_keeps_each_kept_versions_chain(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    run = s3_settings.run
    cfg = TrainerConfig(model=str(tiny_model), lr=1e-5, device="cpu", kl_beta=0.0)
    trainer = build_trainer(cfg, ResumePoint(version=0, step=0, next_version=1, consumed=[]))
    static = write_tokenizer(tiny_model, tmp_path / "static")
    pub = Publishing(base_model=str(tiny_model), base_fingerprint="sha256:test", snapshot_every=3,
                     keep=1, min_saving=0.0)
    chain: Chain | None = None
    kept, deltas = [], []
    for v in range(1, 6):
        trainer.step(samples(v))
        snap = take_snapshot(trainer, v, v, [f"b{v}"], [f"b{v}"], {}, parent=v - 1)
        manifest, chain = commit_snapshot(bucket, run, snap, trainer.model, work_dir=tmp_path / "work",
                                          static_dir=static, base_model=str(tiny_model), keep=1,
                                          publishing=pub, chain=chain)
        assert chain is not None and chain.version == v
        assert (manifest.format, manifest.dtype, manifest.base_fingerprint) == ("full", "float32", "sha256:test")
        kept.append(list_versions(bucket, run))
        deltas.append([(e.of, e.base_version) for e in manifest.encoded])
    # A snapshot every 3 versions: v1 and v4 whole, the others deltas on the version before.
    assert deltas == [[], [("model.safetensors", 1)], [("model.safetensors", 2)], [],
                      [("model.safetensors", 4)]]
    # keep=1 keeps the newest version and every version it builds on, down to its snapshot.
    assert kept == [[1], [1, 2], [1, 2, 3], [4], [4, 5]]


def test_a_reader_follows_the_chain_and_refuses_what_it_cannot_rebuild(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    run = s3_settings.run
    cfg = TrainerConfig(model=str(tiny_model), lr=1e-5, device="cpu", kl_beta=0.0)
    trainer = build_trainer(cfg, ResumePoint(version=0, step=0, next_version=1, consumed=[]))
    static = write_tokenizer(tiny_model, tmp_path / "static")
    pub = Publishing(base_model=str(tiny_model), snapshot_every=4, keep=2, min_saving=0.0,
                     dtype=torch.bfloat16)
    chain: Chain | None = None
    published: dict[int, bytes] = {}
    for v in range(1, 4):
        trainer.step(samples(v))
        snap = take_snapshot(trainer, v, v, [f"b{v}"], [f"b{v}"], {}, parent=v - 1)
        _, chain = commit_snapshot(bucket, run, snap, trainer.model, work_dir=tmp_path / "work",
                                   static_dir=static, base_model=str(tiny_model), keep=2,
                                   publishing=pub, chain=chain)
        assert chain is not None
        published[v] = (chain.folder / "model.safetensors").read_bytes()

    # keep=2 keeps v2 and v3, and v1 too: v2 builds on it.
    assert list_versions(bucket, run) == [1, 2, 3]
    m = {v: read_manifest(bucket, manifest_key(run, v)) for v in (1, 2, 3)}
    assert m[1].encoded == [] and m[1].snapshot is None
    assert [(e.of, e.base_version) for e in m[2].encoded] == [("model.safetensors", 1)]
    assert [(e.of, e.base_version) for e in m[3].encoded] == [("model.safetensors", 2)]
    assert m[3].snapshot == 1 and {m[v].dtype for v in m} == {"bfloat16"}
    delta_size = m[3].encoded[0].size
    assert delta_size < 0.5 * next(f.size for f in m[3].files if f.path == "model.safetensors")

    # A fresh reader of v3 installs v1, rebuilds v2 and v3: bit for bit what the trainer wrote.
    fresh = tmp_path / "reader"
    folder = download_checkpoint(bucket, m[3], fresh)
    assert (folder / "model.safetensors").read_bytes() == published[3]
    assert (fresh / "v000002" / "model.safetensors").read_bytes() == published[2]
    assert not list(folder.glob("*.xor.zst"))
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(str(folder / "model.safetensors")).values()} == {torch.bfloat16}

    # A broken link (v2's delta corrupted in the bucket): v2 and v3 are refused, v1 installs.
    key = version_prefix(run, 2) + m[2].encoded[0].path
    good = bucket.get_bytes(key)
    data = bytearray(good)
    data[len(data) // 2] ^= 0xFF
    bucket.put_bytes(key, bytes(data))
    other = tmp_path / "reader2"
    with pytest.raises(BrokenDelta, match="v2"):
        download_checkpoint(bucket, m[3], other)
    with pytest.raises(BrokenDelta, match=r"model\.safetensors\.xor\.zst"):
        download_checkpoint(bucket, m[2], other)
    assert (download_checkpoint(bucket, m[1], other) / "model.safetensors").read_bytes() == published[1]
    assert sorted(p.name for p in other.iterdir()) == ["v000001"]  # nothing half-built left

    # A missing delta (v2's repaired): refused the same way, down the chain as far as it goes.
    bucket.put_bytes(key, good)
    bucket.delete(version_prefix(run, 3) + m[3].encoded[0].path)
    with pytest.raises(BrokenDelta, match="missing"):
        download_checkpoint(bucket, m[3], other)
    assert (other / "v000002" / "model.safetensors").read_bytes() == published[2]
    # The first reader's complete copy of v3 is still good without the bucket.
    assert download_checkpoint(bucket, m[3], fresh) == folder
    shutil.rmtree(fresh)
