"""`nextstate status`: is the loop flowing? Per stream and group, at a glance.

For each stream: length and shed count; for each consumer group: pending (delivered,
not acked), lag (not yet delivered), consumers and how long each has been idle; the
dead-letter count. Then what the rest of the stack reports through Redis: the version
the engine *really* serves (the watcher checks it every pass) beside the one it should
serve and the trainer's newest, flagged when they disagree; checkpoints refused; turns
waiting for their next state; sessions whose turns the judge holds for their experience;
what the buffer decided, per rule (episode turns too:
`outcome_missing`, `episode_failed`, `group_too_small`; `group_partial` counts groups),
and the episode sessions it holds for their outcome; the promotion gate
(what it serves, the last decision, the newest score per suite); the judges' rewards over
their shared window and the reward-collapse alarm (services/judge/collapse.py); and,
under `nextstate up`, each supervised process (restarts, crash loops).
A stage is named *stalled* when it has work (lag or pending) and nothing was acked
over the sampling window (`--window`, default 2 s): its backlog stays put or grows.
The archive (`batches`/`archive`) is the exception it must know: it acknowledges a
batch only once the object holding it is uploaded, so it holds a roll's batches for up
to its `roll_s` on purpose (buffer/archive.py). Its consumers say what they hold
(`archive-state`); the group is shown *holding* (with when the roll uploads) while that
hold is younger than `roll_s` + its grace, and stalled only past that.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from redis.exceptions import RedisError

from services.ctl.common import human_ms, open_bus, redis_error
from shared import keys as K
from shared.errors import MalformedMessage
from shared.schemas import EvalResult, Promotion
from shared.streams import Bus

GATE_FIELDS = ("promoted", "best", "serving", "decided_at", "config")


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="streams, consumer groups, lag, dead letters, versions")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--window", type=float, default=2.0,
                   help="seconds between two samples used to spot a stalled stage (0: one sample)")
    p.set_defaults(func=lambda a: asyncio.run(status(a)))


async def snapshot(bus: Bus) -> dict[str, Any]:
    streams = [await bus.stream_info(name) for name in K.STREAMS]
    keys = bus.keys
    serving, trained = await bus.redis.mget(keys.policy_version, keys.trainer_version)
    pipe = bus.redis.pipeline(transaction=False)
    pipe.hgetall(keys.watcher_state)
    pipe.hgetall(keys.refused_versions)
    pipe.hgetall(keys.services)
    pipe.hgetall(keys.buffer_counts)
    pipe.zcard(keys.force_candidates)
    pipe.zcard(keys.episode_sessions)
    pipe.zcard(keys.chat_groups)
    pipe.zcard(keys.pending_deadlines)
    pipe.zcard(keys.experience_waiting)
    pipe.hmget(keys.gate_state, GATE_FIELDS)
    pipe.xrevrange(keys.promotions, count=1)
    pipe.xrevrange(keys.evals, count=50)
    pipe.hgetall(keys.reward_alarm)
    pipe.hgetall(keys.archive_state)
    pipe.hgetall(keys.trainer_mismatch)
    (watcher, refused, services, counts, parked, episodes, groups, waiting, experience, gate,
     promos, evals, alarm, archive, mismatch) = await pipe.execute()
    return {
        "prefix": keys.prefix,
        "streams": streams,
        "dead_letters": next(s["length"] for s in streams if s["stream"] == K.DEAD),
        "policy_version": None if serving is None else int(serving),
        "trainer_version": None if trained is None else int(trained),
        "watcher": watcher or None,
        "refused_versions": {v: _json(r) for v, r in sorted(refused.items(), key=_version_order)},
        "services": {name: _json(r) for name, r in sorted(services.items())},
        "buffer": {"decisions": {k: int(v) for k, v in sorted(counts.items())},
                   "final_turns_waiting": int(parked), "episodes_waiting": int(episodes),
                   "chat_groups_waiting": int(groups)},
        "archive": {name: _json(r) for name, r in sorted(archive.items())},
        "turns_waiting_next_state": int(waiting),
        "sessions_waiting_experience": int(experience),
        "gate": gate_snapshot(dict(zip(GATE_FIELDS, gate, strict=True)), promos, evals, bus.settings.run),
        "rewards": rewards_snapshot(alarm),
        "mismatch": mismatch_snapshot(mismatch),
    }


def mismatch_snapshot(fields: dict[str, str]) -> dict[str, Any] | None:
    """The trainer's train/inference mismatch over its last steps (`trainer-mismatch`,
    services/trainer/mismatch.py); None before a step had a sample of its own version."""
    if not fields.get("tokens"):
        return None
    since = fields.get("alarm_since") or ""
    return {"tokens": int(float(fields["tokens"])), "abs_log_ratio": float(fields.get("abs_log_ratio") or 0),
            "outside_frac": float(fields.get("outside_frac") or 0), "alarm": bool(fields.get("alarm")),
            "alarm_since": float(since) if since else None, "threshold": float(fields.get("threshold") or 0),
            "window_steps": int(fields.get("window_steps") or 0),
            "updated_at": float(fields.get("updated_at") or 0) or None}


def render_mismatch(snap: dict[str, Any]) -> list[str]:
    m = snap.get("mismatch")
    if not m:
        return []
    line = (f"train/inference mismatch: mean |log ratio| {m['abs_log_ratio']:.4f} over {m['tokens']} tokens "
            f"of the trainer's own samples (last {m['window_steps']} steps), {m['outside_frac']:.1%} outside the clip")
    if not m["alarm"]:
        return [line]
    age = f" for {time.time() - m['alarm_since']:.0f}s" if m.get("alarm_since") else ""
    return [line, f"  MISMATCH ALARM{age}: past {m['threshold']}: the trainer and the engine disagree on the "
                  "engine's own samples (docs/troubleshooting.md#the-trainer-and-the-engine-disagree)"]


def rewards_snapshot(fields: dict[str, str]) -> dict[str, Any] | None:
    """The judges' reward-collapse window (`reward-alarm`, services/judge/collapse.py): the
    share of each reward value and of undecided votes, and the alarm; None before any turn."""
    turns = int(fields.get("turns") or 0)
    if not turns:
        return None
    counts = {f[2:]: int(v) for f, v in fields.items() if f.startswith("v:") and int(v) > 0}
    since = fields.get("alarm_since") or ""
    return {
        "turns": turns,
        "values": {v: round(n / turns, 4) for v, n in sorted(counts.items(), key=lambda kv: -kv[1])},
        "undecided": round(int(fields.get("undecided") or 0) / turns, 4),
        "alarm": [r for r in (fields.get("alarm") or "").split(",") if r],
        "alarm_since": float(since) if since else None,
        "thresholds": {k: fields.get(k) for k in ("window", "min_turns", "value_share", "undecided_share")},
        "updated_at": float(fields.get("updated_at") or 0) or None,
    }


def gate_snapshot(fields: dict[str, str | None], promos: list[Any], evals: list[Any],
                  run: str) -> dict[str, Any] | None:
    """The gate's summary (`gate-state`), its last `Promotion`, the newest result per suite of `run`."""
    last = None
    for _, f in promos:
        try:
            last = Promotion.from_json(f.get(K.FIELD, "")).model_dump(
                include={"version", "decision", "reasons", "serving", "created_at"})
        except MalformedMessage:
            pass
    newest: dict[str, dict[str, Any]] = {}
    for _, f in evals:  # newest first
        try:
            r = EvalResult.from_json(f.get(K.FIELD, ""))
        except MalformedMessage:
            continue
        if r.run == run:
            newest.setdefault(r.suite, r.model_dump(include={"version", "score", "ci_low", "ci_high", "n"}))
    if not any(fields.values()) and last is None and not newest:
        return None
    serving = fields.get("serving") or ""
    return {"promoted": _json(fields.get("promoted") or "[]"),
            "best": _json(fields.get("best") or "{}"),
            "serving": int(serving) if serving.isdigit() else None,
            "last_decision": last, "newest_results": dict(sorted(newest.items()))}


def _version_order(item: tuple[str, Any]) -> tuple[int, str]:
    """Numbered versions in order, then named records (`LATEST`: the pointer itself)."""
    return (int(item[0]), "") if item[0].isdigit() else (1 << 62, item[0])


def _json(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return {"raw": raw}


def _acked(group: dict[str, Any]) -> int:
    """Entries this group has read and acknowledged so far (entries-read minus pending)."""
    read = group.get("entries_read")
    return (int(read) if read is not None else 0) - int(group["pending"])


def archive_hold(group: dict[str, Any], states: dict[str, Any], now: float) -> dict[str, Any] | None:
    """What the archive group's consumers hold on purpose: {"upload_in_s"} while every
    consumer holding entries reports a hold younger than its roll_s + grace_s,
    {"overdue_s"} once one is older; None when one reports nothing (an older buffer)."""
    dues: list[float] = []
    for c in group["consumers"]:
        if c["pending"] == 0:
            continue
        st = states.get(c["name"])
        since = st.get("held_since") if isinstance(st, dict) else None
        if not isinstance(st, dict) or not isinstance(since, (int, float)):
            return None
        roll_s, grace_s = float(st.get("roll_s") or 0), float(st.get("grace_s") or 0)
        if now - since > roll_s + grace_s:
            return {"overdue_s": round(now - since - roll_s, 1)}
        dues.append(max(0.0, since + roll_s - now))
    return {"upload_in_s": round(min(dues), 1)} if dues else None


def mark_stalls(before: dict[str, Any], after: dict[str, Any], window_s: float,
                now: float | None = None) -> None:  # fmt: skip
    """Flag each group that has a backlog yet acknowledged nothing between the samples
    (the archive: unless it holds its roll on purpose, `archive_hold`)."""
    now = time.time() if now is None else now
    prev = {(s["stream"], g["name"]): g for s in before["streams"] for g in s["groups"]}
    stalled = []
    for s in after["streams"]:
        for g in s["groups"]:
            p = prev.get((s["stream"], g["name"]))
            backlog = (g["lag"] or 0) + g["pending"]
            acked = None if p is None else _acked(g) - _acked(p)
            g["acked_in_window"] = acked
            g["stalled"] = bool(p is not None and backlog > 0 and acked == 0)
            if g["stalled"] and (s["stream"], g["name"]) == (K.BATCHES, K.GROUP_ARCHIVE):
                hold = archive_hold(g, after.get("archive") or {}, now)
                if hold is not None:
                    g["archive_hold"] = hold
                    g["stalled"] = "overdue_s" in hold
            if g["stalled"]:
                stalled.append(f"{s['stream']}/{g['name']}")
    after["window_s"] = window_s
    after["stalled"] = stalled


def _v(version: Any) -> str:
    return "-" if version in (None, "") else f"v{version}"


def render_versions(snap: dict[str, Any]) -> list[str]:
    """The served / target / trained versions, with the watcher's mismatch flag."""
    line = f"prefix {snap['prefix']}   serving policy {_v(snap['policy_version'])}"
    w = snap.get("watcher")
    if w:
        line += f" (engine reports {_v(w.get('engine_version'))}, target {_v(w.get('target_version'))}"
        age = time.time() - float(w.get("checked_at") or 0)
        line += f", checked {age:.0f}s ago)" if w.get("checked_at") else ")"
    line += f"   trainer {_v(snap['trainer_version'])}"
    lines = [line]
    if w and w.get("mismatch") == "1":
        lines.append(f"  MISMATCH: the engine serves {_v(w.get('engine_version'))}, should serve "
                     f"{_v(w.get('target_version'))}" + (f" ({w['error']})" if w.get("error") else ""))
    for version, r in snap.get("refused_versions", {}).items():
        name = f"v{version}" if str(version).isdigit() else str(version)
        lines.append(f"  refused {name} by {r.get('by', '?')}: {r.get('reason', '?')} "
                     f"{str(r.get('detail', ''))[:120]}")
    return lines


def render_services(snap: dict[str, Any]) -> list[str]:
    lines = []
    for name, st in snap.get("services", {}).items():
        flag = "  CRASH LOOP" if st.get("state") == "crash-loop" else ""
        last = f"  last exit {st['last_exit']}" if st.get("last_exit") not in (None, "") else ""
        lines.append(f"  {name:<12} {st.get('state', '?'):<11} pid {st.get('pid') or '-':<8} "
                     f"restarts {st.get('restarts', 0)}{last}{flag}")
    return (["processes (nextstate up):", *lines]) if lines else []


def render_buffer(snap: dict[str, Any]) -> list[str]:
    b = snap.get("buffer") or {}
    decisions = b.get("decisions") or {}
    waits = ("final_turns_waiting", "episodes_waiting", "chat_groups_waiting")
    if not decisions and not any(b.get(w) for w in waits):
        return []
    parts = [f"{k} {v}" for k, v in decisions.items()]
    line = "buffer decisions: " + (", ".join(parts) if parts else "none")
    if b.get("final_turns_waiting"):
        line += f"   final turns waiting for their session: {b['final_turns_waiting']}"
    if b.get("episodes_waiting"):
        line += f"   episodes waiting for their outcome: {b['episodes_waiting']}"
    if b.get("chat_groups_waiting"):
        line += f"   chat groups waiting for their choices: {b['chat_groups_waiting']}"
    return [line]


def render_gate(snap: dict[str, Any]) -> list[str]:
    g = snap.get("gate")
    if not g:
        return []
    best = ", ".join(f"{s} {v:.4g}" for s, v in g["best"].items())
    line = (f"gate: serving {_v(g['serving'])}, promoted {' '.join(f'v{v}' for v in g['promoted']) or 'none'}"
            + (f", best {best}" if best else ""))
    lines = [line]
    if (last := g.get("last_decision")):
        age = time.time() - float(last.get("created_at") or 0)
        lines.append(f"  last decision: v{last['version']} {last['decision']} {age:.0f}s ago "
                     f"({'; '.join(last.get('reasons') or [])[:160]})")
    if g.get("newest_results"):
        lines.append("  newest results: " + ", ".join(
            f"{s} v{r['version']} {r['score']:.4g} n={r['n']}" for s, r in g["newest_results"].items()))
    return lines


def render_rewards(snap: dict[str, Any]) -> list[str]:
    r = snap.get("rewards")
    if not r:
        return []
    values = ", ".join(f"{v} {share:.0%}" for v, share in r["values"].items())
    lines = [f"rewards over the last {r['turns']} judged turns: {values}; undecided {r['undecided']:.0%}"]
    t = r["thresholds"]
    for reason in r["alarm"]:
        age = f" for {time.time() - r['alarm_since']:.0f}s" if r.get("alarm_since") else ""
        if reason == "one-value":
            top, share = next(iter(r["values"].items()))
            what = f"one value ({top}) holds {share:.0%} (alarm at {float(t['value_share'] or 0):.0%})"
        else:
            what = f"{r['undecided']:.0%} undecided: ties or no readable vote (alarm at " \
                   f"{float(t['undecided_share'] or 0):.0%})"
        lines.append(f"  REWARD COLLAPSE{age}: {what}: the judge's votes stop discriminating "
                     "(docs/troubleshooting.md#the-judges-scores-are-all-near-one-value)")
    return lines


def render(snap: dict[str, Any]) -> str:
    lines = render_versions(snap)
    lines.extend(render_gate(snap))
    lines.extend(render_rewards(snap))
    lines.extend(render_mismatch(snap))
    lines.append(f"turns waiting for their next state: {snap.get('turns_waiting_next_state', 0)}")
    if snap.get("sessions_waiting_experience"):  # experiential learning (services/judge/replay.py)
        lines.append(f"sessions whose turns wait for their experience: {snap['sessions_waiting_experience']}")
    for s in snap["streams"]:
        shed = f"  shed {s['shed']}" if s["shed"] else ""
        lines.append(f"{s['stream']:<12} length {s['length']:>7}{shed}")
        for g in s["groups"]:
            flag = "  STALLED: backlog and no acks" if g.get("stalled") else ""
            hold = g.get("archive_hold") or {}
            if "upload_in_s" in hold:
                flag = f"  holding the archive roll (uploads in {hold['upload_in_s']:.0f}s)"
            elif "overdue_s" in hold:
                flag = (f"  STALLED: the archive roll is {hold['overdue_s']:.0f}s overdue "
                        "(uploads failing? the buffer's log says)")  # fmt: skip
            rate = ""
            if g.get("acked_in_window") is not None and snap.get("window_s"):
                rate = f"  acked {g['acked_in_window'] / snap['window_s']:.1f}/s"
            lines.append(f"  group {g['name']:<9} pending {g['pending']:>6}  lag {g['lag'] if g['lag'] is not None else '?':>6}"
                         f"  consumers {len(g['consumers'])}{rate}{flag}")
            for c in g["consumers"]:
                lines.append(f"    {c['name']:<40} pending {c['pending']:>5}  idle {human_ms(c['idle_ms'])}")
    lines.extend(render_buffer(snap))
    lines.append(f"dead letters: {snap['dead_letters']}" + ("  (nextstate dlq list)" if snap["dead_letters"] else ""))
    lines.extend(render_services(snap))
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
