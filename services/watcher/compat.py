"""The last check before the engine is asked to load a folder: complete, intact, and shaped
like the model it serves.

vLLM 0.32 does not survive a `reload_weights` that fails — its engine core dies with the
worker's exception — so the watcher sends no folder to any engine before `verify_folder`
passed (blocking: run it off the event loop):

- files: every file of the folder's manifest is there at its size and sha256, read again
  now (a local copy the watcher reuses was only compared by size), and no weight file
  (`*.safetensors`, `*.bin`) lies in the folder without being listed;
- config: `config.json` agrees with the reference model's on architecture and every field
  that shapes the weights (SHAPE_KEYS);
- tensors: each safetensors header parses, its data ends exactly at the end of its file
  (a truncated shard cannot pass), and the tensor names and shapes are the reference
  model's, no more, no fewer (a tied output head may be saved or not);
- base model: the version was trained from the served model (the manifest's
  `base_fingerprint` against the reference folder's, shared/runs.py);
- dtype: a full version's weights are in the dtype served (shared/dtypes.py: the
  reference folder's, which the engine serves as v0, or NEXTSTATE_WATCHER__SERVED_DTYPE),
  so that no version switches the served precision without any training in it;
- an adapter version instead: its config is the manifest's rank and alpha, and every A and
  B matrix belongs to a linear layer of the served model, at (r, in) and (out, r) (in any
  dtype: the engine applies it in the dtype of the weights it holds).

The reference is the model the engine serves: NEXTSTATE_WATCHER__BASE_MODEL, or the folder
the engine reports in `/model_info` when the watcher can read it. Without one only the
files are checked, and the watcher says so once.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shared import checkpoints as ckpt
from shared.dtypes import folder_dtype, safetensors_header, weights_dtype
from shared.errors import ChecksumMismatch, IncompatibleCheckpoint
from shared.runs import model_fingerprint
from shared.schemas import CheckpointManifest

SHAPE_KEYS = ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
              "tie_word_embeddings")
TIED_HEAD, TIED_TO = "lm_head.weight", "model.embed_tokens.weight"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
ADAPTER_PREFIX = "base_model.model."  # PEFT's names of an adapter's tensors


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def check_files(folder: Path) -> CheckpointManifest:
    """The folder holds exactly its manifest's weights, every listed file at its size and sha256."""
    try:
        manifest = CheckpointManifest.model_validate_json((folder / ckpt.MANIFEST).read_bytes())
    except (OSError, ValidationError) as exc:
        raise ChecksumMismatch(f"{folder}: no readable {ckpt.MANIFEST} ({type(exc).__name__})") from None
    what = f"{manifest.run} v{manifest.version}"
    for f in manifest.files:
        path = folder / f.path
        if not path.is_file():
            raise ChecksumMismatch(f"{what}: {f.path!r} is missing from {folder}")
        if (size := path.stat().st_size) != f.size:
            raise ChecksumMismatch(f"{what}: {f.path!r} is {size} bytes, manifest says {f.size}")
        if (digest := sha256_of(path)) != f.sha256:
            raise ChecksumMismatch(f"{what}: {f.path!r} has sha256 {digest}, manifest says {f.sha256}")
    listed = {f.path for f in manifest.files}
    stray = sorted(p.name for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.name not in listed)
    if stray:
        raise ChecksumMismatch(f"{what}: weight files the manifest does not list: {stray[:5]}")
    return manifest


def _config(folder: Path) -> dict[str, Any]:
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise IncompatibleCheckpoint(f"{folder}: no readable config.json ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise IncompatibleCheckpoint(f"{folder}: config.json is not an object")
    return data


def tensor_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        for name, (_, shape) in safetensors_header(path).items():
            shapes[name] = shape
    return shapes


def check_fits(folder: Path, reference: Path) -> None:
    """`folder`'s config and tensors fit the model in `reference` (IncompatibleCheckpoint if not)."""
    mine, ref = _config(folder), _config(reference)
    differ = [f"{k}: {mine.get(k)!r} (served: {ref.get(k)!r})" for k in SHAPE_KEYS if mine.get(k) != ref.get(k)]
    if differ:
        raise IncompatibleCheckpoint(f"{folder.name}'s config does not fit the served model: " + "; ".join(differ))
    got, want = tensor_shapes(folder), tensor_shapes(reference)
    if mine.get("tie_word_embeddings"):
        # The output head is the input embedding: saved or not (save_pretrained of a trained
        # copy writes it, a converted base may not), the engine ties it; only its shape counts.
        for shapes in (got, want):
            head = shapes.pop(TIED_HEAD, None)
            if head is not None and head != shapes.get(TIED_TO, head):
                raise IncompatibleCheckpoint(f"{TIED_HEAD} {head} is not the shape of {TIED_TO} {shapes[TIED_TO]}")
    if not got:
        raise IncompatibleCheckpoint(f"{folder.name}: no safetensors weights")
    if not want:
        return  # a reference without safetensors (e.g. .bin): the config agreed, that is all we can say
    missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
    wrong = sorted(f"{k} {got[k]} (served: {want[k]})" for k in got.keys() & want.keys() if got[k] != want[k])
    if missing or extra or wrong:
        raise IncompatibleCheckpoint(
            f"{folder.name}'s tensors do not fit the served model: missing {missing[:3]}, "
            f"unexpected {extra[:3]}, other shapes {wrong[:3]}")


@functools.lru_cache(maxsize=8)
def fingerprint(reference: Path) -> str:
    """The identity of the served model's folder (shared/runs.py), computed once per folder."""
    return model_fingerprint(reference)


def check_base(manifest: CheckpointManifest, reference: Path) -> None:
    """The version was trained from the model the engine serves (when the manifest says
    which: `base_fingerprint`)."""
    if manifest.base_fingerprint and manifest.base_fingerprint != (served := fingerprint(reference)):
        raise IncompatibleCheckpoint(
            f"v{manifest.version} was trained from another base model ({manifest.base_model}, "
            f"{manifest.base_fingerprint[:19]}…) than the one served ({reference}, {served[:19]}…)")


def check_adapter_fits(folder: Path, reference: Path, manifest: CheckpointManifest) -> None:
    """A PEFT adapter folder fits the served model: its config is the manifest's (rank,
    alpha), and each of its A (r, in) and B (out, r) belongs to a linear weight (out, in)
    of the served model. IncompatibleCheckpoint if not."""
    assert manifest.adapter is not None
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise IncompatibleCheckpoint(f"{folder.name}: no readable {ADAPTER_CONFIG} ({type(exc).__name__})") from None
    spec = manifest.adapter
    if not isinstance(config, dict) or config.get("r") != spec.rank or config.get("lora_alpha") != spec.alpha:
        got = (config.get("r"), config.get("lora_alpha")) if isinstance(config, dict) else None
        raise IncompatibleCheckpoint(f"{folder.name}: {ADAPTER_CONFIG} has (r, alpha) {got}, the manifest "
                                     f"({spec.rank}, {spec.alpha:g})")
    path = folder / ADAPTER_WEIGHTS
    if not path.is_file():
        raise IncompatibleCheckpoint(f"{folder.name}: no {ADAPTER_WEIGHTS}")
    served = tensor_shapes(reference)
    bad = []
    for name, (_, shape) in safetensors_header(path).items():
        module, _, part = name.removeprefix(ADAPTER_PREFIX).rpartition(".lora_")
        target = served.get(f"{module}.weight")
        if not name.startswith(ADAPTER_PREFIX) or part not in ("A.weight", "B.weight") or target is None \
                or len(target) != 2:
            bad.append(f"{name} (not a LoRA matrix of a linear layer of the served model)")
            continue
        out_f, in_f = target
        want = (spec.rank, in_f) if part == "A.weight" else (out_f, spec.rank)
        if shape != want:
            bad.append(f"{name} {shape} (the served model needs {want})")
    if bad:
        raise IncompatibleCheckpoint(f"{folder.name}'s adapter does not fit the served model: {bad[:3]}")


def check_dtype(folder: Path, manifest: CheckpointManifest, served: str | None, source: str) -> None:
    """A full version's weights are in the dtype served (`served`, as `source` says; None:
    unknown, nothing to compare). IncompatibleCheckpoint if not."""
    got = weights_dtype(folder)
    if served is None or got is None or got == served:
        return
    raise IncompatibleCheckpoint(
        f"v{manifest.version}'s weights are {got}, the engine serves {served} ({source}): loading it would "
        f"switch the served precision with no training in it. Publish {served} (NEXTSTATE_TRAINER__"
        f"PUBLISH_DTYPE=auto follows the served model), or if the engine runs {got} whatever its folder "
        f"(--dtype {got}), set NEXTSTATE_WATCHER__SERVED_DTYPE={got}")


def verify_folder(folder: Path, reference: Path | None, served_dtype: str | None = None) -> CheckpointManifest:
    """Everything above; returns the folder's manifest. `served_dtype`: the dtype the engine
    serves (None: the reference folder's). Raises ChecksumMismatch (files) or
    IncompatibleCheckpoint (base model, config, tensors, dtype)."""
    manifest = check_files(folder)
    if reference is not None:
        check_base(manifest, reference)
        if manifest.format == "adapter":
            check_adapter_fits(folder, reference, manifest)
        else:
            check_fits(folder, reference)
    if manifest.format == "full":
        if served_dtype is not None:
            check_dtype(folder, manifest, served_dtype, "NEXTSTATE_WATCHER__SERVED_DTYPE")
        elif reference is not None:
            check_dtype(folder, manifest, folder_dtype(reference), f"v0, {reference}")
    return manifest
