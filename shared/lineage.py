"""A rollback is a rebase: the record of the version the trainer must build on next.

`nextstate rollback K` (services/ctl/rollback.py) and the watcher's promotion gate ask
for one the same way, `request_rebase`:

    1. check that version K is committed (a manifest that names it)
    2. SET `keys.lineage` = {"base": K, "at": <unix time>, "by": "operator" | "gate"}
    3. point LATEST at K (`set_latest`): the watcher serves K on its next poll

The trainer looks at the record and at LATEST before every step and every commit
(services/trainer/rebase.py). On a new record — or a LATEST moved below its newest
version by hand, after its last commit — it drops what it built after K, reloads K's
weights and optimizer state, and numbers its next version above every number ever used,
with `parent` K in the manifest. The record comes first so that a trainer seeing LATEST
move back already finds why; a Redis that does not answer only loses the record
(`Rebase.recorded` False): LATEST still moves and the trainer follows LATEST.

The record stays in Redis (it is the last rebase asked for, not a queue): the trainer
follows each new value once, whoever wrote it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from redis.exceptions import RedisError

from shared.checkpoints import manifest_key, read_latest, read_manifest, set_latest
from shared.errors import CorruptCheckpoint, MalformedMessage, StoreError
from shared.keys import Keys
from shared.schemas import LatestPointer, describe
from shared.store import AsyncBucket

log = logging.getLogger(__name__)

By = Literal["operator", "gate"]


class RebaseRecord(BaseModel):
    """`keys.lineage`: the version the trainer must build on next, when and by whom."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    base: int = Field(ge=0)
    at: float
    by: By


@dataclass(frozen=True)
class Rebase:
    """What `request_rebase` did."""

    record: RebaseRecord
    pointer: LatestPointer  # LATEST as written
    previous: LatestPointer | None  # LATEST before (None: none, or unreadable)
    recorded: bool  # False: Redis did not take the record (the trainer follows LATEST)
    error: str = ""  # why not


async def request_rebase(
    bucket: AsyncBucket, redis: Any, keys: Keys, run: str, version: int, *, by: By
) -> Rebase:
    """Record a rebase onto `version` in Redis, then point LATEST at it.

    Raises `NoCheckpoint` / `CorruptCheckpoint` / `StoreError` when `version` has no valid
    manifest or the bucket does not answer (then nothing was changed). A Redis error is
    not raised: LATEST still moves and the result says the record is missing.
    """
    key = manifest_key(run, version)
    manifest = await bucket.run(read_manifest, bucket.sync, key)
    if (manifest.run, manifest.version) != (run, version):
        raise StoreError(f"{key} describes run {manifest.run!r} v{manifest.version}, not this one")
    try:
        previous = await bucket.run(read_latest, bucket.sync, run)
    except CorruptCheckpoint:
        previous = None
    record = RebaseRecord(base=version, at=time.time(), by=by)
    recorded, error = True, ""
    try:
        await redis.set(keys.lineage, record.model_dump_json())
    except RedisError as exc:
        recorded, error = False, f"{type(exc).__name__}: {exc}"
        log.warning("could not record the rebase in Redis; the trainer still follows LATEST",
                    extra={"run": run, "version": version, "error": error})
    pointer = await bucket.run(set_latest, bucket.sync, run, version)
    log.info("rebase requested", extra={
        "run": run, "version": version, "by": by, "recorded": recorded,
        "previous": previous.version if previous else None})
    return Rebase(record=record, pointer=pointer, previous=previous, recorded=recorded, error=error)


def parse_record(raw: str | bytes | None) -> RebaseRecord | None:
    """The record from its JSON, None when absent; `MalformedMessage` when it is not a record
    (a reader never follows it)."""
    if raw is None:
        return None
    try:
        return RebaseRecord.model_validate_json(raw)
    except ValidationError as exc:
        raise MalformedMessage(f"the rebase record is not valid: {describe(exc)}") from None


async def read_record(redis: Any, keys: Keys) -> RebaseRecord | None:
    """The last rebase asked for, or None (RedisError and MalformedMessage propagate)."""
    return parse_record(await redis.get(keys.lineage))
