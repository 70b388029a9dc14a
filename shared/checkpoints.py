"""The checkpoint protocol on the bucket (docs/design.md#the-checkpoint-protocol), and every bucket key.

Writers publish files first, `manifest.json` second, `LATEST` last, so a reader that
follows `LATEST` never sees a partial version. Readers download into a staging folder
next to the destination, check every file's size and sha256 against the manifest, and
only then rename the folder into place: a bad download leaves nothing behind.

    policies/<run>/v000042/…                 model files (shards, config, tokenizer)
    policies/<run>/v000042/manifest.json     CheckpointManifest
    policies/<run>/LATEST                    LatestPointer
    policies/<run>/RUN.json                  RunRecord: the run's base model (shared/runs.py)
    trainer-state/<run>/…                    optimizer + step for resume
    evals/<run>/v000042/<suite>.json         EvalResult of each suite on that version
    samples/<run>/…                          archived samples

Everything here is blocking; asyncio code calls it through `AsyncBucket.run`.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path, PurePosixPath
from typing import TypeVar

from pydantic import ValidationError

from shared.errors import (
    ChecksumMismatch,
    CorruptCheckpoint,
    NoCheckpoint,
    ObjectNotFound,
    StoreError,
)
from shared.gate_view import GateView
from shared.schemas import CheckpointFile, CheckpointManifest, LatestPointer, describe
from shared.store import Bucket, FileDigest

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "LATEST"
RUN = "RUN.json"
STAGING = ".staging-"
_RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_VERSION_DIR = re.compile(r"v(\d{6,})")

T = TypeVar("T")
R = TypeVar("R")


# -- bucket key layout: nothing else spells a bucket key --------------------------------------
def _run(run: str) -> str:
    if not _RUN.fullmatch(run):
        raise ValueError(f"invalid run name {run!r}: letters, digits and _ . - only (at most 64)")
    return run


def version_dirname(version: int) -> str:
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return f"v{version:06d}"


def policies_prefix(run: str) -> str:
    return f"policies/{_run(run)}/"


def version_prefix(run: str, version: int) -> str:
    return f"{policies_prefix(run)}{version_dirname(version)}/"


def manifest_key(run: str, version: int) -> str:
    return version_prefix(run, version) + MANIFEST


def latest_key(run: str) -> str:
    return policies_prefix(run) + LATEST


def evals_prefix(run: str) -> str:
    return f"evals/{_run(run)}/"


def eval_key(run: str, version: int, suite: str) -> str:
    """An EvalResult of `suite` on `version` (written by the evaluator, which may write
    nothing else: a key of its own, not inside the version's folder)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", suite):
        raise ValueError(f"invalid suite name {suite!r}: letters, digits and _ . - only")
    return f"{evals_prefix(run)}{version_dirname(version)}/{suite}.json"


def run_key(run: str) -> str:
    """The run's identity: which base model it belongs to (shared/runs.py)."""
    return policies_prefix(run) + RUN


def trainer_state_prefix(run: str) -> str:
    return f"trainer-state/{_run(run)}/"


def samples_prefix(run: str) -> str:
    return f"samples/{_run(run)}/"


# -- reading the pointers ----------------------------------------------------------------------
def read_latest(bucket: Bucket, run: str) -> LatestPointer | None:
    """The version readers should serve, or None before the first publish;
    `CorruptCheckpoint` if the pointer is there but unreadable."""
    key = latest_key(run)
    try:
        data = bucket.get_bytes(key)
    except ObjectNotFound:
        return None
    try:
        return LatestPointer.model_validate_json(data)
    except ValidationError as exc:
        raise CorruptCheckpoint(f"{key} is not a valid LATEST pointer: {describe(exc)}") from None


def read_manifest(bucket: Bucket, key: str) -> CheckpointManifest:
    """The manifest at `key`; `NoCheckpoint` if there is none, `CorruptCheckpoint` if it does not parse."""
    try:
        data = bucket.get_bytes(key)
    except ObjectNotFound:
        raise NoCheckpoint(f"no checkpoint manifest at {key!r} in bucket {bucket.name!r}") from None
    try:
        return CheckpointManifest.model_validate_json(data)
    except ValidationError as exc:
        raise CorruptCheckpoint(f"{key} is not a valid checkpoint manifest: {describe(exc)}") from None


def set_latest(bucket: Bucket, run: str, version: int) -> LatestPointer:
    """Point LATEST at `version`; refuses a version without a valid manifest.

    A rollback goes through `shared.lineage.request_rebase`, which records the rebase for
    the trainer first and then calls this. The trainer calls it itself only to put LATEST
    back on the version it rebased on (a commit of the abandoned lineage raced the rollback).
    """
    key = manifest_key(run, version)
    manifest = read_manifest(bucket, key)
    if manifest.version != version or manifest.run != run:
        raise StoreError(f"{key} describes run {manifest.run!r} v{manifest.version}, not this one")
    pointer = LatestPointer(version=version, manifest=key)
    bucket.put_json(latest_key(run), pointer)
    log.info("LATEST set", extra={"run": run, "version": version})
    return pointer


def _scan(bucket: Bucket, run: str) -> dict[int, tuple[bool, float]]:
    """version -> (has a manifest, newest object's mtime) from one listing."""
    found: dict[int, tuple[bool, float]] = {}
    base = policies_prefix(run)
    for obj in bucket.list(base, recursive=True):
        head, _, rest = obj.key[len(base):].partition("/")
        m = _VERSION_DIR.fullmatch(head)
        if not m or not rest:
            continue
        v = int(m.group(1))
        has, newest = found.get(v, (False, 0.0))
        mtime = obj.last_modified.timestamp() if obj.last_modified else 0.0
        found[v] = (has or rest == MANIFEST, max(newest, mtime))
    return found


def list_versions(bucket: Bucket, run: str) -> list[int]:
    """Versions with a committed manifest, oldest first (half-uploaded ones are not listed)."""
    return sorted(v for v, (has, _) in _scan(bucket, run).items() if has)


def all_versions(bucket: Bucket, run: str) -> list[int]:
    """Every version with any object in the bucket (committed, half-uploaded, damaged), oldest
    first: the numbers a new version must never reuse."""
    return sorted(_scan(bucket, run))


# -- publishing --------------------------------------------------------------------------------
def _source_files(src_dir: Path) -> list[str]:
    if not src_dir.is_dir():
        raise StoreError(f"checkpoint folder {str(src_dir)!r} does not exist")
    files = sorted(p.relative_to(src_dir).as_posix() for p in src_dir.rglob("*") if p.is_file())
    if not files:
        raise StoreError(f"checkpoint folder {str(src_dir)!r} holds no files")
    if MANIFEST in files:
        raise StoreError(f"{str(src_dir)!r} has its own {MANIFEST}; that name is the protocol's")
    return files


def _parallel(fn: Callable[[T], R], items: Sequence[T], parallel: int, what: Callable[[T], str]) -> list[R]:
    """`fn` over `items` on `parallel` threads; the first failure cancels the rest and is raised
    as a StoreError naming its item (after every started call has finished)."""
    with ThreadPoolExecutor(max_workers=max(1, parallel), thread_name_prefix="ckpt") as pool:
        futures = [pool.submit(fn, item) for item in items]
        wait(futures, return_when=FIRST_EXCEPTION)
        for fut in futures:
            fut.cancel()
    for item, fut in zip(items, futures, strict=True):
        if not fut.cancelled() and (exc := fut.exception()) is not None:
            if isinstance(exc, ChecksumMismatch):
                raise exc
            raise StoreError(f"{what(item)}: {exc}") from exc
    return [fut.result() for fut in futures]


def publish_checkpoint(
    bucket: Bucket,
    run: str,
    version: int,
    src_dir: str | Path,
    *,
    step: int = 0,
    base_model: str = "",
    consumed_batch_ids: Iterable[str] = (),
    metrics: dict[str, float] | None = None,
    parent: int | None = None,
    guard: Callable[[LatestPointer | None], None] | None = None,
    parallel: int = 4,
) -> CheckpointManifest:
    """Upload every file of `src_dir` (sha256 computed while reading), then the manifest,
    then LATEST. If any upload fails, LATEST is untouched and the error names the file.

    LATEST only moves forward here: if it already points at a newer version (uploads that
    finished out of order), the manifest is written but LATEST is left alone. Rollback is
    `set_latest`'s job. An unreadable LATEST is replaced (with a warning), never a reason
    for every commit to fail.

    `parent` is the version these weights were trained from (0: the base model), recorded
    in the manifest. `guard`, if given, is shown LATEST (None: absent or unreadable) after
    the files are up and again just before LATEST is written, and raises to stop the
    publish: a rollback arrived and this version belongs to the abandoned lineage
    (services/trainer/follow.py). Stopped at the first look, no manifest is written (the
    version stays half-uploaded); at the second, the manifest is deleted again, so neither
    a reader nor a resume takes it for committed. Its exception propagates.
    """
    src = Path(src_dir)
    prefix = version_prefix(run, version)
    files = _source_files(src)
    t0 = time.monotonic()

    def upload(rel: str) -> CheckpointFile:
        d = bucket.put_file(prefix + rel, src / rel)
        return CheckpointFile(path=rel, size=d.size, sha256=d.sha256)

    uploaded = _parallel(upload, files, parallel,
                         lambda rel: f"publishing {run} v{version}: uploading {rel!r} failed "
                                     f"(LATEST not moved)")
    if guard is not None:
        guard(_pointer_to_replace(bucket, run))
    manifest = CheckpointManifest(
        run=run, version=version, step=step, base_model=base_model, parent=parent, files=uploaded,
        consumed_batch_ids=list(consumed_batch_ids), metrics=dict(metrics or {}),
    )
    bucket.put_json(manifest_key(run, version), manifest)
    current = _pointer_to_replace(bucket, run)
    if guard is not None:
        _guard_latest(bucket, run, version, guard, current)
    if current is not None and current.version > version:
        log.warning("LATEST already at a newer version; not moving it back",
                    extra={"run": run, "version": version, "latest": current.version})
    else:
        bucket.put_json(latest_key(run), LatestPointer(version=version, manifest=manifest_key(run, version)))
    total = sum(f.size for f in uploaded)
    log.info("published checkpoint", extra={
        "run": run, "version": version, "files": len(uploaded), "bytes": total,
        "seconds": round(time.monotonic() - t0, 3)})
    return manifest


def _guard_latest(
    bucket: Bucket, run: str, version: int, guard: Callable[[LatestPointer | None], None],
    current: LatestPointer | None,
) -> None:
    """`guard(current)`; when it refuses, take the manifest back before its error propagates."""
    try:
        guard(current)
    except BaseException:
        try:
            bucket.delete(manifest_key(run, version))
        except StoreError as exc:  # left behind: a resume finishes it only if its parent is LATEST's
            log.warning("could not delete the manifest of a version stopped before LATEST",
                        extra={"run": run, "version": version, "error": str(exc)})
        log.info("publish stopped before LATEST; manifest withdrawn", extra={"run": run, "version": version})
        raise


def _pointer_to_replace(bucket: Bucket, run: str) -> LatestPointer | None:
    """LATEST as a publish sees it. An unreadable pointer counts as absent, so the new version
    (numbered above everything in the bucket) replaces it rather than every commit failing."""
    try:
        return read_latest(bucket, run)
    except CorruptCheckpoint as exc:
        log.warning("LATEST is unreadable; the new version replaces it", extra={"run": run, "error": str(exc)})
        return None


# -- downloading -------------------------------------------------------------------------------
def _safe_paths(manifest: CheckpointManifest) -> list[PurePosixPath]:
    """Refuse manifests whose paths could escape the version folder or collide."""
    paths = []
    for f in manifest.files:
        p = PurePosixPath(f.path)
        if p.is_absolute() or not p.parts or any(part in ("", ".", "..") for part in p.parts) \
                or "\\" in f.path or p.as_posix() != f.path or f.path == MANIFEST:
            raise CorruptCheckpoint(f"manifest of {manifest.run} v{manifest.version} lists an unsafe path {f.path!r}")
        paths.append(p)
    if len(set(paths)) != len(paths):
        raise CorruptCheckpoint(f"manifest of {manifest.run} v{manifest.version} lists a file twice")
    return paths


def _is_complete(folder: Path, manifest: CheckpointManifest) -> bool:
    """A local version folder holds exactly this manifest's files at their sizes."""
    try:
        local = CheckpointManifest.model_validate_json((folder / MANIFEST).read_bytes())
    except (OSError, ValidationError):
        return False
    if (local.run, local.version, local.files) != (manifest.run, manifest.version, manifest.files):
        return False
    return all((folder / f.path).is_file() and (folder / f.path).stat().st_size == f.size
               for f in manifest.files)


def download_checkpoint(
    bucket: Bucket, manifest: CheckpointManifest, dest_root: str | Path, *, parallel: int = 4
) -> Path:
    """Download, verify and atomically install `dest_root/v000042`; return its path.

    A version already present and complete is returned without downloading. Any size or
    sha256 mismatch (or a listed file missing from the bucket) raises `ChecksumMismatch`
    naming the file; the staging folder is removed and nothing is renamed.
    """
    root = Path(dest_root)
    dest = root / version_dirname(manifest.version)
    if _is_complete(dest, manifest):
        return dest
    _safe_paths(manifest)
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f"{STAGING}{dest.name}-{uuid.uuid4().hex[:8]}"
    prefix = version_prefix(manifest.run, manifest.version)
    what = f"{manifest.run} v{manifest.version}"
    t0 = time.monotonic()

    def fetch(f: CheckpointFile) -> FileDigest:
        try:
            got = bucket.get_file(prefix + f.path, staging / f.path)
        except ObjectNotFound:
            raise ChecksumMismatch(f"{what}: {f.path!r} is listed in the manifest but missing "
                                   f"from the bucket") from None
        if got.size != f.size:
            raise ChecksumMismatch(f"{what}: {f.path!r} is {got.size} bytes, manifest says {f.size}")
        if got.sha256 != f.sha256:
            raise ChecksumMismatch(f"{what}: {f.path!r} has sha256 {got.sha256}, manifest says {f.sha256}")
        return got

    try:
        staging.mkdir()
        _parallel(fetch, manifest.files, parallel, lambda f: f"{what}: downloading {f.path!r} failed")
        (staging / MANIFEST).write_text(manifest.model_dump_json())
        _install(staging, dest, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("downloaded checkpoint", extra={
        "run": manifest.run, "version": manifest.version,
        "bytes": sum(f.size for f in manifest.files),
        "seconds": round(time.monotonic() - t0, 3)})
    return dest


def _install(staging: Path, dest: Path, manifest: CheckpointManifest) -> None:
    """Rename the verified staging folder to `dest`, replacing an incomplete one."""
    if dest.exists():
        trash = dest.with_name(f"{STAGING}trash-{dest.name}-{uuid.uuid4().hex[:8]}")
        os.replace(dest, trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(staging, dest)
    except OSError:
        # Someone else installed it between our check and our rename: theirs is as good.
        if not _is_complete(dest, manifest):
            raise


# -- retention ---------------------------------------------------------------------------------
def prune_bucket(bucket: Bucket, run: str, keep: int, *, gate: GateView | None = None,
                 partial_grace_s: float = 3600.0) -> list[int]:
    """Delete all but the newest `keep` committed versions, never the one LATEST points at;
    with a promotion gate, never what it serves nor a version it has yet to decide on
    while it would still wait for its results (shared/gate_view.py says why).

    Half-uploaded versions (no manifest) are deleted once their newest object is older
    than `partial_grace_s`, so a publish in progress is left alone. Returns what was deleted.
    """
    if keep < 1:
        raise ValueError("keep must be at least 1")
    scan = _scan(bucket, run)
    latest = read_latest(bucket, run)
    committed = sorted((v for v, (has, _) in scan.items() if has), reverse=True)
    protected = set(committed[:keep]) | ({latest.version} if latest else set())
    if gate is not None:
        waiting_since = time.time() - gate.wait_s - 60.0  # a margin for clocks and the gate's poll
        protected |= gate.serving
        protected |= {v for v in committed if v not in gate.decided and scan[v][1] >= waiting_since}
    cutoff = time.time() - partial_grace_s
    doomed = [v for v, (has, newest) in sorted(scan.items())
              if v not in protected and (has or newest < cutoff)]
    for v in doomed:
        bucket.delete(manifest_key(run, v))  # first, so no reader starts on a shrinking version
        bucket.delete_prefix(version_prefix(run, v))
    if doomed:
        log.info("pruned bucket versions", extra={"run": run, "versions": doomed})
    return doomed


def local_versions(dest_root: str | Path) -> list[int]:
    """Versions installed under `dest_root`, oldest first."""
    root = Path(dest_root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir()
                  if p.is_dir() and (m := _VERSION_DIR.fullmatch(p.name)))


def prune_local(
    dest_root: str | Path, keep: int, protect: Iterable[int] = (), *, staging_grace_s: float = 3600.0
) -> list[int]:
    """Remove local version folders but the newest `keep` and those in `protect` (e.g. the
    one the engine serves); also staging leftovers older than `staging_grace_s`."""
    if keep < 0:
        raise ValueError("keep must be >= 0")
    root = Path(dest_root)
    versions = sorted(local_versions(root), reverse=True)
    kept = set(versions[:keep]) | set(protect)
    removed = [v for v in sorted(versions) if v not in kept]
    for v in removed:
        shutil.rmtree(root / version_dirname(v), ignore_errors=True)
    cutoff = time.time() - staging_grace_s
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(STAGING) and p.stat().st_mtime < cutoff:
                shutil.rmtree(p, ignore_errors=True)
    if removed:
        log.info("pruned local versions", extra={"root": str(root), "versions": removed})
    return removed
