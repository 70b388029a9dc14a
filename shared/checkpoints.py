"""The checkpoint protocol on the bucket (docs/design.md#the-checkpoint-protocol), and every bucket key.

Writers publish files first, `manifest.json` second, `LATEST` last, so a reader that
follows `LATEST` never sees a partial version. Readers download into a staging folder
next to the destination, check every file's size and sha256 against the manifest, and
only then rename the folder into place: a bad download leaves nothing behind.

A version's files are a full HF folder or a PEFT adapter (the manifest's `format`). A file
may be stored as a delta against the same file of an earlier version (`encoded`,
shared/deltas.py): the reader installs that version first (from its local copy, else the
bucket, down the chain to the full snapshot it starts from), rebuilds the file in staging
and checks the rebuilt file's sha256 like any other before anything is renamed. A delta
that is missing or corrupt, or whose base is gone, raises `BrokenDelta`: the version is
refused, never installed wrong. Retention keeps every version a kept one builds on.

    policies/<run>/v000042/…                 model files (shards, config, tokenizer), an
                                             adapter, or deltas (`*.xor.zst`)
    policies/<run>/v000042/manifest.json     CheckpointManifest
    policies/<run>/LATEST                    LatestPointer
    policies/<run>/RUN.json                  RunRecord: the run's base model (shared/runs.py)
    trainer-state/<run>/…                    each version's record; resume states (optimizer, RNG,
                                             step) at their own cadence (docs/design.md#resume-and-rollback)
    evals/<run>/v000042/<suite>.json         EvalResult of each suite on that version
    samples/<run>/…                          archived samples

Everything here is blocking; asyncio code calls it through `AsyncBucket.run`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TypeVar

from pydantic import ValidationError

from shared import deltas
from shared.errors import (
    BrokenDelta,
    ChecksumMismatch,
    CorruptCheckpoint,
    NoCheckpoint,
    ObjectNotFound,
    StoreError,
)
from shared.gate_view import GateView
from shared.schemas import (
    AdapterSpec,
    CheckpointFile,
    CheckpointManifest,
    EncodedFile,
    LatestPointer,
    WeightFormat,
    describe,
)
from shared.store import Bucket, FileDigest

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "LATEST"
RUN = "RUN.json"
STAGING = ".staging-"
MAX_CHAIN = 64  # deltas a reader follows before it gives up on a version (a loop, a bad writer)
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


def digest_file(path: Path) -> FileDigest:
    """(blocking) The size and sha256 of a local file, read once."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            size += len(block)
    return FileDigest(size, h.hexdigest())


@dataclass(frozen=True)
class Delta:
    """A file of the folder to publish as a delta instead (its delta already written to
    `path`, by `deltas.encode` against `base_version`'s copy of the same file)."""

    of: str  # the file's path in the folder
    path: Path  # the delta, on local disk
    base_version: int
    base_sha256: str


@dataclass(frozen=True)
class Layout:
    """What a version's files are, for its manifest (CheckpointManifest says each field)."""

    format: WeightFormat = "full"
    dtype: str | None = None
    base_fingerprint: str = ""
    adapter: AdapterSpec | None = None
    deltas: tuple[Delta, ...] = ()
    snapshot: int | None = None  # the full version the deltas' chain starts from


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
    layout: Layout | None = None,
) -> CheckpointManifest:
    """Upload every file of `src_dir` (sha256 computed while reading), then the manifest,
    then LATEST. If any upload fails, LATEST is untouched and the error names the file.

    `layout` describes the files (format, dtype, the base model's identity, an adapter's
    spec); its `deltas` are files uploaded as their delta (the manifest lists the file's
    own size and sha256, hashed here, and the delta object's under `encoded`).

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
    lay = layout or Layout()
    prefix = version_prefix(run, version)
    files = _source_files(src)
    by_file = {d.of: d for d in lay.deltas}
    if unknown := sorted(by_file.keys() - set(files)):
        raise StoreError(f"publishing {run} v{version}: deltas of files the folder does not hold: {unknown}")
    t0 = time.monotonic()

    def upload(rel: str) -> tuple[CheckpointFile, EncodedFile | None]:
        d = by_file.get(rel)
        if d is None:
            got = bucket.put_file(prefix + rel, src / rel)
            return CheckpointFile(path=rel, size=got.size, sha256=got.sha256), None
        own = digest_file(src / rel)
        name = rel + deltas.SUFFIX
        sent = bucket.put_file(prefix + name, d.path)
        return (CheckpointFile(path=rel, size=own.size, sha256=own.sha256),
                EncodedFile(path=name, size=sent.size, sha256=sent.sha256, of=rel,
                            base_version=d.base_version, base_sha256=d.base_sha256))

    done = _parallel(upload, files, parallel,
                     lambda rel: f"publishing {run} v{version}: uploading {rel!r} failed "
                                 f"(LATEST not moved)")
    if guard is not None:
        guard(_pointer_to_replace(bucket, run))
    manifest = CheckpointManifest(
        run=run, version=version, step=step, base_model=base_model, parent=parent,
        files=[f for f, _ in done], consumed_batch_ids=list(consumed_batch_ids),
        metrics=dict(metrics or {}), format=lay.format, dtype=lay.dtype,
        base_fingerprint=lay.base_fingerprint, adapter=lay.adapter,
        encoded=[e for _, e in done if e is not None], snapshot=lay.snapshot if lay.deltas else None,
    )  # fmt: skip
    bucket.put_json(manifest_key(run, version), manifest)
    current = _pointer_to_replace(bucket, run)
    if guard is not None:
        _guard_latest(bucket, run, version, guard, current)
    if current is not None and current.version > version:
        log.warning("LATEST already at a newer version; not moving it back",
                    extra={"run": run, "version": version, "latest": current.version})
    else:
        bucket.put_json(latest_key(run), LatestPointer(version=version, manifest=manifest_key(run, version)))
    log.info("published checkpoint", extra={
        "run": run, "version": version, "files": len(done), "format": manifest.format,
        "bytes": sum(f.size for f in manifest.stored()), "deltas": len(manifest.encoded),
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
    for f in [*manifest.files, *(CheckpointFile(path=e.path, size=e.size, sha256=e.sha256)
                                for e in manifest.encoded)]:
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
    bucket: Bucket, manifest: CheckpointManifest, dest_root: str | Path, *, parallel: int = 4,
    _depth: int = 0,
) -> Path:
    """Download, verify and atomically install `dest_root/v000042`; return its path.

    A version already present and complete is returned without downloading. Any size or
    sha256 mismatch (or a listed file missing from the bucket) raises `ChecksumMismatch`
    naming the file; the staging folder is removed and nothing is renamed. A file stored as
    a delta is rebuilt on the same file of the version it builds on, which is installed
    first under `dest_root` (`BrokenDelta` when that cannot be done, or the rebuilt file is
    not the manifest's).
    """
    root = Path(dest_root)
    dest = root / version_dirname(manifest.version)
    if _is_complete(dest, manifest):
        return dest
    _safe_paths(manifest)
    what = f"{manifest.run} v{manifest.version}"
    if _depth > MAX_CHAIN:
        raise BrokenDelta(f"{what}: a chain of more than {MAX_CHAIN} deltas; a reader does not follow it")
    bases = {e.base_version: _base_folder(bucket, manifest, e.base_version, root, parallel, _depth)
             for e in manifest.encoded}
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f"{STAGING}{dest.name}-{uuid.uuid4().hex[:8]}"
    prefix = version_prefix(manifest.run, manifest.version)
    encoded = {e.path for e in manifest.encoded}
    t0 = time.monotonic()

    def fetch(f: CheckpointFile) -> FileDigest:
        try:
            got = bucket.get_file(prefix + f.path, staging / f.path)
        except ObjectNotFound:
            kind = BrokenDelta if f.path in encoded else ChecksumMismatch
            raise kind(f"{what}: {f.path!r} is listed in the manifest but missing from the bucket") from None
        if got.size != f.size or got.sha256 != f.sha256:
            kind = BrokenDelta if f.path in encoded else ChecksumMismatch
            said = (f"is {got.size} bytes, manifest says {f.size}" if got.size != f.size
                    else f"has sha256 {got.sha256}, manifest says {f.sha256}")
            raise kind(f"{what}: {f.path!r} {said}")
        return got

    try:
        staging.mkdir()
        _parallel(fetch, manifest.stored(), parallel, lambda f: f"{what}: downloading {f.path!r} failed")
        for e in manifest.encoded:
            _rebuild(staging, e, bases[e.base_version], manifest)
        (staging / MANIFEST).write_text(manifest.model_dump_json())
        _install(staging, dest, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("downloaded checkpoint", extra={
        "run": manifest.run, "version": manifest.version,
        "bytes": sum(f.size for f in manifest.stored()), "deltas": len(manifest.encoded),
        "seconds": round(time.monotonic() - t0, 3)})
    return dest


def _base_folder(bucket: Bucket, manifest: CheckpointManifest, base: int, root: Path, parallel: int,
                 depth: int) -> Path:
    """The installed folder of `base`, which a delta of `manifest` builds on (installing it
    from the bucket if need be); `BrokenDelta` when it cannot be had."""
    what = f"{manifest.run} v{manifest.version}"
    try:
        local = CheckpointManifest.model_validate_json((root / version_dirname(base) / MANIFEST).read_bytes())
    except (OSError, ValidationError):
        local = None
    try:
        base_manifest = local if local is not None and _is_complete(root / version_dirname(base), local) \
            else read_manifest(bucket, manifest_key(manifest.run, base))
        if (base_manifest.run, base_manifest.version) != (manifest.run, base):
            raise CorruptCheckpoint(f"the manifest of v{base} describes {base_manifest.run} "
                                    f"v{base_manifest.version}")
        return download_checkpoint(bucket, base_manifest, root, parallel=parallel, _depth=depth + 1)
    except BrokenDelta as exc:
        raise BrokenDelta(f"{what} builds on v{base}, which cannot be rebuilt: {exc}") from None
    except (NoCheckpoint, CorruptCheckpoint, ChecksumMismatch) as exc:
        raise BrokenDelta(f"{what} builds on v{base}, which does not verify: {exc}") from None


def _rebuild(staging: Path, e: EncodedFile, base: Path, manifest: CheckpointManifest) -> None:
    """Decode `e` in `staging` onto `base`'s copy of its file, and check the result against
    the manifest (a base whose file is not the one the delta was made on is discarded, so
    the next try installs it again)."""
    what = f"{manifest.run} v{manifest.version}"
    want = next(f for f in manifest.files if f.path == e.of)
    delta, out = staging / e.path, staging / e.of
    try:
        deltas.decode(delta, base / e.of, out, want.size)
    except (deltas.DeltaError, OSError) as exc:
        raise BrokenDelta(f"{what}: {e.of!r} cannot be rebuilt from {e.path!r}: {exc}") from None
    delta.unlink()
    got = digest_file(out)
    if got.sha256 == want.sha256:
        return
    if digest_file(base / e.of).sha256 != e.base_sha256:
        shutil.rmtree(base, ignore_errors=True)
        raise BrokenDelta(f"{what}: the local copy of v{e.base_version}'s {e.of!r} is not the one its "
                          "delta was made on (removed: the next try installs it again)")
    raise BrokenDelta(f"{what}: {e.of!r} rebuilt from its delta has sha256 {got.sha256}, the manifest "
                      f"says {want.sha256}")


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
    than `partial_grace_s`, so a publish in progress is left alone. Every version a kept
    one builds on (its deltas' bases, down to their snapshot) is kept too. Returns what was
    deleted.
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
    protected |= _chain_bases(bucket, run, protected & set(committed))
    cutoff = time.time() - partial_grace_s
    doomed = [v for v, (has, newest) in sorted(scan.items())
              if v not in protected and (has or newest < cutoff)]
    for v in doomed:
        bucket.delete(manifest_key(run, v))  # first, so no reader starts on a shrinking version
        bucket.delete_prefix(version_prefix(run, v))
    if doomed:
        log.info("pruned bucket versions", extra={"run": run, "versions": doomed})
    return doomed


def _chain_bases(bucket: Bucket, run: str, versions: set[int]) -> set[int]:
    """Every version the deltas of `versions` build on, transitively (an unreadable
    manifest adds nothing: that version cannot be rebuilt anyway)."""
    found: set[int] = set()
    todo = list(versions)
    while todo and len(found) <= 10 * MAX_CHAIN:
        try:
            manifest = read_manifest(bucket, manifest_key(run, todo.pop()))
        except (NoCheckpoint, CorruptCheckpoint):
            continue
        for e in manifest.encoded:
            if e.base_version not in found and e.base_version not in versions:
                found.add(e.base_version)
                todo.append(e.base_version)
    return found


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
