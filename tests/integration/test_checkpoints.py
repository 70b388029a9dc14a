"""The checkpoint protocol against a real S3 server: publish → LATEST → verified download,
tampering refused without leftovers, failed publishes, rollback, retention."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shared.checkpoints import (
    all_versions,
    download_checkpoint,
    latest_key,
    list_versions,
    manifest_key,
    prune_bucket,
    publish_checkpoint,
    read_latest,
    read_manifest,
    set_latest,
    version_prefix,
)
from shared.errors import ChecksumMismatch, CorruptCheckpoint, NoCheckpoint, StoreError
from shared.gate_view import GateView, field_name, gate_view
from shared.schemas import CheckpointFile, LatestPointer
from shared.settings import Settings
from shared.store import Bucket, MiB

pytestmark = pytest.mark.integration


@pytest.fixture
def bucket(s3_settings: Settings) -> Iterator[Bucket]:
    with Bucket(s3_settings.bucket, part_size=5 * MiB) as b:
        yield b


@pytest.fixture
def run(s3_settings: Settings) -> str:
    return s3_settings.run  # unique per test


def make_checkpoint(root: Path, seed: int, shard_bytes: int = 64 * 1024) -> Path:
    """A small HF-like folder: two shards, config, a tokenizer in a subfolder."""
    root.mkdir(parents=True)
    rnd = hashlib.sha256(str(seed).encode()).digest()
    (root / "model-00001-of-00002.safetensors").write_bytes(rnd * (shard_bytes // 32))
    (root / "model-00002-of-00002.safetensors").write_bytes(os.urandom(shard_bytes + seed))
    (root / "config.json").write_text(f'{{"seed": {seed}}}')
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer.json").write_text('{"vocab": {}}')
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_publish_latest_download(bucket: Bucket, run: str, tmp_path: Path) -> None:
    assert read_latest(bucket, run) is None
    assert list_versions(bucket, run) == []
    src = make_checkpoint(tmp_path / "src", seed=1, shard_bytes=6 * MiB)  # one multipart shard

    m = publish_checkpoint(bucket, run, 42, src, step=420, base_model="tiny",
                           consumed_batch_ids=["b1", "b2"], metrics={"loss": 0.5})
    assert (m.run, m.version, m.step, m.base_model) == (run, 42, 420, "tiny")
    assert (m.consumed_batch_ids, m.metrics) == (["b1", "b2"], {"loss": 0.5})
    src_files = tree(src)
    assert {f.path: (f.size, f.sha256) for f in m.files} == {
        p: (len(b), hashlib.sha256(b).hexdigest()) for p, b in src_files.items()}

    latest = read_latest(bucket, run)
    assert latest is not None and latest.version == 42
    assert latest.manifest == manifest_key(run, 42) == f"policies/{run}/v000042/manifest.json"
    assert read_manifest(bucket, latest.manifest) == m
    assert list_versions(bucket, run) == [42]

    dest_root = tmp_path / "local"
    got = download_checkpoint(bucket, m, dest_root)
    assert got == dest_root / "v000042"
    local = tree(got)
    assert local.pop("manifest.json")  # the manifest travels with the folder
    assert local == src_files
    assert sorted(p.name for p in dest_root.iterdir()) == ["v000042"]  # no staging left

    # Already present and complete: returned without touching the bucket.
    bucket.delete_prefix(version_prefix(run, 42))
    assert download_checkpoint(bucket, m, dest_root) == got
    assert tree(got) == {**src_files, "manifest.json": (got / "manifest.json").read_bytes()}


def test_incomplete_local_copy_is_replaced(bucket: Bucket, run: str, tmp_path: Path) -> None:
    src = make_checkpoint(tmp_path / "src", seed=2)
    m = publish_checkpoint(bucket, run, 1, src)
    got = download_checkpoint(bucket, m, tmp_path / "local")
    (got / "config.json").write_text("truncated")
    assert download_checkpoint(bucket, m, tmp_path / "local") == got
    assert (got / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["v000001"]


@pytest.mark.parametrize("damage", ["tampered-object", "wrong-hash", "wrong-size", "missing-object"])
def test_bad_download_is_refused_and_leaves_nothing(
    bucket: Bucket, run: str, tmp_path: Path, damage: str
) -> None:
    src = make_checkpoint(tmp_path / "src", seed=3)
    m = publish_checkpoint(bucket, run, 5, src)
    shard = "model-00002-of-00002.safetensors"
    key = version_prefix(run, 5) + shard
    if damage == "tampered-object":  # same size, different bytes, after publishing
        data = bytearray(bucket.get_bytes(key))
        data[100] ^= 0xFF
        bucket.put_bytes(key, bytes(data))
    elif damage == "missing-object":
        bucket.delete(key)
    else:
        files = [
            f if f.path != shard else CheckpointFile(
                path=f.path,
                size=f.size + (1 if damage == "wrong-size" else 0),
                sha256=("0" * 64 if damage == "wrong-hash" else f.sha256))
            for f in m.files
        ]
        m = m.model_copy(update={"files": files})
        bucket.put_json(manifest_key(run, 5), m)
        m = read_manifest(bucket, manifest_key(run, 5))

    dest_root = tmp_path / "local"
    with pytest.raises(ChecksumMismatch, match=shard):
        download_checkpoint(bucket, m, dest_root, parallel=2)
    assert list(dest_root.iterdir()) == []  # no version folder, no staging


def test_unsafe_manifest_paths_are_refused(bucket: Bucket, run: str, tmp_path: Path) -> None:
    m = publish_checkpoint(bucket, run, 1, make_checkpoint(tmp_path / "src", seed=4))
    for bad in ("../escape.bin", "/abs.bin", "a/./b", "manifest.json"):
        evil = m.model_copy(update={"files": [*m.files, CheckpointFile(
            path=bad, size=1, sha256="0" * 64)]})
        with pytest.raises(StoreError, match="unsafe path"):
            download_checkpoint(bucket, evil, tmp_path / "local")
    assert not (tmp_path / "escape.bin").exists()


def test_failed_publish_leaves_latest_alone(bucket: Bucket, run: str, tmp_path: Path) -> None:
    publish_checkpoint(bucket, run, 1, make_checkpoint(tmp_path / "v1", seed=5))
    src = make_checkpoint(tmp_path / "v2", seed=6)
    # The server refuses this one object (S3 keys are at most 1024 bytes); the others upload.
    deep = src / "tokenizer" / "/".join(["d" * 200] * 5)
    deep.mkdir(parents=True)
    (deep / "vocab.txt").write_text("x")

    with pytest.raises(StoreError, match=r"uploading 'tokenizer/d+/.*vocab.txt' failed") as err:
        publish_checkpoint(bucket, run, 2, src, parallel=2)
    assert "LATEST not moved" in str(err.value)
    latest = read_latest(bucket, run)
    assert latest is not None and latest.version == 1
    assert list_versions(bucket, run) == [1]  # v2 has no manifest
    assert bucket.exists(version_prefix(run, 2) + "config.json")  # it did fail midway
    assert not bucket.exists(manifest_key(run, 2))


def test_latest_only_moves_forward_on_publish(bucket: Bucket, run: str, tmp_path: Path) -> None:
    publish_checkpoint(bucket, run, 3, make_checkpoint(tmp_path / "a", seed=7))
    late = publish_checkpoint(bucket, run, 2, make_checkpoint(tmp_path / "b", seed=8))
    latest = read_latest(bucket, run)
    assert latest is not None and latest.version == 3
    assert read_manifest(bucket, manifest_key(run, 2)) == late  # committed, just not LATEST
    assert list_versions(bucket, run) == [2, 3]


def test_set_latest_rollback_and_refusal(bucket: Bucket, run: str, tmp_path: Path) -> None:
    for v in (1, 2):
        publish_checkpoint(bucket, run, v, make_checkpoint(tmp_path / f"v{v}", seed=v))
    with pytest.raises(NoCheckpoint, match="v000007"):
        set_latest(bucket, run, 7)
    latest = read_latest(bucket, run)
    assert latest is not None and latest.version == 2

    ptr = set_latest(bucket, run, 1)
    assert read_latest(bucket, run) == ptr and ptr.version == 1
    assert ptr.manifest == manifest_key(run, 1)

    bucket.put_bytes(latest_key(run), b'{"version": "nope"}')
    with pytest.raises(CorruptCheckpoint, match="LATEST"):
        read_latest(bucket, run)


class Rollback(Exception):
    pass


def test_publish_records_the_parent_and_a_guard_can_stop_it_before_latest(
    bucket: Bucket, run: str, tmp_path: Path
) -> None:
    m1 = publish_checkpoint(bucket, run, 1, make_checkpoint(tmp_path / "v1", seed=1), parent=0)
    assert m1.parent == 0 and read_manifest(bucket, manifest_key(run, 1)).parent == 0
    seen: list[int | None] = []

    def refuse_at(call: int) -> Callable[[LatestPointer | None], None]:
        def guard(latest: LatestPointer | None) -> None:
            seen.append(latest.version if latest else None)
            if len(seen) == call:
                raise Rollback("a rollback came")
        return guard

    # Stopped at the first look (files up, before the manifest): a half-uploaded version.
    with pytest.raises(Rollback):
        publish_checkpoint(bucket, run, 2, make_checkpoint(tmp_path / "v2", seed=2), parent=1, guard=refuse_at(1))
    assert seen == [1] and list_versions(bucket, run) == [1] and all_versions(bucket, run) == [1, 2]
    # Stopped at the second look (after the manifest): the manifest is taken back.
    seen.clear()
    with pytest.raises(Rollback):
        publish_checkpoint(bucket, run, 3, make_checkpoint(tmp_path / "v3", seed=3), parent=1, guard=refuse_at(2))
    assert seen == [1, 1] and list_versions(bucket, run) == [1] and not bucket.exists(manifest_key(run, 3))
    assert read_latest(bucket, run).version == 1  # type: ignore[union-attr]
    # A guard that lets it go: committed, LATEST moves.
    seen.clear()
    m4 = publish_checkpoint(bucket, run, 4, make_checkpoint(tmp_path / "v4", seed=4), parent=1, guard=refuse_at(3))
    assert seen == [1, 1] and m4.parent == 1 and read_latest(bucket, run).version == 4  # type: ignore[union-attr]


def test_publish_replaces_an_unreadable_latest(bucket: Bucket, run: str, tmp_path: Path) -> None:
    publish_checkpoint(bucket, run, 1, make_checkpoint(tmp_path / "v1", seed=1))
    bucket.put_bytes(version_prefix(run, 3) + "config.json", b"{}")  # a half-uploaded version
    assert (list_versions(bucket, run), all_versions(bucket, run)) == ([1], [1, 3])
    bucket.put_bytes(latest_key(run), b"\xff\xfe garbage")

    m = publish_checkpoint(bucket, run, 4, make_checkpoint(tmp_path / "v4", seed=4))
    latest = read_latest(bucket, run)
    assert latest is not None and (latest.version, latest.manifest) == (4, manifest_key(run, 4))
    assert read_manifest(bucket, latest.manifest) == m
    # A valid LATEST at a newer version still wins.
    publish_checkpoint(bucket, run, 2, make_checkpoint(tmp_path / "v2", seed=2))
    assert read_latest(bucket, run).version == 4  # type: ignore[union-attr]


def test_prune_bucket_keeps_what_the_gate_needs(bucket: Bucket, run: str, tmp_path: Path) -> None:
    """With a gate, retention keeps what it serves (and the promoted version before) and
    what it has yet to decide on while it would wait — found by a real SmolLM2 run, where
    evaluation lagged training and every promoted version was already deleted."""
    for v in range(1, 9):
        publish_checkpoint(bucket, run, v, make_checkpoint(tmp_path / f"v{v}", seed=v, shard_bytes=64))
    raw = {"config": '{"wait_s": 600}', "serving": "2",
           **{field_name(v): json.dumps({"version": v, "decision": d})
              for v, d in [(1, "promoted"), (2, "promoted"), (3, "refused"), (4, "refused")]}}
    gate = gate_view(raw)
    assert gate == GateView(600.0, frozenset({1, 2, 3, 4}), frozenset({1, 2}), current=2)
    # keep=2 alone would leave 7 and 8; the gate adds 1 and 2 (serving, promoted before)
    # and 5, 6 (undecided, within the wait).
    assert prune_bucket(bucket, run, keep=2, gate=gate) == [3, 4]
    assert list_versions(bucket, run) == [1, 2, 5, 6, 7, 8]
    # Past the gate's wait, an undecided version is the gate's to refuse: no longer kept.
    assert prune_bucket(bucket, run, keep=2, gate=GateView(-120.0, gate.decided, gate.serving)) == [5, 6]
    assert gate_view({"serving": "2"}) is None  # no rule recorded: no gate runs


def test_prune_bucket_keeps_newest_and_latest(bucket: Bucket, run: str, tmp_path: Path) -> None:
    for v in range(1, 6):
        publish_checkpoint(bucket, run, v, make_checkpoint(tmp_path / f"v{v}", seed=v, shard_bytes=64))
    set_latest(bucket, run, 2)
    # A half-uploaded version (no manifest), e.g. from a crashed publish.
    bucket.put_bytes(version_prefix(run, 6) + "model.safetensors", b"partial")

    assert prune_bucket(bucket, run, keep=2) == [1, 3]  # v6 is within its grace period
    assert list_versions(bucket, run) == [2, 4, 5]
    assert bucket.list(version_prefix(run, 1)) == [] and bucket.list(version_prefix(run, 3)) == []
    assert bucket.exists(version_prefix(run, 6) + "model.safetensors")

    assert prune_bucket(bucket, run, keep=2, partial_grace_s=0) == [6]
    assert bucket.list(version_prefix(run, 6)) == []
    assert prune_bucket(bucket, run, keep=1) == [4]  # 5 newest, 2 is LATEST
    latest = read_latest(bucket, run)
    assert latest is not None and latest.version == 2
    m = read_manifest(bucket, latest.manifest)
    assert download_checkpoint(bucket, m, tmp_path / "local").name == "v000002"
