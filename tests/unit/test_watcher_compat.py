"""services/watcher/compat.py: what the watcher checks before any engine is asked to load a
folder — every listed file at its size and sha256, nothing unlisted among the weights, and
config and tensors that fit the served model (a truncated or reshaped checkpoint is refused)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from services.watcher.compat import safetensors_header, sha256_of, verify_folder
from shared import checkpoints as ckpt
from shared.errors import ChecksumMismatch, IncompatibleCheckpoint
from shared.schemas import CheckpointFile, CheckpointManifest
from tests.support.tiny_model import build_tiny_model


def as_version(src: Path, dest: Path) -> Path:
    """`src` copied to `dest` with a manifest of its files, as the watcher installs versions."""
    shutil.copytree(src, dest)
    files = [CheckpointFile(path=p.name, size=p.stat().st_size, sha256=sha256_of(p))
             for p in sorted(dest.iterdir()) if p.is_file() and p.name != ckpt.MANIFEST]
    (dest / ckpt.MANIFEST).write_text(CheckpointManifest(run="r", version=3, files=files).model_dump_json())
    return dest


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compat")
    return {"served": build_tiny_model(root / "served", seed=0),
            "trained": build_tiny_model(root / "trained", seed=1),  # same shapes, other weights
            "wider": build_tiny_model(root / "wider", seed=1, hidden=96)}


def test_a_version_that_fits_passes(models: dict[str, Path], tmp_path: Path) -> None:
    folder = as_version(models["trained"], tmp_path / "v3")
    assert verify_folder(folder, models["served"]).version == 3
    assert verify_folder(folder, None).version == 3  # no reference: the files only


def test_a_changed_byte_of_the_same_size_is_caught(models: dict[str, Path], tmp_path: Path) -> None:
    folder = as_version(models["trained"], tmp_path / "v3")
    shard = folder / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # a reused local copy is only compared by size: the sha256 is read again
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match="sha256"):
        verify_folder(folder, models["served"])


def test_missing_and_unlisted_weights_are_caught(models: dict[str, Path], tmp_path: Path) -> None:
    folder = as_version(models["trained"], tmp_path / "v3")
    shutil.copy(folder / "model.safetensors", folder / "model-extra.safetensors")
    with pytest.raises(ChecksumMismatch, match="does not list"):
        verify_folder(folder, models["served"])
    (folder / "model-extra.safetensors").unlink()
    (folder / "config.json").unlink()
    with pytest.raises(ChecksumMismatch, match="missing"):
        verify_folder(folder, models["served"])


def test_other_shapes_are_incompatible(models: dict[str, Path], tmp_path: Path) -> None:
    folder = as_version(models["wider"], tmp_path / "v3")
    with pytest.raises(IncompatibleCheckpoint, match="hidden_size"):
        verify_folder(folder, models["served"])
    # the same shapes declared in config.json, but the tensors are still the wider ones
    config = json.loads((models["served"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    folder = as_version(folder, tmp_path / "v4")  # a manifest that agrees with the files
    with pytest.raises(IncompatibleCheckpoint, match="other shapes"):
        verify_folder(folder, models["served"])


def test_a_truncated_shard_with_a_matching_manifest_is_incompatible(models: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "cut"
    shutil.copytree(models["trained"], src)
    shard = src / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])  # published that way: sizes and sha256 agree
    folder = as_version(src, tmp_path / "v3")
    with pytest.raises(IncompatibleCheckpoint, match="end at byte"):
        verify_folder(folder, models["served"])


def test_header_parsing_refuses_nonsense(tmp_path: Path) -> None:
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(IncompatibleCheckpoint, match="header"):
        safetensors_header(bad)
    bad.write_bytes(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(IncompatibleCheckpoint, match="not JSON"):
        safetensors_header(bad)


def test_a_tied_output_head_may_be_saved_or_not(models: dict[str, Path], tmp_path: Path) -> None:
    """save_pretrained of a trained copy (the trainer's save_hf_folder) writes lm_head.weight
    for a tied model; the base has none. The engine ties it: not a reason to refuse."""
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "with-head"
    shutil.copytree(models["trained"], src)
    tensors = load_file(str(src / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    verify_folder(as_version(src, tmp_path / "v3"), models["served"])
    tensors["lm_head.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(IncompatibleCheckpoint, match="lm_head"):
        verify_folder(as_version(src, tmp_path / "v4"), models["served"])
