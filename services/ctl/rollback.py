"""`nextstate rollback VERSION`: serve an earlier version again, and make the trainer rebase on it.

A rollback is a rebase (shared/lineage.py, `request_rebase`, the same call the watcher's
promotion gate makes): it records {"base": VERSION, "at", "by": "operator"} in Redis, then
points the run's LATEST at VERSION. The watcher serves it within one poll; the trainer,
before its next step or commit, drops what it built after VERSION, reloads VERSION's
weights and optimizer state, and numbers its next version above every version ever used
(its manifest names VERSION as its parent). Versions without a committed manifest are
refused. Should Redis not answer, LATEST still moves and the trainer follows LATEST.

`--list` shows every committed version with its parent, LATEST, and the last rebase asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
from typing import Any

from redis.exceptions import RedisError

from services.ctl.common import settings_from
from shared import checkpoints as ckpt
from shared.errors import NextstateError
from shared.lineage import RebaseRecord, read_record, request_rebase
from shared.settings import Settings
from shared.store import AsyncBucket, Bucket
from shared.streams import Bus


def register(sub: Any) -> None:
    p = sub.add_parser("rollback", help="serve an earlier checkpoint version; the trainer rebases on it")
    p.add_argument("version", type=int, nargs="?", help="the version to serve and build on")
    p.add_argument("--run", help="run name (default NEXTSTATE_RUN)")
    p.add_argument("--list", action="store_true", help="list published versions, their parents and LATEST")
    p.set_defaults(func=rollback)


def rollback(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    run = args.run or settings.run
    if args.list or args.version is None:
        return asyncio.run(_list(settings, run))
    return asyncio.run(_rollback(settings, run, args.version))


async def _rollback(settings: Settings, run: str, version: int) -> int:
    async with AsyncBucket(settings.bucket) as bucket, Bus(settings) as bus:
        done = await request_rebase(bucket, bus.redis, bus.keys, run, version, by="operator")
    before = f"v{done.previous.version}" if done.previous else "nothing"
    print(f"run {run}: LATEST -> v{done.pointer.version} (was {before}); the watcher reloads it on its next poll")
    if done.recorded:
        print(f"rebase on v{version} recorded: before its next step the trainer drops what it built after "
              f"v{version}, reloads v{version}'s weights and optimizer state, and numbers its next version "
              f"above every version so far (parent v{version})")
    else:
        print(f"warning: the rebase could not be recorded in Redis ({done.error}); the trainer still "
              f"follows LATEST moving back")
    return 0


async def _list(settings: Settings, run: str) -> int:
    with Bucket(settings.bucket) as bucket:
        latest = ckpt.read_latest(bucket, run)
        versions = ckpt.list_versions(bucket, run)
        parents = {v: _parent(bucket, run, v) for v in versions}
    current = latest.version if latest else None
    print(f"run {run}: {len(versions)} version(s); LATEST -> {f'v{current}' if current is not None else '-'}")
    for v in versions:
        mark = "   <- LATEST" if v == current else ""
        print(f"  v{v}{mark:<14}parent {parents[v]}")
    record = await _record(settings)
    if record is not None:
        when = dt.datetime.fromtimestamp(record.at).strftime("%Y-%m-%d %H:%M:%S")
        print(f"last rebase asked for: v{record.base} by {record.by} at {when}")
    return 0


def _parent(bucket: Bucket, run: str, version: int) -> str:
    try:
        parent = ckpt.read_manifest(bucket, ckpt.manifest_key(run, version)).parent
    except NextstateError:
        return "?"
    return "?" if parent is None else "base" if parent == 0 else f"v{parent}"


async def _record(settings: Settings) -> RebaseRecord | None:
    """The last rebase asked for (best effort: --list works without Redis)."""
    try:
        async with Bus(settings) as bus:
            return await read_record(bus.redis, bus.keys)
    except (RedisError, NextstateError):
        return None
