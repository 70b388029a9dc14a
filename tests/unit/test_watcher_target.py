"""The watcher's decisions without processes: which version to serve, what to report.

The passes themselves (engine, bucket, Redis) are exercised in tests/integration/test_watcher.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from services.watcher.report import WatcherState
from services.watcher.target import (
    Latest,
    Refusals,
    fallbacks,
    first_choices,
    label,
    policy_version,
)
from services.watcher.watcher import install
from shared.checkpoints import manifest_key
from shared.schemas import CheckpointFile, CheckpointManifest, LatestPointer


def test_policy_version_is_a_trained_version_only() -> None:
    assert policy_version("7") == 7
    assert policy_version("0") is None  # the engine's base weights
    assert policy_version("base") is None
    assert policy_version("") is None
    assert policy_version(None) is None  # unreachable
    assert policy_version("٣") is None  # a digit, but not a version we publish
    assert [label(v) for v in ("5", "0", "base", None)] == ["v5", "v0", "'base'", "nothing (unreachable)"]


@pytest.mark.parametrize(("latest", "good", "refused", "expected"), [
    (5, 4, set(), [5, 4]),        # a new LATEST, the last good one behind it
    (5, 5, set(), [5]),           # in sync (or reconciling the same version)
    (2, 5, set(), [2, 5]),        # a rollback is followed
    (5, 4, {5}, [4]),             # LATEST refused lately: keep the last good version
    (None, 4, set(), [4]),        # LATEST unreadable (or gone): keep the last good version
    (5, None, {5}, []),           # fresh watcher, LATEST refused: the listing decides
    (None, None, set(), []),      # fresh watcher, LATEST unreadable: the listing decides
    (5, 4, {5, 4}, []),           # both refused lately
])
def test_first_choices(latest: int | None, good: int | None, refused: set[int], expected: list[int]) -> None:
    assert first_choices(latest, good, refused) == expected


def test_fallbacks_are_below_latest_newest_first_never_the_base() -> None:
    listed = [0, 1, 2, 3, 5, 6]
    assert fallbacks(listed, below=5, skip={5}) == [3, 2, 1]
    assert fallbacks(listed, below=5, skip={3}) == [2, 1]  # 3 refused: the next older that verifies
    assert fallbacks(listed, below=None, skip=set()) == [6, 5, 3, 2, 1]  # LATEST unreadable
    assert fallbacks([], below=None, skip=set()) == []


def test_latest_published_decides_whether_to_fall_back() -> None:
    pointer = LatestPointer(version=3, manifest=manifest_key("r", 3))
    assert Latest(pointer=pointer).version == 3 and Latest(pointer=pointer).published
    assert Latest(unreadable="not JSON").published and Latest(unreadable="x").version is None
    assert not Latest().published  # nothing published yet: the base model is right


def test_refusals_expire_after_retry_bad_after_s() -> None:
    refusals = Refusals(retry_after_s=60)
    refusals.add(5, "checksum", now=100.0)
    assert refusals.recent(now=159.0) == {5}
    assert refusals.why(5, now=130.0) == "checksum; retried 60s after the refusal"
    assert refusals.recent(now=160.0) == frozenset() and refusals.why(5, now=160.0) == ""
    refusals.add(6, "engine", now=200.0)
    refusals.clear(6)
    assert refusals.recent(now=200.0) == frozenset()


def test_state_reports_the_truth_and_readiness_waits_for_one_attempt() -> None:
    state = WatcherState(engine="http://e", target=5, latest=5)
    state.observe("0")
    assert state.mismatch and state.problem() is None  # not yet tried to fix it
    state.errors = ["v5 refused (checksum): bad"]
    state.unfixed = state.mismatch  # the pass ended without fixing it
    assert state.problem() == "engine serves v0, should serve v5 (v5 refused (checksum): bad)"
    fields = state.fields()
    assert fields["engine_version"] == "0" and fields["target_version"] == "5"
    assert fields["mismatch"] == "1" and fields["latest_version"] == "5"
    assert fields["error"] == "v5 refused (checksum): bad" and float(fields["checked_at"]) > 0
    state.observe("5")
    assert not state.mismatch and state.problem() is None  # reconciled: ready again
    state.observe(None)
    assert state.fields()["engine_version"] == "" and state.mismatch
    assert WatcherState(engine="e").fields()["target_version"] == ""
    assert not WatcherState(engine="e", observed="0").mismatch  # nothing to serve yet


def test_install_uses_a_complete_local_copy_without_the_bucket(tmp_path: Path) -> None:
    folder = tmp_path / "v000003"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    manifest = CheckpointManifest(run="r", version=3, files=[CheckpointFile(
        path="model.safetensors", size=7, sha256=hashlib.sha256(b"weights").hexdigest())])
    (folder / "manifest.json").write_text(manifest.model_dump_json())
    no_bucket = object()  # any use would raise AttributeError
    assert install(no_bucket, tmp_path, "r", 3, manifest_key("r", 3)) == folder  # type: ignore[arg-type]

