"""Where a trainer resumes: the version whose weights it starts from, the resume state whose
optimizer it takes, and the same for a rebase while running (`apply_point`).

LATEST is the trainer's commit point. On start `find_resume_point` follows it and resumes
on that version's weights with the optimizer of the newest resume state at or below it in
its lineage (a fresh one without: logged); a
version whose manifest is newer than the LATEST pointer itself, whose parent is LATEST's
version and whose record exists is the trainer's own commit interrupted between
manifest and LATEST, and is finished first (an operator's rollback writes a newer
pointer, and a version of the lineage it abandoned has another parent, so a rollback is
never undone). A rebase (a rollback followed while running) loads a given version the
same way: `find_resume_point(..., at=K)`.

A bad checkpoint degrades, never kills: each candidate is verified (manifest, record,
every downloaded file's size and sha256) and one that fails is refused — reported in
`ResumePoint.refused` — for the next lower version, down to the base model; a resume state
that cannot be read is refused (reason `resume`) for the next older one of the lineage. A readable
LATEST bounds the candidates (never resume past a rollback); an unreadable one is itself
refused and every committed version is a candidate. Version numbers never repeat: the
next one is above everything in the bucket, refused and half-uploaded versions included.
A bucket that does not answer is no verdict on a version: that error stops the start.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.trainer.model import ModelError, is_lora, load_causal_lm
from services.trainer.step import Trainer
from services.trainer.trainer_state import (
    STATE_META,
    STATE_TENSORS,
    ancestors_of,
    load_adapter,
    load_resume_state,
    read_state_meta,
    restore_rng,
    resume_order,
    state_key,
    state_versions,
)
from shared.checkpoints import (
    all_versions,
    download_checkpoint,
    list_versions,
    manifest_key,
    read_latest,
    read_manifest,
    set_latest,
)
from shared.errors import ChecksumMismatch, CorruptCheckpoint, NoCheckpoint, ObjectNotFound
from shared.schemas import CheckpointManifest, LatestPointer
from shared.store import Bucket

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Refusal:
    """A checkpoint passed over at resume, and why."""

    version: int | None  # None: the LATEST pointer itself (unreadable, so it names no version)
    reason: str  # "latest" | "manifest" (missing or invalid) | "checksum" | "state" (its record) |
    #              "resume" (its resume state only: its weights may still be resumed from)
    detail: str


@dataclass
class ResumePoint:
    version: int  # 0: nothing published yet (or nothing verifies), start from the base model
    step: int
    next_version: int
    consumed: list[str]
    model_dir: Path | None = None  # the committed version's HF folder (None: the base)
    # optimizer and RNG (of the resume state `resumed`), the version's LoRA adapter when
    # known; None: a fresh optimizer on the version's weights
    tensors: dict[str, Any] | None = None
    manifest: CheckpointManifest | None = None
    refused: list[Refusal] = field(default_factory=list)  # newer checkpoints that did not verify
    latest: LatestPointer | None = None  # LATEST as the resume left it (None: absent or unreadable)
    resumed: int | None = None  # the version whose resume state `tensors` holds (None: none)
    ancestors: list[int] = field(default_factory=list)  # the version's lineage below it, oldest first


class _Unverified(Exception):
    """A version that cannot be resumed from; `reason` as in `Refusal`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


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
    a lineage a rollback abandoned has another parent), with its record."""
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


def _verified_meta(bucket: Bucket, run: str, version: int) -> dict[str, Any] | None:
    try:
        return read_state_meta(bucket, run, version)
    except CorruptCheckpoint as exc:
        raise _Unverified("state", str(exc)) from None


def _verified_adapter(bucket: Bucket, run: str, version: int) -> dict[str, torch.Tensor] | None:
    try:
        return load_adapter(bucket, run, version)
    except CorruptCheckpoint as exc:
        raise _Unverified("state", str(exc)) from None


def find_resume_state(
    bucket: Bucket, run: str, version: int, ancestors: Sequence[int], have: set[int], refused: list[Refusal]
) -> tuple[int | None, dict[str, Any] | None]:
    """The newest resume state that reads, of `version` or its `ancestors` (`have`: the
    versions with one); each that does not read is added to `refused`. (None, None): none."""
    for v in resume_order(version, ancestors, have):
        try:
            return v, load_resume_state(bucket, run, v)
        except ObjectNotFound:
            continue  # pruned meanwhile
        except CorruptCheckpoint as exc:
            refused.append(Refusal(v, "resume", str(exc)))
    return None, None


def _verified_weights(bucket: Bucket, manifest: CheckpointManifest, dest: Path) -> Path:
    try:
        return download_checkpoint(bucket, manifest, dest)
    except ChecksumMismatch as exc:
        raise _Unverified("checksum", str(exc)) from None
    except CorruptCheckpoint as exc:
        raise _Unverified("manifest", str(exc)) from None


def _open_version(
    bucket: Bucket, run: str, version: int, dest: Path, *, need_weights: bool, have: set[int],
    refused: list[Refusal],
) -> ResumePoint:
    """One version's resume point, verified (`_Unverified` says why not), with the newest
    resume state of its lineage (one that does not read is refused into `refused`). Its
    `next_version` is left for the caller, who sees the whole bucket. The bucket not
    answering is not a verdict on the version: that `StoreError` propagates."""
    manifest = _verified_manifest(bucket, run, version)
    meta = _verified_meta(bucket, run, version)
    if meta is None:
        log.warning("no record for this version: its consumed ids are its manifest's",
                    extra={"run": run, "version": version})
    # LoRA (need_weights False): the adapter is the weights — its record's, its own (format
    # adapter: megabytes, checked too), or its resume state's; else the merged weights.
    adapter = None if need_weights else _verified_adapter(bucket, run, version)
    model_dir = None
    if need_weights or manifest.format == "adapter":
        model_dir = _verified_weights(bucket, manifest, dest)
    ancestors = ancestors_of(meta, manifest.parent)
    resumed, state = find_resume_state(bucket, run, version, ancestors, have, refused)
    if adapter is None and state is not None and resumed == version:
        adapter = state.get("adapter")
    if model_dir is None and adapter is None:
        model_dir = _verified_weights(bucket, manifest, dest)
    tensors: dict[str, Any] = {k: state[k] for k in ("optimizer", "rng") if k in state} if state else {}
    if adapter is not None:
        tensors["adapter"] = adapter
    return ResumePoint(
        version=version,
        step=int(meta["step"]) if meta else manifest.step,
        next_version=version + 1,
        consumed=list(meta["consumed_batch_ids"]) if meta else list(manifest.consumed_batch_ids),
        model_dir=model_dir,
        tensors=tensors or None,
        manifest=manifest,
        resumed=resumed if state is not None and "optimizer" in state else None,
        ancestors=ancestors,
    )


def apply_point(trainer: Trainer, point: ResumePoint, base_model: str) -> None:
    """Rebase the live trainer on `point` (a rollback followed while running): its weights,
    optimizer state and RNG, in place, as `build_trainer` would have started from it. The
    reference model and the optimizer's parameters stay the same objects, so nothing else is
    reloaded. The weights are loaded first, then the optimizer state (which may be an older
    version's: the newest resume state of the point's lineage). A point without one starts
    the optimizer fresh on its weights, as a resume does.

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
    else:  # an empty state through the optimizer's own load (the state stays opaque)
        groups = trainer.optimizer.state_dict()["param_groups"]
        trainer.optimizer.load_state_dict({"state": {}, "param_groups": groups})
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
    """Where training resumes: the newest version that verifies (weights, manifest, record)
    with the newest resume state of its lineage that reads, the versions and resume states
    refused on the way, and the next free version number.

    `need_weights` False (LoRA) skips downloading the merged weights when the adapter is
    known otherwise, so their checksums are not checked here (the watcher checks them
    before serving).

    `at` is a rebase (a rollback the trainer follows): the candidates are `at` and the
    committed versions below it, whatever LATEST says, and no interrupted commit is
    finished. The next version number is the same either way: above everything.
    """
    committed = list_versions(bucket, run)
    latest, refused = _read_pointer(bucket, run)
    unreadable = bool(refused)
    have = state_versions(bucket, run, STATE_TENSORS)
    taken = [*all_versions(bucket, run), *state_versions(bucket, run), latest.version if latest else 0]
    next_version = max(taken, default=0) + 1
    if at is not None:
        interrupted, candidates = None, rebase_candidates(at, committed)
    else:
        interrupted = None if unreadable else _interrupted_commit(bucket, run, latest, committed)
        candidates = resume_candidates(latest, unreadable, committed, interrupted)
    for v in candidates:
        try:
            point = _open_version(bucket, run, v, dest, need_weights=need_weights, have=have, refused=refused)
        except _Unverified as exc:
            refused.append(Refusal(v, exc.reason, str(exc)))
            continue
        if v == interrupted:
            log.warning("finishing a commit interrupted before LATEST moved", extra={"run": run, "version": v})
            latest = set_latest(bucket, run, v)
        point.next_version, point.refused, point.latest = next_version, refused, latest
        _log_optimizer(run, point)
        return point
    return ResumePoint(version=0, step=0, next_version=next_version, consumed=[], refused=refused, latest=latest)


def _log_optimizer(run: str, point: ResumePoint) -> None:
    """Say where the optimizer comes from: a fresh one on a version's weights is worth a warning."""
    extra = {"run": run, "version": point.version, "resumed": point.resumed}
    if point.resumed is None:
        log.warning("v%s: no resume state at or below it in its lineage: the optimizer starts fresh on its "
                    "weights (docs/design.md#resume-and-rollback)", point.version, extra=extra)
    elif point.resumed < point.version:
        log.info("v%s's weights, the optimizer of the resume state of v%s", point.version, point.resumed,
                 extra=extra)
