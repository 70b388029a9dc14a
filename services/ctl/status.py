"""`nextstate status`: is the loop flowing? Per stream and group, at a glance.

For each stream: length and shed count; for each consumer group: pending (delivered,
not acked), lag (not yet delivered), consumers and how long each has been idle; the
dead-letter count; the policy version the engine serves and the trainer's newest.
A stage is named *stalled* when it has work (lag or pending) and nothing was acked
over the sampling window (`--window`, default 2 s): its backlog stays put or grows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from redis.exceptions import RedisError

from services.ctl.common import human_ms, open_bus, redis_error
from shared import keys as K
from shared.streams import Bus


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="streams, consumer groups, lag, dead letters, versions")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--window", type=float, default=2.0,
                   help="seconds between two samples used to spot a stalled stage (0: one sample)")
    p.set_defaults(func=lambda a: asyncio.run(status(a)))


async def snapshot(bus: Bus) -> dict[str, Any]:
    streams = [await bus.stream_info(name) for name in K.STREAMS]
    serving, trained = await bus.redis.mget(bus.keys.policy_version, bus.keys.trainer_version)
    return {
        "prefix": bus.keys.prefix,
        "streams": streams,
        "dead_letters": next(s["length"] for s in streams if s["stream"] == K.DEAD),
        "policy_version": None if serving is None else int(serving),
        "trainer_version": None if trained is None else int(trained),
    }


def _acked(group: dict[str, Any]) -> int:
    """Entries this group has read and acknowledged so far (entries-read minus pending)."""
    read = group.get("entries_read")
    return (int(read) if read is not None else 0) - int(group["pending"])


def mark_stalls(before: dict[str, Any], after: dict[str, Any], window_s: float) -> None:
    """Flag each group that has a backlog yet acknowledged nothing between the samples."""
    prev = {(s["stream"], g["name"]): g for s in before["streams"] for g in s["groups"]}
    stalled = []
    for s in after["streams"]:
        for g in s["groups"]:
            p = prev.get((s["stream"], g["name"]))
            backlog = (g["lag"] or 0) + g["pending"]
            acked = None if p is None else _acked(g) - _acked(p)
            g["acked_in_window"] = acked
            g["stalled"] = bool(p is not None and backlog > 0 and acked == 0)
            if g["stalled"]:
                stalled.append(f"{s['stream']}/{g['name']}")
    after["window_s"] = window_s
    after["stalled"] = stalled


def render(snap: dict[str, Any]) -> str:
    lines = [f"prefix {snap['prefix']}   serving policy v{snap['policy_version'] if snap['policy_version'] is not None else '-'}"
             f"   trainer v{snap['trainer_version'] if snap['trainer_version'] is not None else '-'}"]
    for s in snap["streams"]:
        shed = f"  shed {s['shed']}" if s["shed"] else ""
        lines.append(f"{s['stream']:<12} length {s['length']:>7}{shed}")
        for g in s["groups"]:
            flag = "  STALLED: backlog and no acks" if g.get("stalled") else ""
            rate = ""
            if g.get("acked_in_window") is not None and snap.get("window_s"):
                rate = f"  acked {g['acked_in_window'] / snap['window_s']:.1f}/s"
            lines.append(f"  group {g['name']:<9} pending {g['pending']:>6}  lag {g['lag'] if g['lag'] is not None else '?':>6}"
                         f"  consumers {len(g['consumers'])}{rate}{flag}")
            for c in g["consumers"]:
                lines.append(f"    {c['name']:<40} pending {c['pending']:>5}  idle {human_ms(c['idle_ms'])}")
    lines.append(f"dead letters: {snap['dead_letters']}" + ("  (nextstate dlq list)" if snap["dead_letters"] else ""))
    if snap.get("stalled"):
        lines.append("stalled: " + ", ".join(snap["stalled"]))
    return "\n".join(lines)


async def status(args: argparse.Namespace) -> int:
    bus = open_bus(args)
    try:
        snap = await snapshot(bus)
        if args.window > 0:
            await asyncio.sleep(args.window)
            later = await snapshot(bus)
            mark_stalls(snap, later, args.window)
            snap = later
    except RedisError as exc:
        raise redis_error(exc, bus.settings) from exc
    finally:
        await bus.aclose()
    print(json.dumps(snap, indent=2) if args.json else render(snap))
    return 0
