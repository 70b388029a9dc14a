"""`nextstate up`'s side of "a run belongs to one base model" (shared/runs.py).

Before anything starts, the run's record in `up`'s home (`<home>/up/<run>/run.json`) is
compared with the model asked for; once Redis and the bucket answer, so are the
bucket's `policies/<run>/RUN.json` and the Redis prefix's owner (`keys.run_owner`). A
mismatch anywhere refuses the start with a message naming both models and how to
start a new run. On success the home record is written (the trainer claims the
bucket's, the buffer the prefix's, when they start).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from shared.errors import ObjectNotFound, StoreError
from shared.keys import Keys
from shared.runs import RunMismatch, RunRecord, check, read_run
from shared.settings import Settings
from shared.store import Bucket

HOME_RECORD = "run.json"


def check_home(root: Path, wanted: RunRecord) -> None:
    path = root / HOME_RECORD
    try:
        existing = RunRecord.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return
    check(existing, wanted, f"in {root}")


def write_home(root: Path, wanted: RunRecord) -> None:
    root.mkdir(parents=True, exist_ok=True)
    path = root / HOME_RECORD
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(wanted.model_dump_json())
        os.replace(tmp, path)


async def check_stack(settings: Settings, wanted: RunRecord) -> None:
    """The bucket's record of the run and the Redis prefix's owner, against `wanted`."""
    def in_bucket() -> RunRecord | None:
        with Bucket(settings.bucket) as bucket:
            try:
                return read_run(bucket, wanted.run)
            except (ObjectNotFound, StoreError):
                return None

    existing = await asyncio.to_thread(in_bucket)
    if existing is not None:
        check(existing, wanted, f"bucket {settings.bucket.name} at {settings.bucket.endpoint}")
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(settings.redis.url, socket_timeout=5, socket_connect_timeout=5,
                                     decode_responses=True)
    try:
        owner = await client.get(Keys(settings.redis.prefix).run_owner)
    finally:
        await client.aclose()
    if owner is None:
        return
    try:
        theirs = json.loads(owner)
    except ValueError:
        return
    if theirs.get("run") != wanted.run:
        raise RunMismatch(
            f"Redis prefix {settings.redis.prefix!r} holds the turns of run {theirs.get('run')!r}, "
            f"not {wanted.run!r}: give this run its own prefix (NEXTSTATE_REDIS__PREFIX) or go on "
            f"with run {theirs.get('run')!r}")
