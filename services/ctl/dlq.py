"""`nextstate dlq list|requeue|drop`: look at dead letters, send them back, or discard them.

`requeue` re-adds the original message, verbatim, to the stream it died on (its group
will see it as new) and removes the dead letter; `drop` removes it. Both take entry ids
of the dead stream, or `--all`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from redis.exceptions import RedisError

from services.ctl.common import entry_time, open_bus, redis_error
from shared import keys as K
from shared.errors import MalformedMessage
from shared.schemas import DeadLetter
from shared.streams import Bus


def register(sub: Any) -> None:
    p = sub.add_parser("dlq", help="dead letters: list, requeue, drop")
    dsub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = dsub.add_parser("list", help="show dead letters with their errors")
    ls.add_argument("--json", action="store_true")
    ls.add_argument("-n", "--limit", type=int, default=100)
    for name, help_ in (("requeue", "send back to their stream"), ("drop", "delete for good")):
        a = dsub.add_parser(name, help=help_)
        a.add_argument("ids", nargs="*", metavar="ENTRY_ID", help="entry ids in the dead stream")
        a.add_argument("--all", action="store_true", help="every dead letter")
    p.set_defaults(func=lambda a: asyncio.run(dlq(a)))


async def _letters(bus: Bus, ids: list[str] | None, limit: int = 10_000) -> list[tuple[str, DeadLetter | None]]:
    if ids:
        rows = []
        for entry_id in ids:
            rows += await bus.redis.xrange(bus.keys.dead, entry_id, entry_id)
    else:
        rows = await bus.redis.xrange(bus.keys.dead, count=limit)
    out: list[tuple[str, DeadLetter | None]] = []
    for entry_id, fields in rows:
        try:
            out.append((entry_id, DeadLetter.from_json(fields.get(K.FIELD, ""))))
        except MalformedMessage:
            out.append((entry_id, None))
    return out


async def dlq(args: argparse.Namespace) -> int:
    bus = open_bus(args)
    try:
        if args.action == "list":
            letters = await _letters(bus, None, args.limit)
            if args.json:
                print(json.dumps([{"dead_entry_id": e, "letter": d.model_dump() if d else None} for e, d in letters], indent=2))
            elif not letters:
                print("no dead letters")
            for entry_id, d in letters if not args.json else []:
                if d is None:
                    print(f"{entry_time(entry_id)} {entry_id}  (unreadable dead letter)")
                else:
                    print(f"{entry_time(entry_id)} {entry_id}  {d.stream}/{d.group} deliveries={d.deliveries} "
                          f"consumer={d.consumer}\n    error: {d.error[:300]}")
            return 0
        if not args.all and not args.ids:
            print("give entry ids or --all")
            return 2
        letters = await _letters(bus, None if args.all else args.ids)
        done = 0
        for entry_id, d in letters:
            if args.action == "requeue":
                if d is None or d.stream not in K.STREAMS:
                    print(f"{entry_id}: cannot requeue (unknown origin); drop it instead")
                    continue
                await bus.publish_raw(d.stream, d.data)
            await bus.redis.xdel(bus.keys.dead, entry_id)
            done += 1
        print(f"{args.action}: {done} dead letter(s)")
        return 0
    except RedisError as exc:
        raise redis_error(exc, bus.settings) from exc
    finally:
        await bus.aclose()
