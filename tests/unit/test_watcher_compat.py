"""services/watcher/compat.py: what the watcher checks before any engine is asked to load a
folder — every listed file at its size and sha256, nothing unlisted among the weights,
config and tensors that fit the served model (a truncated or reshaped checkpoint is
refused), and a full version in the dtype served (an adapter in any)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from services.watcher.compat import sha256_of, tensor_shapes, verify_folder
from shared import checkpoints as ckpt
from shared.dtypes import safetensors_header
from shared.errors import ChecksumMismatch, IncompatibleCheckpoint
from shared.schemas import AdapterSpec, CheckpointFile, CheckpointManifest
from tests.support.tiny_model import build_tiny_model


def as_version(src: Path, dest: Path, adapter: AdapterSpec | None = None) -> Path:
    """`src` copied to `dest` with a manifest of its files, as the watcher installs versions."""
    shutil.copytree(src, dest)
    files = [CheckpointFile(path=p.name, size=p.stat().st_size, sha256=sha256_of(p))
             for p in sorted(dest.iterdir()) if p.is_file() and p.name != ckpt.MANIFEST]
    manifest = CheckpointManifest(run="r", version=3, files=files, format="adapter" if adapter else "full",
                                  adapter=adapter)
    (dest / ckpt.MANIFEST).write_text(manifest.model_dump_json())
    return dest


def in_dtype(src: Path, dest: Path, dtype: str) -> Path:
    """A copy of the model folder `src` with its weights and config.json in `dtype`, as
    save_hf_folder writes a version published in it."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    tensors = {k: v.to(getattr(torch, dtype)) for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "dtype": dtype}))
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


def test_a_full_version_in_another_dtype_than_served_is_incompatible(models: dict[str, Path], tmp_path: Path) -> None:
    """v0 is served in the folder's dtype (float32 here); a bf16 version would switch the
    served precision with no training in it: refused with what to set."""
    bf16 = in_dtype(models["trained"], tmp_path / "bf16", "bfloat16")
    folder = as_version(bf16, tmp_path / "v3")
    with pytest.raises(IncompatibleCheckpoint, match=r"v3's weights are bfloat16, the engine serves float32 "
                       r"\(v0, .*served\).*NEXTSTATE_TRAINER__PUBLISH_DTYPE=auto.*SERVED_DTYPE=bfloat16"):
        verify_folder(folder, models["served"])
    verify_folder(folder, None)  # nothing to compare with: the files only
    # An engine that casts what it loads (--dtype bfloat16), said to the watcher: it serves bf16,
    # and then a float32 version is the one refused.
    verify_folder(folder, models["served"], served_dtype="bfloat16")
    with pytest.raises(IncompatibleCheckpoint, match="weights are float32, the engine serves bfloat16"):
        verify_folder(as_version(models["trained"], tmp_path / "v4"), models["served"], served_dtype="bfloat16")
    # A bf16 base folder (SGLang's v0) takes bf16 versions.
    assert verify_folder(folder, in_dtype(models["served"], tmp_path / "served-bf16", "bfloat16")).version == 3


def test_an_adapter_is_exempt_from_the_dtype(models: dict[str, Path], tmp_path: Path) -> None:
    """The engine applies an adapter in the dtype of the weights it holds: a bf16 adapter on
    a float32 base is served as a float32 one would be."""
    import torch
    from safetensors.torch import save_file

    rank, out_f, in_f = 4, *tensor_shapes(models["served"])["model.layers.0.self_attn.q_proj.weight"]
    src = tmp_path / "adapter"
    src.mkdir()
    (src / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 8, "peft_type": "LORA"}))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(rank, in_f, dtype=torch.bfloat16),
               f"{prefix}.lora_B.weight": torch.zeros(out_f, rank, dtype=torch.bfloat16)},
              str(src / "adapter_model.safetensors"))
    spec = AdapterSpec(rank=rank, alpha=8, target_modules=["q_proj"])
    assert verify_folder(as_version(src, tmp_path / "v3", spec), models["served"]).format == "adapter"
