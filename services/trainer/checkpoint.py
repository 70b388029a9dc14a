"""The trainer's side of the checkpoint protocol: snapshots, commits, retention.

A *snapshot* is taken on the training thread right after a step (a CPU copy of the
weights — with LoRA the adapter alone, or merged weights when publishing merged), so
training may go on while it is written and uploaded. A version is weights only: the
optimizer state and RNG are the *resume state*, written at a cadence of its own after its
version is committed (services/trainer/trainer_state.py). Committing a snapshot, all
blocking, on the service's upload lane beside the next steps:

    1. the version's files on local disk: a PEFT adapter folder (format adapter), or the HF
       folder (safetensors in the published dtype, config, generation config, tokenizer),
       whose weight files become deltas against the version before when the chain allows
       (`Chain`, `Publishing.snapshot_every`)
    2. its record     trainer-state/<run>/v000042/state.json (step, consumed ids, parent, ancestors)
                      trainer-state/<run>/v000042/adapter.pt (LoRA published merged: the adapter)
    3. `publish_checkpoint`: model files, manifest (this version's batch ids, its `parent`:
       the version it was trained from, 0 for the base model), LATEST — each of the last
       two only if the service's guard still agrees (a rollback stops an abandoned
       lineage's commit before LATEST: services/trainer/follow.py)
    4. retention: old versions and their records, and the resume states no kept version needs

LATEST is the trainer's commit point; where a trainer resumes from it is
services/trainer/resume.py.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.trainer.model import (
    ADAPTER,
    ModelError,
    export_state_dict,
    is_lora,
    save_hf_folder,
)
from services.trainer.step import Trainer
from services.trainer.trainer_state import (
    ANCESTRY,
    STATE_ADAPTER,
    STATE_META,
    STATE_TENSORS,
    ancestors_of,
    cpu_clone,
    needed_resume_states,
    read_state_meta,
    state_key,
    state_versions,
)
from shared.checkpoints import (
    Delta,
    Layout,
    list_versions,
    prune_bucket,
    publish_checkpoint,
    trainer_state_prefix,
    version_dirname,
)
from shared.errors import CorruptCheckpoint
from shared.gate_view import GateView
from shared.schemas import AdapterSpec, CheckpointManifest, LatestPointer, WeightFormat
from shared.store import Bucket

log = logging.getLogger(__name__)


@dataclass
class Snapshot:
    """Everything one version needs, copied off the live trainer."""

    version: int
    step: int
    parent: int | None  # the version these weights were trained from (0: the base model)
    batch_ids: list[str]  # the batches trained since the previous version
    consumed: list[str]  # recent consumed ids of this lineage, oldest first (for replays)
    weights: dict[str, torch.Tensor]  # the full weights (LoRA merged), or with format adapter the adapter's
    adapter: dict[str, torch.Tensor] | None = None  # LoRA published merged: the adapter (its record keeps it)
    ancestors: list[int] = field(default_factory=list)  # what it descends from, oldest first, `parent` last
    metrics: dict[str, float] = field(default_factory=dict)
    taken_at: float = field(default_factory=time.time)
    epoch: int = 0  # the service's rebase count when taken: an older one is abandoned
    format: WeightFormat = "full"


def take_snapshot(
    trainer: Trainer, version: int, step: int, batch_ids: Sequence[str], consumed: Sequence[str],
    metrics: dict[str, float], *, parent: int | None = None, epoch: int = 0, fmt: WeightFormat = "full",
    ancestors: Sequence[int] = (),
) -> Snapshot:
    """Copy what a version needs — its weights, not the optimizer (the resume state is taken
    apart, `trainer_state.take_resume_state`); call between steps, on the thread that trains.
    With `fmt` adapter only the adapter is copied (no merged copy of the whole model).
    `ancestors`: the versions below `parent` in its lineage, oldest first (`parent` is added)."""
    from services.trainer.model import adapter_state

    adapter = cpu_clone(adapter_state(trainer.model)) if is_lora(trainer.model) else None
    if fmt == "adapter" and adapter is None:
        raise ModelError("adapter versions need LoRA (NEXTSTATE_TRAINER__LORA=true)")
    weights = dict(adapter) if fmt == "adapter" and adapter is not None else export_state_dict(trainer.model)
    lineage = [v for v in (*ancestors, parent) if v][-ANCESTRY:]
    return Snapshot(
        version=version, step=step, parent=parent, batch_ids=list(batch_ids), consumed=list(consumed),
        weights=weights, adapter=adapter if fmt == "full" else None, ancestors=lineage,
        metrics=dict(metrics), epoch=epoch, format=fmt,
    )  # fmt: skip


@dataclass(frozen=True)
class Chain:
    """The last full version this trainer committed, kept on local disk so the next
    version can be published as deltas against it (docs/weights.md, "Deltas")."""

    version: int
    folder: Path  # its files, as published
    snapshot: int  # the full snapshot its chain starts from (itself when it has no delta)
    length: int  # versions with deltas since that snapshot


@dataclass(frozen=True)
class Publishing:
    """How this trainer publishes (TrainerConfig's publish_dtype, snapshot_every, lora_publish)."""

    base_model: str  # the base model's folder, as the manifest names it
    base_fingerprint: str = ""  # its identity (shared/runs.py)
    dtype: torch.dtype | None = None  # the published weights' dtype (None: the trainer's)
    snapshot_every: int = 1
    keep: int = 3
    min_saving: float = 0.1  # a delta saving less than this share of its file is not worth it


def _dtype_name(weights: dict[str, torch.Tensor], dtype: torch.dtype | None) -> str | None:
    if dtype is not None:
        return str(dtype).removeprefix("torch.")
    floats = {str(t.dtype).removeprefix("torch.") for t in weights.values() if t.is_floating_point()}
    return floats.pop() if len(floats) == 1 else None


def _encode_deltas(files: Path, chain: Chain, work: Path, min_saving: float) -> list[Delta]:
    """Deltas of `files`' weight files against `chain`'s copies of them, those worth it."""
    from shared import deltas as codec
    from shared.checkpoints import digest_file

    work.mkdir(parents=True, exist_ok=True)
    out = []
    for f in sorted(files.glob("*.safetensors")):
        base = chain.folder / f.name
        if not base.is_file():
            continue
        delta = work / (f.name + codec.SUFFIX)
        if codec.encode(f, base, delta) > (1 - min_saving) * f.stat().st_size:
            delta.unlink()
            continue
        out.append(Delta(of=f.name, path=delta, base_version=chain.version,
                         base_sha256=digest_file(base).sha256))
    return out


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
    guard: Callable[[LatestPointer | None], None] | None = None,
    gate: GateView | None = None,
    publishing: Publishing | None = None,
    chain: Chain | None = None,
) -> tuple[CheckpointManifest, Chain | None]:
    """Write, upload and commit one version (idempotent: a retry redoes it whole). `guard`
    as in `publish_checkpoint`: it may stop the commit before the manifest or LATEST.
    `gate`: the promotion gate's view; retention keeps what it serves or has yet to decide.

    A full version whose parent is `chain`'s version, within `snapshot_every`, goes up as
    deltas against it. Returns the manifest and the chain the next version builds on (this
    version's files, kept under `work_dir/published`; None for an adapter)."""
    pub = publishing or Publishing(base_model=base_model, keep=keep)
    folder = work_dir / f"snapshot-{version_dirname(snap.version)}"
    shutil.rmtree(folder, ignore_errors=True)
    files = folder / "model"
    kept: Chain | None = None
    try:
        if snap.format == "adapter":
            from services.trainer.model import adapter_targets, save_adapter_folder

            save_adapter_folder(model, snap.weights, files, pub.base_model, pub.dtype)
            lora = model.peft_config[ADAPTER]
            layout = Layout(format="adapter", dtype=_dtype_name(snap.weights, pub.dtype),
                            base_fingerprint=pub.base_fingerprint,
                            adapter=AdapterSpec(rank=int(lora.r), alpha=float(lora.lora_alpha),
                                                target_modules=adapter_targets(snap.weights)))
        else:
            save_hf_folder(model, snap.weights, files, static_dir, pub.dtype)
            usable = chain is not None and chain.version == snap.parent and chain.length + 1 < pub.snapshot_every
            found = _encode_deltas(files, chain, folder / "deltas", pub.min_saving) if usable and chain else []
            layout = Layout(format="full", dtype=_dtype_name(snap.weights, pub.dtype),
                            base_fingerprint=pub.base_fingerprint, deltas=tuple(found),
                            snapshot=chain.snapshot if found and chain else None)
        if snap.adapter is not None:  # merged LoRA: the weights cannot give the adapter back
            adapter_file = folder / STATE_ADAPTER
            torch.save(snap.adapter, adapter_file)
            bucket.put_file(state_key(run, snap.version, STATE_ADAPTER), adapter_file)
        meta = {"version": snap.version, "step": snap.step, "base_model": pub.base_model, "parent": snap.parent,
                "ancestors": snap.ancestors, "consumed_batch_ids": snap.consumed, "created_at": time.time()}
        bucket.put_bytes(state_key(run, snap.version, STATE_META), json.dumps(meta).encode(),
                         content_type="application/json")
        manifest = publish_checkpoint(
            bucket, run, snap.version, files, step=snap.step, base_model=pub.base_model,
            consumed_batch_ids=snap.batch_ids, metrics=snap.metrics, parent=snap.parent, guard=guard,
            layout=layout,
        )  # fmt: skip
        if snap.format == "full" and pub.snapshot_every > 1:
            kept = _keep_published(work_dir, snap.version, files, manifest, chain)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    prune(bucket, run, pub.keep, gate)
    return manifest, kept


def _keep_published(work_dir: Path, version: int, files: Path, manifest: CheckpointManifest,
                    chain: Chain | None) -> Chain:
    """Move a committed version's files to `work_dir/published` as the next delta's base
    (the one before it is dropped)."""
    root = work_dir / "published"
    dest = root / version_dirname(version)
    shutil.rmtree(dest, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    files.rename(dest)
    for old in root.iterdir():
        if old != dest:
            shutil.rmtree(old, ignore_errors=True)
    if manifest.encoded and chain is not None:
        return Chain(version, dest, chain.snapshot, chain.length + 1)
    return Chain(version, dest, version, 0)


def prune(bucket: Bucket, run: str, keep: int, gate: GateView | None = None) -> None:
    """Keep the newest `keep` versions (and what the gate needs), their records, and the
    resume state each of them would resume from; the trainer state of any other version
    below the newest goes."""
    prune_bucket(bucket, run, keep, gate=gate)
    kept = set(list_versions(bucket, run))
    newest = max(kept, default=0)
    stale = {v for v in state_versions(bucket, run) if v not in kept and v < newest}
    if not stale:
        return
    needed = needed_resume_states({v: _lineage(bucket, run, v) for v in kept},
                                  state_versions(bucket, run, STATE_TENSORS))
    for v in sorted(stale - needed):
        bucket.delete_prefix(f"{trainer_state_prefix(run)}{version_dirname(v)}/")


def _lineage(bucket: Bucket, run: str, version: int) -> list[int] | None:
    """A kept version's ancestors by its record (None: no readable record)."""
    try:
        meta = read_state_meta(bucket, run, version)
    except CorruptCheckpoint:
        return None
    return ancestors_of(meta) if meta is not None else None
