"""The trainer's side of the checkpoint protocol: snapshots, commits, trainer state, resume.

A *snapshot* is taken on the training thread right after a step (a CPU copy of the
weights — with LoRA the adapter alone, or merged weights when publishing merged — of the
optimizer state and RNG), so training may go on while it is written and uploaded.
Committing a snapshot, all blocking, on the service's upload lane beside the next steps:

    1. the version's files on local disk: a PEFT adapter folder (format adapter), or the HF
       folder (safetensors in the published dtype, config, generation config, tokenizer),
       whose weight files become deltas against the version before when the chain allows
       (`Chain`, `Publishing.snapshot_every`)
    2. trainer state  trainer-state/<run>/v000042/state.pt   (optimizer, RNG, LoRA adapter)
                      trainer-state/<run>/v000042/state.json (step, consumed ids, parent: last)
    3. `publish_checkpoint`: model files, manifest (this version's batch ids, its `parent`:
       the version it was trained from, 0 for the base model), LATEST — each of the last
       two only if the service's guard still agrees (a rollback stops an abandoned
       lineage's commit before LATEST: services/trainer/follow.py)
    4. retention: old versions and their trainer states

LATEST is the trainer's commit point. On start `find_resume_point` follows it; a
version whose manifest is newer than the LATEST pointer itself, whose parent is LATEST's
version and whose trainer state exists is the trainer's own commit interrupted between
manifest and LATEST, and is finished first (an operator's rollback writes a newer
pointer, and a version of the lineage it abandoned has another parent, so a rollback is
never undone). A rebase (a rollback followed while running) loads a given version the
same way: `find_resume_point(..., at=K)`.

A bad checkpoint degrades, never kills: each candidate is verified (manifest, trainer
state, every downloaded file's size and sha256) and one that fails is refused — reported in
`ResumePoint.refused` — for the next lower version, down to the base model. A readable
LATEST bounds the candidates (never resume past a rollback); an unreadable one is itself
refused and every committed version is a candidate. Version numbers never repeat: the
next one is above everything in the bucket, refused and half-uploaded versions included.
A bucket that does not answer is no verdict on a version: that error stops the start.
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
    load_causal_lm,
    save_hf_folder,
)
from services.trainer.step import Trainer
from shared.checkpoints import (
    Delta,
    Layout,
    all_versions,
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
from shared.errors import ChecksumMismatch, CorruptCheckpoint, NoCheckpoint, ObjectNotFound
from shared.gate_view import GateView
from shared.schemas import AdapterSpec, CheckpointManifest, LatestPointer, WeightFormat
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
    parent: int | None  # the version these weights were trained from (0: the base model)
    batch_ids: list[str]  # the batches trained since the previous version
    consumed: list[str]  # recent consumed ids of this lineage, oldest first (for replays)
    weights: dict[str, torch.Tensor]  # the full weights (LoRA merged), or with format adapter the adapter's
    tensors: dict[str, Any]  # optimizer, RNG, adapter
    metrics: dict[str, float] = field(default_factory=dict)
    taken_at: float = field(default_factory=time.time)
    epoch: int = 0  # the service's rebase count when taken: an older one is abandoned
    format: WeightFormat = "full"


def take_snapshot(
    trainer: Trainer, version: int, step: int, batch_ids: Sequence[str], consumed: Sequence[str],
    metrics: dict[str, float], *, parent: int | None = None, epoch: int = 0, fmt: WeightFormat = "full",
) -> Snapshot:
    """Copy what a version needs; call between steps, on the thread that trains. With
    `fmt` adapter only the adapter is copied (no merged copy of the whole model)."""
    from services.trainer.model import adapter_state

    adapter = _cpu_clone(adapter_state(trainer.model)) if is_lora(trainer.model) else None
    if fmt == "adapter" and adapter is None:
        raise ModelError("adapter versions need LoRA (NEXTSTATE_TRAINER__LORA=true)")
    tensors: dict[str, Any] = {
        "optimizer": _cpu_clone(trainer.optimizer.state_dict()),
        "rng": rng_state(),
        "adapter": adapter,
    }
    weights = dict(adapter) if fmt == "adapter" and adapter is not None else export_state_dict(trainer.model)
    return Snapshot(
        version=version, step=step, parent=parent, batch_ids=list(batch_ids), consumed=list(consumed),
        weights=weights, tensors=tensors, metrics=dict(metrics), epoch=epoch, format=fmt,
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
        state_file = folder / STATE_TENSORS
        torch.save(snap.tensors, state_file)
        bucket.put_file(state_key(run, snap.version, STATE_TENSORS), state_file)
        meta = {"version": snap.version, "step": snap.step, "base_model": pub.base_model, "parent": snap.parent,
                "consumed_batch_ids": snap.consumed, "created_at": time.time()}
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
    """Keep the newest `keep` versions (and what the gate needs), and trainer states only
    for versions still kept."""
    prune_bucket(bucket, run, keep, gate=gate)
    kept = set(list_versions(bucket, run))
    newest = max(kept, default=0)
    stale = {v for v in state_versions(bucket, run) if v not in kept and v < newest}
    for v in sorted(stale):
        bucket.delete_prefix(f"{trainer_state_prefix(run)}{version_dirname(v)}/")


# -- resume -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Refusal:
    """A checkpoint passed over at resume, and why."""

    version: int | None  # None: the LATEST pointer itself (unreadable, so it names no version)
    reason: str  # "latest" | "manifest" (missing or invalid) | "checksum" | "state"
    detail: str


@dataclass
class ResumePoint:
    version: int  # 0: nothing published yet (or nothing verifies), start from the base model
    step: int
    next_version: int
    consumed: list[str]
    model_dir: Path | None = None  # the committed version's HF folder (None: the base)
    tensors: dict[str, Any] | None = None  # optimizer, RNG, adapter (None: start fresh)
    manifest: CheckpointManifest | None = None
    refused: list[Refusal] = field(default_factory=list)  # newer checkpoints that did not verify
    latest: LatestPointer | None = None  # LATEST as the resume left it (None: absent or unreadable)


class _Unverified(Exception):
    """A version that cannot be resumed from; `reason` as in `Refusal`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def read_state_meta(bucket: Bucket, run: str, version: int) -> dict[str, Any] | None:
    """The version's trainer-state record (step, consumed ids); None if it has none,
    `CorruptCheckpoint` if it is there but unreadable."""
    key = state_key(run, version, STATE_META)
    try:
        data = bucket.get_bytes(key)
    except ObjectNotFound:
        return None
    try:
        meta = json.loads(data)
    except ValueError as exc:
        raise CorruptCheckpoint(f"{key} is not JSON: {exc}") from None
    if not (isinstance(meta, dict) and isinstance(meta.get("step"), int)
            and isinstance(meta.get("consumed_batch_ids"), list)):
        raise CorruptCheckpoint(f"{key} is not a trainer-state record (step, consumed_batch_ids)")
    return meta


def load_state_tensors(bucket: Bucket, run: str, version: int) -> dict[str, Any]:
    key = state_key(run, version, STATE_TENSORS)
    try:
        data = bucket.get_bytes(key)
    except ObjectNotFound:
        raise CorruptCheckpoint(f"{key} is missing although its {STATE_META} is there") from None
    try:
        tensors = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CorruptCheckpoint(f"trainer state of {run} v{version} cannot be read: {exc}") from exc
    if not isinstance(tensors, dict):
        raise CorruptCheckpoint(f"trainer state of {run} v{version} holds a {type(tensors).__name__}")
    return tensors


def state_versions(bucket: Bucket, run: str) -> set[int]:
    """Versions with anything under trainer-state/<run>/."""
    base = trainer_state_prefix(run)
    found = set()
    for obj in bucket.list(base, recursive=True):
        if m := _VERSION_DIR.fullmatch(obj.key[len(base):].split("/", 1)[0]):
            found.add(int(m.group(1)))
    return found


def _read_pointer(bucket: Bucket, run: str) -> tuple[LatestPointer | None, list[Refusal]]:
    """LATEST, or None and its refusal when it is there but unreadable."""
    try:
        return read_latest(bucket, run), []
    except CorruptCheckpoint as exc:
        return None, [Refusal(None, "latest", str(exc))]


def _interrupted_commit(
    bucket: Bucket, run: str, latest: LatestPointer | None, committed: list[int]
) -> int | None:
    """The trainer's own commit cut off between manifest and LATEST, if the newest version is
    one: written after the pointer, trained from the version the pointer names (a version of
    a lineage a rollback abandoned has another parent), with its trainer state."""
    newer = [v for v in committed if latest is None or v > latest.version]
    if not newer:
        return None
    v = max(newer)
    try:
        manifest = read_manifest(bucket, manifest_key(run, v))
    except (NoCheckpoint, CorruptCheckpoint):
        return None  # not a commit to finish; not a resume candidate either
    pointer_time = latest.committed_at if latest is not None else 0.0
    if manifest.parent is not None and manifest.parent != (latest.version if latest is not None else 0):
        return None
    if manifest.created_at > pointer_time and bucket.exists(state_key(run, v, STATE_META)):
        return v
    return None


def resume_candidates(
    latest: LatestPointer | None, latest_unreadable: bool, committed: Sequence[int], interrupted: int | None
) -> list[int]:
    """Versions to try, in order. A readable LATEST bounds them (never past a rollback); an
    unreadable one leaves every committed version; none at all, only an interrupted commit."""
    first = [interrupted] if interrupted is not None else []
    if latest_unreadable:
        return sorted(committed, reverse=True)
    if latest is None:
        return first
    older = sorted((v for v in committed if v < latest.version), reverse=True)
    return [*first, latest.version, *older]


def _verified_manifest(bucket: Bucket, run: str, version: int) -> CheckpointManifest:
    try:
        manifest = read_manifest(bucket, manifest_key(run, version))
    except (NoCheckpoint, CorruptCheckpoint) as exc:
        raise _Unverified("manifest", str(exc)) from None
    if (manifest.run, manifest.version) != (run, version):
        raise _Unverified("manifest", f"{manifest_key(run, version)} describes run {manifest.run!r} "
                                     f"v{manifest.version}")
    return manifest


def _verified_state(
    bucket: Bucket, run: str, version: int
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    try:
        meta = read_state_meta(bucket, run, version)
        return meta, load_state_tensors(bucket, run, version) if meta is not None else None
    except CorruptCheckpoint as exc:
        raise _Unverified("state", str(exc)) from None


def _verified_weights(bucket: Bucket, manifest: CheckpointManifest, dest: Path) -> Path:
    try:
        return download_checkpoint(bucket, manifest, dest)
    except ChecksumMismatch as exc:
        raise _Unverified("checksum", str(exc)) from None
    except CorruptCheckpoint as exc:
        raise _Unverified("manifest", str(exc)) from None


def _open_version(bucket: Bucket, run: str, version: int, dest: Path, *, need_weights: bool) -> ResumePoint:
    """One version's resume point, verified (`_Unverified` says why not). Its `next_version`
    is left for the caller, who sees the whole bucket. The bucket not answering is not a
    verdict on the version: that `StoreError` propagates."""
    manifest = _verified_manifest(bucket, run, version)
    meta, tensors = _verified_state(bucket, run, version)
    if meta is None:
        log.warning("no trainer state for this version: optimizer starts fresh",
                    extra={"run": run, "version": version})
    model_dir = None
    if need_weights or tensors is None or tensors.get("adapter") is None or manifest.format == "adapter":
        model_dir = _verified_weights(bucket, manifest, dest)  # an adapter: megabytes, checked too
    return ResumePoint(
        version=version,
        step=int(meta["step"]) if meta else manifest.step,
        next_version=version + 1,
        consumed=list(meta["consumed_batch_ids"]) if meta else list(manifest.consumed_batch_ids),
        model_dir=model_dir,
        tensors=tensors,
        manifest=manifest,
    )


def apply_point(trainer: Trainer, point: ResumePoint, base_model: str) -> None:
    """Rebase the live trainer on `point` (a rollback followed while running): its weights,
    optimizer state and RNG, in place, as `build_trainer` would have started from it. The
    reference model and the optimizer's parameters stay the same objects, so nothing else is
    reloaded. A point without trainer state starts the optimizer fresh, as a resume does.

    `ModelError` when it cannot be done in place (LoRA, and the point holds no adapter): the
    service then restarts, and the restart resumes from the rollback.
    """
    tensors = point.tensors or {}
    adapter = tensors.get("adapter") or published_adapter(point)
    if is_lora(trainer.model):
        if adapter is None:
            raise ModelError(f"v{point.version} has no saved LoRA adapter: a rebase on it needs a restart")
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(trainer.model, adapter)
    else:
        if adapter is not None:
            raise ModelError(f"the trainer state of v{point.version} holds a LoRA adapter but LoRA is off")
        dtype = next(trainer.model.parameters()).dtype
        source = load_causal_lm(point.model_dir or base_model, torch.device("cpu"), dtype)
        with torch.no_grad():
            trainer.model.load_state_dict(source.state_dict())
        del source
    if "optimizer" in tensors:
        trainer.optimizer.load_state_dict(tensors["optimizer"])
        o = trainer.optim
        for group in trainer.optimizer.param_groups:  # the configuration wins, as in build_trainer
            group.update(lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=o.eps)
        restore_rng(tensors["rng"])
    else:
        trainer.optimizer.state.clear()
    trainer.optimizer.zero_grad(set_to_none=True)


def published_adapter(point: ResumePoint) -> dict[str, torch.Tensor] | None:
    """The adapter a `format: adapter` version published (None for any other point): the
    trainer's own when its trainer state is lost."""
    if point.manifest is None or point.manifest.format != "adapter" or point.model_dir is None:
        return None
    from services.trainer.model import read_adapter_weights

    return read_adapter_weights(point.model_dir)


def rebase_candidates(at: int, committed: Sequence[int]) -> list[int]:
    """Versions to try for a rebase onto `at`: it, then every committed version below it."""
    return [at, *sorted((v for v in committed if v < at), reverse=True)]


def find_resume_point(
    bucket: Bucket, run: str, dest: Path, *, need_weights: bool = True, at: int | None = None
) -> ResumePoint:
    """Where training resumes: the newest version that verifies (weights, manifest, trainer
    state), the versions refused on the way, and the next free version number.

    `need_weights` False (LoRA with a saved adapter) skips downloading the merged weights,
    so their checksums are not checked here (the watcher checks them before serving).

    `at` is a rebase (a rollback the trainer follows): the candidates are `at` and the
    committed versions below it, whatever LATEST says, and no interrupted commit is
    finished. The next version number is the same either way: above everything.
    """
    committed = list_versions(bucket, run)
    latest, refused = _read_pointer(bucket, run)
    unreadable = bool(refused)
    taken = [*all_versions(bucket, run), *state_versions(bucket, run), latest.version if latest else 0]
    next_version = max(taken, default=0) + 1
    if at is not None:
        interrupted, candidates = None, rebase_candidates(at, committed)
    else:
        interrupted = None if unreadable else _interrupted_commit(bucket, run, latest, committed)
        candidates = resume_candidates(latest, unreadable, committed, interrupted)
    for v in candidates:
        try:
            point = _open_version(bucket, run, v, dest, need_weights=need_weights)
        except _Unverified as exc:
            refused.append(Refusal(v, exc.reason, str(exc)))
            continue
        if v == interrupted:
            log.warning("finishing a commit interrupted before LATEST moved", extra={"run": run, "version": v})
            latest = set_latest(bucket, run, v)
        point.next_version, point.refused, point.latest = next_version, refused, latest
        return point
    return ResumePoint(version=0, step=0, next_version=next_version, consumed=[], refused=refused, latest=latest)
