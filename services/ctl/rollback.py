"""`nextstate rollback VERSION`: point the run's LATEST at an earlier published version.

The watcher follows LATEST wherever it points, so the engine is back on that version
within one poll. Versions without a committed manifest are refused. `--list` shows
what can be rolled back to.
"""

from __future__ import annotations

import argparse
from typing import Any

from services.ctl.common import settings_from
from shared import checkpoints as ckpt
from shared.store import Bucket


def register(sub: Any) -> None:
    p = sub.add_parser("rollback", help="point LATEST at an earlier checkpoint version")
    p.add_argument("version", type=int, nargs="?", help="the version to serve")
    p.add_argument("--run", help="run name (default NEXTSTATE_RUN)")
    p.add_argument("--list", action="store_true", help="list published versions and LATEST")
    p.set_defaults(func=rollback)


def rollback(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    run = args.run or settings.run
    with Bucket(settings.bucket) as bucket:
        latest = ckpt.read_latest(bucket, run)
        if args.list or args.version is None:
            versions = ckpt.list_versions(bucket, run)
            current = latest.version if latest else None
            print(f"run {run}: {len(versions)} version(s); LATEST -> {current if current is not None else '-'}")
            for v in versions:
                print(f"  v{v}{'   <- LATEST' if v == current else ''}")
            return 0
        pointer = ckpt.set_latest(bucket, run, args.version)
        before = f"v{latest.version}" if latest else "nothing"
        print(f"run {run}: LATEST -> v{pointer.version} (was {before}); the watcher reloads it on its next poll")
    return 0
