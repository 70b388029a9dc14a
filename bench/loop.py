"""The whole loop on SmolLM2 with the gate, per weight hand-off: how fast users get what it learns.

One arm per path (and per stale-sample rule, --rules tis,count: what fraction of the
samples that reached the trainer trained, and the score it reached), run one after the
other on the same machine, model, traffic and gate:

- `full`:    `nextstate up --gate` (every version the whole model, fp32 on this CPU engine);
- `adapter`: `nextstate up --gate --lora R` (every version a LoRA adapter loaded by name);
- `bf16`:    `full` with `NEXTSTATE_TRAINER__PUBLISH_DTYPE=bfloat16` and
             `NEXTSTATE_WATCHER__SERVED_DTYPE=bfloat16`, which the watcher otherwise refuses
             on a float32 base (the engine still serves fp32 here, casting each version: a
             CPU without bf16 instructions gains only the bytes).

Each arm starts its own stack (private home, Redis, SeaweedFS), runs `nextstate demo` for
--minutes, then waits up to --tail seconds for the gate to decide on what was committed,
and reads the run's record: versions committed (the trainer's log) and served (the
watcher's `policy loaded`), commit → served per served version, evaluation lag (commit →
the gate's decision), the held-out demo score of the base, the best and the last version
served, the trainer's seconds per step and tokens/s. The baseline is the `full` arm of
the same run: each other arm's figures are also printed as ratios of it.

    python bench/loop.py [--minutes 15] [--paths full,adapter] [--rules tis,count] [--lora 16] [--lr-full 1e-5] [--lr-adapter 1e-4]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.ctl.models import ensure_default_model
from tests.support.upstack import NEXTSTATE, UpStack

LINE = re.compile(r"^(?P<svc>[\w-]+)\s+\| (?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+\s+\S+ (?P<logger>\S+): (?P<msg>.*)$")


def ts(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def fields(msg: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", msg))


def parse_log(text: str) -> dict[str, Any]:
    """Commits, loads and steps from `up`'s merged log (the services' own lines)."""
    committed: dict[int, float] = {}
    loaded: dict[int, float] = {}
    steps: list[tuple[float, float]] = []  # (time, tokens/s)
    # What became of the samples that reached the trainer (its step and drop lines).
    fate = {"trained": 0, "stale": 0, "divergent": 0, "abandoned": 0}
    kls: list[float] = []  # each step's most divergent sample (token-mean k3 KL to the trainer)
    for line in text.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        svc, at, msg = m["svc"], ts(m["ts"]), m["msg"]
        f = fields(msg)
        if svc == "trainer" and msg.startswith("committed version") and "version" in f:
            committed.setdefault(int(f["version"]), at)
        elif svc == "trainer" and msg.startswith("step ") and "tokens_per_s" in f:
            steps.append((at, float(f["tokens_per_s"])))
            if f.get("sample_kl_max", "None") != "None":
                kls.append(float(f["sample_kl_max"]))
            divergent = int(float(f.get("divergent_samples", "0").replace("None", "0")))
            fate["trained"] += int(f.get("samples", "0")) - divergent
            fate["divergent"] += divergent
        elif svc == "trainer" and (msg.startswith("dropped stale samples") or "acked without training" in msg):
            kind = "abandoned" if "abandoned" in msg else "stale"
            fate[kind] += int(f.get("dropped") or f.get("samples") or 0)
        elif svc == "trainer" and msg.startswith("dropped samples of an abandoned lineage"):
            fate["abandoned"] += int(f.get("dropped", "0"))
        elif svc == "watcher" and msg.startswith("policy loaded") and f.get("version", "").isdigit():
            loaded.setdefault(int(f["version"]), at)
    return {"committed": committed, "loaded": loaded, "steps": steps, "fate": fate, "kls": kls}


def ctl(stack: UpStack, *args: str, timeout: float = 120) -> str:
    env = {**os.environ, "NEXTSTATE_HOME": str(stack.home), "NEXTSTATE_RUN": stack.run,
           "NEXTSTATE_REDIS__PREFIX": stack.prefix}
    out = subprocess.run([NEXTSTATE, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"nextstate {' '.join(args)} failed: {out.stderr[-2000:]}")
    return out.stdout


# How the trainer treats stale samples (docs/methods.md#stale-samples): `tis`, today's
# defaults (truncated importance weights, a divergence bound); `count`, the rule before it
# (no weight, a sample more than 4 versions behind the weights dropped unless served).
RULES: dict[str, dict[str, str]] = {
    "tis": {},
    "count": {"NEXTSTATE_TRAINER__IS_CORRECTION": "off", "NEXTSTATE_TRAINER__MAX_SAMPLE_KL": "",
              "NEXTSTATE_TRAINER__MAX_STALENESS": "4"},
}


def arm(path: str, args: argparse.Namespace, model: Path, root: Path, rule: str = "tis") -> dict[str, Any]:
    flags = ["--gate", "--batch-size", str(args.batch_size), "--max-wait", str(args.max_wait)]
    env: dict[str, str] = dict(RULES[rule])
    if path == "adapter":
        flags += ["--lora", str(args.lora), "--lr", str(args.lr_adapter)]
    else:
        flags += ["--lr", str(args.lr_full)]
    if path == "bf16":
        env["NEXTSTATE_TRAINER__PUBLISH_DTYPE"] = "bfloat16"
        env["NEXTSTATE_WATCHER__SERVED_DTYPE"] = "bfloat16"
    name = path if rule == "tis" else f"{path}-{rule}"
    stack = UpStack(model, root / name, run=f"loop-{name}", prefix=f"loop-{name}", args=flags, env=env)
    t0 = time.time()
    stack.start(timeout=900)
    up_s = time.time() - t0
    try:
        demo = json.loads(ctl(stack, "demo", "--url", stack.collector, "--minutes", str(args.minutes),
                              "--concurrency", str(args.concurrency), "--json", "--no-eval",
                              timeout=args.minutes * 60 + 600).strip().splitlines()[-1])
        traffic_end = time.time()
        deadline = traffic_end + args.tail
        while time.time() < deadline:  # the gate decides on what was committed during the traffic
            log = parse_log(stack.logs(50_000_000))
            show = json.loads(ctl(stack, "eval", "show", "--json"))
            decided = {r["version"] for r in show["versions"] if r.get("decision")}
            pending = [v for v, at in log["committed"].items() if at <= traffic_end and v not in decided]
            if not pending:
                break
            time.sleep(10)
        log = parse_log(stack.logs(50_000_000))
        show = json.loads(ctl(stack, "eval", "show", "--json"))
    finally:
        stack.stop(timeout=120)
    return summarise(name, up_s, t0, traffic_end, demo, log, show)


def summarise(path: str, up_s: float, t0: float, traffic_end: float, demo: dict[str, Any],
              log: dict[str, Any], show: dict[str, Any]) -> dict[str, Any]:
    committed, loaded = log["committed"], log["loaded"]
    in_traffic = {v: at for v, at in committed.items() if at <= traffic_end}
    served = {v: loaded[v] - committed[v] for v in loaded if v in committed}
    rows = {r["version"]: r for r in show["versions"]}

    def demo_score(v: int) -> float | None:
        s = rows.get(v, {}).get("suites", {}).get("demo")
        return None if s is None else float(s["score"])

    lag = [r["decided_at"] - committed[v] for v, r in rows.items() if r.get("decided_at") and v in committed]
    served_versions = sorted(served)
    scored = {v: x for v in rows if (x := demo_score(v)) is not None}
    step_times = [at for at, _ in log["steps"] if at <= traffic_end]
    fate = log["fate"]
    reached = sum(fate.values())
    gaps = [b - a for a, b in itertools.pairwise(step_times)]
    return {
        "path": path, "up_s": round(up_s, 1),
        "versions_committed": len(in_traffic), "versions_served": len([v for v in served_versions
                                                                        if loaded[v] <= traffic_end]),
        "versions_served_incl_tail": len(served_versions),
        "commit_to_served_s": round(statistics.median(served.values()), 1) if served else None,
        "eval_lag_s": round(statistics.median(lag), 1) if lag else None,
        "step_s": round(statistics.median(gaps), 1) if gaps else None,
        "tokens_per_s": round(statistics.median(t for _, t in log["steps"]), 1) if log["steps"] else None,
        "samples_reached_trainer": reached,
        "trained_frac": round(fate["trained"] / reached, 4) if reached else None,
        "samples_fate": fate,
        # what MAX_SAMPLE_KL is set against: each step's most divergent sample, quantiles over steps
        "step_kl_max": {q: round(statistics.quantiles(log["kls"], n=100)[int(q[1:]) - 1], 4)
                        for q in ("p50", "p90", "p99")} | {"max": round(max(log["kls"]), 4)}
        if len(log["kls"]) >= 2 else None,
        "demo_base": demo_score(0),
        "demo_best": max(scored.values()) if scored else None,
        "demo_last_served": demo_score(served_versions[-1]) if served_versions else None,
        "scores": {str(v): s for v, s in sorted(scored.items())},
        "decisions": {str(v): r.get("decision") for v, r in sorted(rows.items())},
        "demo_turns": demo.get("turns"), "demo_success": demo.get("success_rate"),
        "demo": demo,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=15)
    p.add_argument("--tail", type=float, default=300, help="seconds to wait for the gate after the traffic")
    p.add_argument("--paths", default="full,adapter")
    p.add_argument("--rules", default="tis", help="tis,count: each path under each stale-sample rule")
    p.add_argument("--lora", type=int, default=16)
    p.add_argument("--lr-full", type=float, default=1e-5)
    p.add_argument("--lr-adapter", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-wait", type=float, default=30)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--out", type=Path, help="write the results as JSON here too")
    args = p.parse_args()
    model = ensure_default_model()
    results = []
    with tempfile.TemporaryDirectory(prefix="nextstate-loop-") as tmp:
        for path in args.paths.split(","):
            for rule in args.rules.split(","):
                r = arm(path, args, model, Path(tmp), rule)
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "demo"}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    keys = ("versions_committed", "versions_served", "commit_to_served_s", "eval_lag_s", "step_s",
            "tokens_per_s", "trained_frac", "demo_base", "demo_best", "demo_last_served")
    print("| path | " + " | ".join(keys) + " |")
    print("| --- " * (len(keys) + 1) + "|")
    base = results[0]
    for r in results:
        cells = []
        for k in keys:
            v, b = r[k], base[k]
            ratio = f" ({v / b:.2f}x)" if r is not base and isinstance(v, float | int) and isinstance(b, float | int) \
                and b and k not in ("demo_base",) else ""
            cells.append(f"{v}{ratio}")
        print(f"| {r['path']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
