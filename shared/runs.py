"""A run belongs to one base model: its identity, recorded once, checked by everyone after.

The first trainer of a run writes `policies/<run>/RUN.json` (`RunRecord`: the base
model's folder and a fingerprint of its contents); `nextstate up` keeps the same record
in its home and checks both before it starts anything. A later start on another base
model is refused with `RunMismatch`, whose message names both models and how to start a
new run — so a run's checkpoints are never served on, nor trained from, another model,
and its pending turns never train another run.

The fingerprint is a sha256 over the files that make the model what it is: config.json,
the tokenizer files and every weight file, by name and content (a fine-tuned copy of
the same architecture differs; a copy of the same folder elsewhere does not).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from shared.checkpoints import run_key
from shared.errors import NextstateError, ObjectNotFound
from shared.store import Bucket

IDENTITY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                  "special_tokens_map.json", "chat_template.jinja")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


class RunMismatch(NextstateError):
    """This run was started from another base model."""


class RunRecord(BaseModel):
    run: str
    base_model: str  # the folder (or hub id) it was started from, for people to read
    fingerprint: str  # what is compared
    created_at: float = Field(default_factory=time.time)


def model_fingerprint(model: str | Path) -> str:
    """sha256 over the identity files and weights of an HF folder (a hub id: its name)."""
    folder = Path(model)
    if not folder.is_dir():
        return "name:" + str(model)
    h = hashlib.sha256()
    names = sorted(p.name for p in folder.iterdir()
                   if p.is_file() and (p.name in IDENTITY_FILES or p.suffix in WEIGHT_SUFFIXES))
    for name in names:
        h.update(name.encode() + b"\0")
        with open(folder / name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()


def record_for(run: str, model: str | Path) -> RunRecord:
    return RunRecord(run=run, base_model=str(model), fingerprint=model_fingerprint(model))


def check(existing: RunRecord, wanted: RunRecord, where: str) -> None:
    """Raise `RunMismatch` unless `wanted` is the same base model as `existing`."""
    if existing.fingerprint == wanted.fingerprint:
        return
    raise RunMismatch(
        f"run {existing.run!r} ({where}) was trained from {existing.base_model} "
        f"({existing.fingerprint[:19]}…), not {wanted.base_model} ({wanted.fingerprint[:19]}…). "
        f"Its checkpoints and pending turns belong to that model. To train {wanted.base_model}, "
        f"start a new run: NEXTSTATE_RUN=<new name> (or `nextstate up --run <new name>`); "
        f"to go on with the old run, start it with its own model."
    )


def read_run(bucket: Bucket, run: str) -> RunRecord | None:
    try:
        data = bucket.get_bytes(run_key(run))
    except ObjectNotFound:
        return None
    try:
        return RunRecord.model_validate_json(data)
    except ValidationError:
        return None  # unreadable: treated as unclaimed, the next claim rewrites it


def claim_run(bucket: Bucket, wanted: RunRecord) -> RunRecord:
    """The run's record in the bucket: written if there is none, checked if there is."""
    existing = read_run(bucket, wanted.run)
    if existing is not None:
        check(existing, wanted, f"bucket {bucket.name}")
        return existing
    bucket.put_json(run_key(wanted.run), wanted)
    return wanted
