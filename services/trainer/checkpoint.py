"""The trainer's side of the checkpoint protocol: snapshots, commits, trainer state, resume.

A *snapshot* is taken on the training thread right after a step (a CPU copy of the
weights with LoRA merged, of the optimizer state and RNG), so training may go on while
it is written and uploaded. Committing a snapshot, all blocking:

    1. the HF folder (safetensors, config, generation config, tokenizer) on local disk
    2. trainer state  trainer-state/<run>/v000042/state.pt   (optimizer, RNG, LoRA adapter)
                      trainer-state/<run>/v000042/state.json (step, consumed ids: written last)
    3. `publish_checkpoint`: model files, manifest (this version's batch ids), LATEST
    4. retention: old versions and their trainer states

LATEST is the trainer's commit point. On start `find_resume_point` follows it; a
version whose manifest is newer than the LATEST pointer itself and whose trainer state
exists is the trainer's own commit interrupted between manifest and LATEST, and is
finished first (an operator's rollback writes a newer pointer, so it is never undone).
"""

from __future__ import annotations

import copy
import io
import json
import logging
import random
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.trainer.model import export_state_dict, is_lora, save_hf_folder
from services.trainer.step import Trainer
from shared.checkpoints import (
    download_checkpoint,
    list_versions,
    manifest_key,
    prune_bucket,
    publish_checkpoint,
    read_latest,
    read_manifest,
    set_latest,
    trainer_state_prefix,
    version_dirname,
)
from shared.errors import ObjectNotFound, StoreError
from shared.schemas import CheckpointManifest, LatestPointer
from shared.store import Bucket

log = logging.getLogger(__name__)

STATE_TENSORS = "state.pt"
STATE_META = "state.json"
_VERSION_DIR = re.compile(r"v(\d{6,})")


def state_key(run: str, version: int, name: str) -> str:
    return f"{trainer_state_prefix(run)}{version_dirname(version)}/{name}"


def _cpu_clone(obj: Any) -> Any:
    """Deep copy with every tensor copied to CPU (the live ones keep changing)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_clone(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu_clone(v) for v in obj)
    return copy.deepcopy(obj)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class Snapshot:
    """Everything one version needs, copied off the live trainer."""

    version: int
    step: int
    batch_ids: list[str]  # the batches trained since the previous version
    consumed: list[str]  # recent consumed ids of this lineage, oldest first (for replays)
    weights: dict[str, torch.Tensor]
    tensors: dict[str, Any]  # optimizer, RNG, adapter
    metrics: dict[str, float] = field(default_factory=dict)
    taken_at: float = field(default_factory=time.time)


def take_snapshot(
    trainer: Trainer, version: int, step: int, batch_ids: Sequence[str], consumed: Sequence[str],
    metrics: dict[str, float],
) -> Snapshot:
    """Copy what a version needs; call between steps, on the thread that trains."""
    from services.trainer.model import adapter_state

    tensors: dict[str, Any] = {
        "optimizer": _cpu_clone(trainer.optimizer.state_dict()),
        "rng": rng_state(),
        "adapter": _cpu_clone(adapter_state(trainer.model)) if is_lora(trainer.model) else None,
    }
    return Snapshot(
        version=version, step=step, batch_ids=list(batch_ids), consumed=list(consumed),
        weights=export_state_dict(trainer.model), tensors=tensors, metrics=dict(metrics),
    )  # fmt: skip


def commit_snapshot(
    bucket: Bucket,
    run: str,
    snap: Snapshot,
    model: Any,
    *,
    work_dir: Path,
    static_dir: Path | None,
    base_model: str,
    keep: int,
) -> CheckpointManifest:
    """Write, upload and commit one version (idempotent: a retry redoes it whole)."""
    folder = work_dir / f"snapshot-{version_dirname(snap.version)}"
    shutil.rmtree(folder, ignore_errors=True)
    try:
        save_hf_folder(model, snap.weights, folder / "model", static_dir)
        state_file = folder / STATE_TENSORS
        torch.save(snap.tensors, state_file)
        bucket.put_file(state_key(run, snap.version, STATE_TENSORS), state_file)
        meta = {"version": snap.version, "step": snap.step, "base_model": base_model,
                "consumed_batch_ids": snap.consumed, "created_at": time.time()}
        bucket.put_bytes(state_key(run, snap.version, STATE_META), json.dumps(meta).encode(),
                         content_type="application/json")
        manifest = publish_checkpoint(
            bucket, run, snap.version, folder / "model", step=snap.step, base_model=base_model,
            consumed_batch_ids=snap.batch_ids, metrics=snap.metrics,
        )  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    prune(bucket, run, keep)
    return manifest


def prune(bucket: Bucket, run: str, keep: int) -> None:
    """Keep the newest `keep` versions, and trainer states only for versions still kept."""
    prune_bucket(bucket, run, keep)
    kept = set(list_versions(bucket, run))
    newest = max(kept, default=0)
    base = trainer_state_prefix(run)
    stale = set()
    for obj in bucket.list(base, recursive=True):
        m = _VERSION_DIR.fullmatch(obj.key[len(base):].split("/", 1)[0])
        if m and int(m.group(1)) not in kept and int(m.group(1)) < newest:
            stale.add(int(m.group(1)))
    for v in sorted(stale):
        bucket.delete_prefix(f"{base}{version_dirname(v)}/")


# -- resume -------------------------------------------------------------------------------------------
@dataclass
class ResumePoint:
    version: int  # 0: nothing published yet, start from the base model
    step: int
    next_version: int
    consumed: list[str]
    model_dir: Path | None = None  # the committed version's HF folder (None: the base)
    tensors: dict[str, Any] | None = None  # optimizer, RNG, adapter (None: start fresh)
    manifest: CheckpointManifest | None = None


def read_state_meta(bucket: Bucket, run: str, version: int) -> dict[str, Any] | None:
    try:
        meta: dict[str, Any] = bucket.get_json(state_key(run, version, STATE_META))
    except ObjectNotFound:
        return None
    return meta


def load_state_tensors(bucket: Bucket, run: str, version: int) -> dict[str, Any]:
    data = bucket.get_bytes(state_key(run, version, STATE_TENSORS))
    try:
        tensors: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise StoreError(f"trainer state of {run} v{version} cannot be read: {exc}") from exc
    return tensors


def _finish_interrupted_commit(
    bucket: Bucket, run: str, latest: LatestPointer | None, versions: list[int]
) -> LatestPointer | None:
    newer = [v for v in versions if latest is None or v > latest.version]
    if not newer:
        return latest
    v = max(newer)
    manifest = read_manifest(bucket, manifest_key(run, v))
    pointer_time = latest.committed_at if latest is not None else 0.0
    if manifest.created_at > pointer_time and read_state_meta(bucket, run, v) is not None:
        log.warning("finishing a commit interrupted before LATEST moved",
                    extra={"run": run, "version": v})
        return set_latest(bucket, run, v)
    return latest


def find_resume_point(bucket: Bucket, run: str, dest: Path, *, need_weights: bool = True) -> ResumePoint:
    """Where training resumes: LATEST's weights, its trainer state, the next free version.

    `need_weights` False (LoRA with a saved adapter) skips downloading the merged weights.
    """
    versions = list_versions(bucket, run)
    latest = _finish_interrupted_commit(bucket, run, read_latest(bucket, run), versions)
    top = max([*versions, latest.version if latest else 0, 0])
    if latest is None:
        return ResumePoint(version=0, step=0, next_version=top + 1, consumed=[])
    manifest = read_manifest(bucket, latest.manifest)
    meta = read_state_meta(bucket, run, latest.version)
    tensors = load_state_tensors(bucket, run, latest.version) if meta is not None else None
    if meta is None:
        log.warning("no trainer state for the latest version: optimizer starts fresh",
                    extra={"run": run, "version": latest.version})
    model_dir = None
    if need_weights or tensors is None or tensors.get("adapter") is None:
        model_dir = download_checkpoint(bucket, manifest, dest)
    return ResumePoint(
        version=latest.version,
        step=int(meta["step"]) if meta else manifest.step,
        next_version=top + 1,
        consumed=list(meta["consumed_batch_ids"]) if meta else list(manifest.consumed_batch_ids),
        model_dir=model_dir,
        tensors=tensors,
        manifest=manifest,
    )
