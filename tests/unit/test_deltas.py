"""The delta codec (XOR + zstd) and the manifest's rules for encoded files: local files only."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from pydantic import ValidationError

from shared import deltas
from shared.schemas import CheckpointFile, CheckpointManifest, EncodedFile

SHA = "0" * 64


def _weights(rng: random.Random, n: int) -> bytes:
    return bytes(rng.getrandbits(8) for _ in range(n))


def _step(old: bytes, rng: random.Random, changed: float) -> bytes:
    """`old` with the low byte of a share of its 4-byte numbers changed (a small update)."""
    out = bytearray(old)
    for i in range(0, len(out) - 3, 4):
        if rng.random() < changed:
            out[i] ^= rng.getrandbits(8) | 1
    return bytes(out)


@pytest.mark.parametrize("old_size,new_size", [(40_000, 40_000), (40_000, 41_003), (41_003, 40_000), (0, 5000)])
def test_decode_rebuilds_the_new_file_bit_for_bit(tmp_path: Path, old_size: int, new_size: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deltas, "CHUNK", 4096)  # several blocks, one ragged
    rng = random.Random(old_size + new_size)
    old = _weights(rng, old_size)
    new = _step(old[:new_size] + _weights(rng, max(0, new_size - old_size)), rng, 0.3)
    (tmp_path / "old").write_bytes(old)
    (tmp_path / "new").write_bytes(new)
    size = deltas.encode(tmp_path / "new", tmp_path / "old", tmp_path / "d")
    assert size == (tmp_path / "d").stat().st_size
    deltas.decode(tmp_path / "d", tmp_path / "old", tmp_path / "out", len(new))
    assert (tmp_path / "out").read_bytes() == new


def test_a_small_update_compresses(tmp_path: Path) -> None:
    rng = random.Random(1)
    old = _weights(rng, 200_000)
    (tmp_path / "old").write_bytes(old)
    (tmp_path / "new").write_bytes(_step(old, rng, 0.05))
    assert deltas.encode(tmp_path / "new", tmp_path / "old", tmp_path / "d") < 200_000 * 0.1


def test_a_corrupt_or_short_delta_is_an_error_never_a_file(tmp_path: Path) -> None:
    rng = random.Random(2)
    old = _weights(rng, 50_000)
    (tmp_path / "old").write_bytes(old)
    (tmp_path / "new").write_bytes(_step(old, rng, 0.5))
    deltas.encode(tmp_path / "new", tmp_path / "old", tmp_path / "d")
    data = (tmp_path / "d").read_bytes()
    (tmp_path / "garbage").write_bytes(os.urandom(len(data)))
    (tmp_path / "short").write_bytes(data[: len(data) // 2])
    for bad in ("garbage", "short"):
        with pytest.raises(deltas.DeltaError):
            deltas.decode(tmp_path / bad, tmp_path / "old", tmp_path / "out", 50_000)
    with pytest.raises(deltas.DeltaError, match="manifest says"):  # the size the manifest gives
        deltas.decode(tmp_path / "d", tmp_path / "old", tmp_path / "out", 49_999)
    with pytest.raises(deltas.DeltaError, match="manifest says"):
        deltas.decode(tmp_path / "d", tmp_path / "old", tmp_path / "out", 50_001)


def _manifest(**kw: object) -> CheckpointManifest:
    files = [CheckpointFile(path="model.safetensors", size=10, sha256=SHA),
             CheckpointFile(path="config.json", size=2, sha256=SHA)]
    return CheckpointManifest.model_validate({"run": "r", "version": 5, "files": files, **kw})


def _encoded(**kw: object) -> EncodedFile:
    base = {"path": "model.safetensors.xor.zst", "size": 3, "sha256": "1" * 64, "of": "model.safetensors",
            "base_version": 4, "base_sha256": "2" * 64}
    return EncodedFile.model_validate({**base, **kw})


def test_stored_objects_replace_each_encoded_file_by_its_delta() -> None:
    m = _manifest(encoded=[_encoded()], snapshot=3)
    assert [(f.path, f.size) for f in m.stored()] == [("model.safetensors.xor.zst", 3), ("config.json", 2)]
    assert [f.path for f in m.files] == ["model.safetensors", "config.json"]
    assert _manifest().stored() == _manifest().files


@pytest.mark.parametrize("kw,why", [
    ({"encoded": [_encoded(of="other.safetensors")], "snapshot": 3}, "does not list"),
    ({"encoded": [_encoded(path="config.json")], "snapshot": 3}, "the name of a file"),
    ({"encoded": [_encoded(base_version=5)], "snapshot": 3}, "earlier version"),
    ({"encoded": [_encoded()]}, "snapshot"),
    ({"encoded": [_encoded(), _encoded(path="x.xor.zst")], "snapshot": 3}, "encoded twice"),
    ({"format": "adapter"}, "adapter"),
    ({"adapter": {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]}}, "adapter"),
])
def test_an_inconsistent_manifest_is_refused(kw: dict[str, object], why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        _manifest(**kw)
