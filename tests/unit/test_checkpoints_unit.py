"""Checkpoint key layout and local retention: pure functions and the local filesystem only."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from shared.checkpoints import (
    latest_key,
    local_versions,
    manifest_key,
    policies_prefix,
    prune_local,
    samples_prefix,
    trainer_state_prefix,
    version_dirname,
    version_prefix,
)


def test_key_layout_matches_design() -> None:
    assert version_dirname(42) == "v000042"
    assert version_dirname(1_234_567) == "v1234567"
    assert policies_prefix("exp1") == "policies/exp1/"
    assert version_prefix("exp1", 42) == "policies/exp1/v000042/"
    assert manifest_key("exp1", 42) == "policies/exp1/v000042/manifest.json"
    assert latest_key("exp1") == "policies/exp1/LATEST"
    assert trainer_state_prefix("exp1") == "trainer-state/exp1/"
    assert samples_prefix("exp1") == "samples/exp1/"


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".hidden", "x" * 65, "a b"])
def test_bad_run_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid run name"):
        version_prefix(bad, 1)


def test_negative_version_is_refused() -> None:
    with pytest.raises(ValueError):
        manifest_key("r", -1)


def _version(root: Path, v: int) -> None:
    (root / version_dirname(v)).mkdir(parents=True)
    (root / version_dirname(v) / "model.safetensors").write_bytes(b"w")


def test_prune_local_keeps_newest_and_protected(tmp_path: Path) -> None:
    for v in (1, 2, 3, 10, 11):
        _version(tmp_path, v)
    (tmp_path / "notes.txt").write_text("not a version")
    (tmp_path / "vlatest").mkdir()
    assert local_versions(tmp_path) == [1, 2, 3, 10, 11]

    assert prune_local(tmp_path, keep=2, protect=[2]) == [1, 3]
    assert local_versions(tmp_path) == [2, 10, 11]
    assert (tmp_path / "notes.txt").exists() and (tmp_path / "vlatest").exists()
    assert prune_local(tmp_path, keep=0, protect=[11]) == [2, 10]
    assert local_versions(tmp_path) == [11]
    assert local_versions(tmp_path / "absent") == [] and prune_local(tmp_path / "absent", 1) == []


def test_prune_local_removes_only_stale_staging(tmp_path: Path) -> None:
    old = tmp_path / ".staging-v000005-deadbeef"
    fresh = tmp_path / ".staging-v000006-cafef00d"
    for d in (old, fresh):
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "part").write_bytes(b"x")
    hour_ago = time.time() - 3700
    os.utime(old, (hour_ago, hour_ago))

    assert prune_local(tmp_path, keep=1) == []
    assert not old.exists() and fresh.exists()  # a download may still be writing `fresh`
