"""Resume degrades, never kills: a corrupt LATEST, a damaged version or its record is
refused for the newest version that verifies (down to the base model), reported, and
never numbered over. Real S3 (SeaweedFS), tiny models trained and committed for real."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.trainer.build import build_trainer
from services.trainer.model import write_tokenizer
from services.trainer.resume import Refusal, ResumePoint, find_resume_point
from services.trainer.step import Trainer
from services.trainer.trainer_state import STATE_META, state_key
from shared.checkpoints import (
    latest_key,
    list_versions,
    manifest_key,
    read_latest,
    set_latest,
    version_prefix,
)
from shared.errors import ChecksumMismatch, CorruptCheckpoint, StoreError
from shared.settings import Settings
from shared.store import Bucket, FileDigest
from tests.integration.test_trainer_checkpoint import config, train_and_commit

pytestmark = pytest.mark.integration

SHARD = "model.safetensors"


def fresh_trainer(tiny_model: Path) -> Trainer:
    return build_trainer(config(tiny_model, kl_beta=0.0), ResumePoint(version=0, step=0, next_version=1, consumed=[]))


def commit_versions(bucket: Bucket, run: str, tiny_model: Path, tmp: Path, versions: list[int]) -> None:
    trainer = fresh_trainer(tiny_model)
    static = write_tokenizer(tiny_model, tmp / "static")
    for v in versions:
        train_and_commit(bucket, run, trainer, tmp, static, tiny_model, version=v, step=v, keep=10)


def flip_a_byte(bucket: Bucket, key: str) -> None:
    """Same size, different bytes: only the sha256 can tell."""
    data = bytearray(bucket.get_bytes(key))
    data[len(data) // 2] ^= 0xFF
    bucket.put_bytes(key, bytes(data))


def reasons(point: ResumePoint) -> list[tuple[int | None, str]]:
    return [(r.version, r.reason) for r in point.refused]


def test_corrupt_latest_resumes_the_newest_good_version_and_the_next_commit_repairs_it(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    run = s3_settings.run
    commit_versions(bucket, run, tiny_model, tmp_path, [1, 2])
    bucket.put_bytes(version_prefix(run, 5) + SHARD, b"half-uploaded")  # a crashed publish
    bucket.put_bytes(latest_key(run), b"\x00not a pointer")

    resume = find_resume_point(bucket, run, tmp_path / "resume")
    assert (resume.version, resume.step, resume.consumed) == (2, 2, ["b1", "b2"])
    assert resume.model_dir is not None and resume.tensors is not None
    assert reasons(resume) == [(None, "latest")] and "LATEST" in resume.refused[0].detail
    assert resume.next_version == 6  # above the half-uploaded v5 too

    trainer = build_trainer(config(tiny_model, kl_beta=0.0), resume)
    train_and_commit(bucket, run, trainer, tmp_path, write_tokenizer(tiny_model, tmp_path / "st"),
                     tiny_model, version=resume.next_version, step=resume.step + 1)
    latest = read_latest(bucket, run)
    assert latest is not None and latest.version == 6 and latest.manifest == manifest_key(run, 6)
    again = find_resume_point(bucket, run, tmp_path / "again")
    assert (again.version, again.step, again.refused, again.next_version) == (6, 3, [], 7)


@pytest.mark.parametrize("damage", ["shard", "missing-shard", "manifest", "state"])
def test_a_damaged_latest_version_falls_back_to_the_previous_one(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path, damage: str
) -> None:
    run = s3_settings.run
    commit_versions(bucket, run, tiny_model, tmp_path, [1, 2])
    if damage == "shard":
        flip_a_byte(bucket, version_prefix(run, 2) + SHARD)
    elif damage == "missing-shard":
        bucket.delete(version_prefix(run, 2) + SHARD)
    elif damage == "manifest":
        bucket.put_bytes(manifest_key(run, 2), b'{"truncated": ')
    else:  # the version's record (a damaged resume state only costs the optimizer: test_trainer_resume_state.py)
        bucket.put_bytes(state_key(run, 2, STATE_META), b"not a record")

    resume = find_resume_point(bucket, run, tmp_path / "resume")
    assert (resume.version, resume.step, resume.consumed, resume.next_version) == (1, 1, ["b1"], 3)
    assert resume.manifest is not None and resume.manifest.version == 1
    expected = {"shard": "checksum", "missing-shard": "checksum", "manifest": "manifest", "state": "state"}
    assert reasons(resume) == [(2, expected[damage])]
    assert not (tmp_path / "resume" / "v000002").exists()  # nothing of the refused one installed
    build_trainer(config(tiny_model, kl_beta=0.0), resume)  # and it loads


def test_nothing_verifies_start_from_the_base_model_numbered_above_everything(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    run = s3_settings.run
    commit_versions(bucket, run, tiny_model, tmp_path, [1, 2])
    flip_a_byte(bucket, version_prefix(run, 2) + SHARD)
    bucket.put_bytes(state_key(run, 1, STATE_META), b"garbage")
    bucket.put_bytes(version_prefix(run, 4) + SHARD, b"half-uploaded")

    resume = find_resume_point(bucket, run, tmp_path / "resume")
    assert (resume.version, resume.step, resume.consumed) == (0, 0, [])
    assert resume.model_dir is None and resume.tensors is None and resume.manifest is None
    assert reasons(resume) == [(2, "checksum"), (1, "state")]
    assert resume.next_version == 5


def test_a_rollback_is_never_resumed_past_even_when_its_version_is_refused(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    run = s3_settings.run
    commit_versions(bucket, run, tiny_model, tmp_path, [1, 2, 3])
    set_latest(bucket, run, 2)  # the operator's rollback
    flip_a_byte(bucket, version_prefix(run, 2) + SHARD)

    resume = find_resume_point(bucket, run, tmp_path / "resume")
    assert (resume.version, resume.next_version) == (1, 4)  # not v3, though it verifies
    assert reasons(resume) == [(2, "checksum")]
    assert read_latest(bucket, run).version == 2  # type: ignore[union-attr]


def test_an_interrupted_commit_that_does_not_verify_is_not_finished(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path
) -> None:
    run = s3_settings.run
    commit_versions(bucket, run, tiny_model, tmp_path, [1])
    pointer_v1 = bucket.get_bytes(latest_key(run))
    commit_versions(bucket, run, tiny_model, tmp_path / "2", [2])
    bucket.put_bytes(latest_key(run), pointer_v1)  # crashed between v2's manifest and LATEST
    flip_a_byte(bucket, version_prefix(run, 2) + SHARD)

    resume = find_resume_point(bucket, run, tmp_path / "resume")
    assert (resume.version, resume.next_version) == (1, 3)
    assert resume.refused == [Refusal(2, "checksum", resume.refused[0].detail)]
    assert read_latest(bucket, run).version == 1  # type: ignore[union-attr]
    assert list_versions(bucket, run) == [1, 2]


def test_a_bucket_that_does_not_answer_is_no_verdict_on_a_version(
    bucket: Bucket, s3_settings: Settings, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = s3_settings.run
    commit_versions(bucket, run, tiny_model, tmp_path, [1, 2])

    def reset(key: str, path: str | Path) -> FileDigest:
        raise StoreError(f"GET {key}: connection reset by peer")

    monkeypatch.setattr(bucket, "get_file", reset)
    with pytest.raises(StoreError, match="connection reset") as err:
        find_resume_point(bucket, run, tmp_path / "resume")
    assert not isinstance(err.value, ChecksumMismatch | CorruptCheckpoint)  # v2 was not refused
