"""`nextstate tail STREAM`: one readable line per message, or the raw JSON.

Lines show time, type, id and the fields that matter for debugging the loop (session,
reward, votes, versions…), never conversation text: `--raw` prints the whole message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from redis.exceptions import RedisError

from services.ctl.common import entry_time, open_bus, redis_error, since_to_id
from shared import keys as K
from shared.errors import MalformedMessage
from shared.schemas import (
    CheckpointPublished,
    DeadLetter,
    EvalResult,
    Message,
    PolicyLoaded,
    Promotion,
    Replay,
    ScoredTurn,
    TrainBatch,
    Turn,
    parse_message,
)


def register(sub: Any) -> None:
    p = sub.add_parser("tail", help="print a stream's messages, one line each")
    p.add_argument("stream", choices=K.STREAMS, metavar="STREAM", help=" | ".join(K.STREAMS))
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new messages")
    p.add_argument("--raw", action="store_true", help="print each message's JSON")
    p.add_argument("--since", type=since_to_id, help="from an entry id or an age (30s, 5m, 2h)")
    p.add_argument("-n", "--lines", type=int, default=10, help="how many recent messages (default 10)")
    p.set_defaults(func=lambda a: asyncio.run(tail(a)))


def _roles(messages: list[dict[str, Any]] | None) -> str:
    if messages is None:
        return "-"
    roles = [str(m.get("role", "?")) for m in messages]
    out: list[str] = []
    for r in roles:
        if out and out[-1].split("×")[0] == r:
            n = int(out[-1].split("×")[1]) + 1 if "×" in out[-1] else 2
            out[-1] = f"{r}×{n}"
        else:
            out.append(r)
    return ",".join(out) or "-"


def summarize(msg: Message) -> str:
    """The key fields of a message, as `k=v` pairs."""
    if isinstance(msg, Turn):
        calls = len(msg.response.get("tool_calls") or [])
        return (f"session={msg.session_id} idx={msg.turn_index} {msg.turn_type} "
                f"prompt={len(msg.prompt_ids)}t response={len(msg.response_ids)}t"
                f"{f' tool_calls={calls}' if calls else ''} wv={msg.weight_version} "
                f"next={_roles(msg.next_state)} closed_by={msg.closed_by}"
                f"{f' group={msg.group_id}[{msg.group_index}/{msg.group_size}]' if msg.grouped else ''}")
    if isinstance(msg, ScoredTurn):
        votes = ",".join("?" if v.score is None else f"{v.score:+g}" for v in msg.votes)
        return (f"turn={msg.turn.id} session={msg.turn.session_id} reward={msg.reward:+g} "
                f"votes=[{votes}] judge={msg.judge} mode={msg.mode}"
                f"{' unjudged' if not msg.judged else ''}{' hint' if msg.hint else ''}"
                f"{f' experience={len(msg.experience_ids)}' if msg.experience_ids else ''}"
                f"{' teacher' if msg.teacher_logprobs is not None else ''}")
    if isinstance(msg, TrainBatch):
        n = len(msg.samples)
        tokens = sum(len(s.tokens) for s in msg.samples)
        mean = sum(s.reward for s in msg.samples) / n
        versions = sorted({s.policy_version for s in msg.samples})
        return f"samples={n} tokens={tokens} reward_mean={mean:+.2f} policy_versions={versions}"
    if isinstance(msg, CheckpointPublished):
        loss = msg.metrics.get("loss")
        return (f"run={msg.run} version={msg.version} step={msg.step}"
                f"{f' loss={loss:.4f}' if loss is not None else ''} manifest={msg.manifest}")
    if isinstance(msg, PolicyLoaded):
        sync = f" sync={msg.sync_s:.2f}s" if msg.sync_s is not None else ""
        gate = f" promotion={msg.promotion[:160]!r}" if msg.promotion else ""
        return f"run={msg.run} version={msg.version} load={msg.load_s:.2f}s{sync} engine={msg.engine}{gate}"
    if isinstance(msg, EvalResult):
        ci = f" ci=[{msg.ci_low:.4g},{msg.ci_high:.4g}]" if msg.ci_low is not None and msg.ci_high is not None else ""
        return (f"run={msg.run} version={msg.version} suite={msg.suite} score={msg.score:.4g}{ci} "
                f"n={msg.n} {'higher' if msg.higher_is_better else 'lower'}-is-better "
                f"took={msg.duration_s:.1f}s")
    if isinstance(msg, Promotion):
        serving = "-" if msg.serving is None else msg.serving
        tests = "".join(f" {suite}={t.test}" + (f":p={t.p_value:.3g}" if t.p_value is not None else "")
                        for suite, t in sorted(msg.tests.items()))
        return (f"run={msg.run} version={msg.version} decision={msg.decision} serving={serving}{tests} "
                f"reasons={'; '.join(msg.reasons)[:200]!r}")
    if isinstance(msg, Replay):
        return f"session={msg.session_id} reason={msg.reason}"
    if isinstance(msg, DeadLetter):
        return (f"from={msg.stream}/{msg.group} entry={msg.entry_id} deliveries={msg.deliveries} "
                f"error={msg.error[:160]!r}")
    return ""


def format_line(entry_id: str, data: str | None, raw: bool) -> str:
    if raw:
        return data if data is not None else json.dumps({"entry_id": entry_id, "data": None})
    when = entry_time(entry_id)
    if data is None:
        return f"{when} {entry_id} (no data field)"
    try:
        msg = parse_message(data)
    except MalformedMessage as exc:
        return f"{when} {entry_id} MALFORMED {str(exc)[:160]}"
    return f"{when} {msg.type:<20} {msg.id}  {summarize(msg)}"


async def tail(args: argparse.Namespace) -> int:
    bus = open_bus(args)
    key = bus.keys.stream(args.stream)
    try:
        if args.since:
            entries = await bus.redis.xrange(key, min=args.since, count=None if args.follow else 10_000)
        elif args.lines > 0:
            entries = list(reversed(await bus.redis.xrevrange(key, count=args.lines)))
        else:
            entries = []
        last = entries[-1][0] if entries else ("$" if not args.since else args.since)
        for entry_id, fields in entries:
            print(format_line(entry_id, fields.get(K.FIELD), args.raw), flush=True)
        while args.follow:
            resp = await bus.redis.xread({key: last}, block=1000, count=500)
            for entry_id, fields in resp[0][1] if resp else []:
                print(format_line(entry_id, fields.get(K.FIELD), args.raw), flush=True)
                last = entry_id
    except RedisError as exc:
        raise redis_error(exc, bus.settings) from exc
    except BrokenPipeError:
        sys.stderr.close()
    finally:
        await bus.aclose()
    return 0
