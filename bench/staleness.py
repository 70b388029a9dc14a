"""Staleness under load: how far behind the trainer samples are when they reach the buffer.

A whole stack (`nextstate up` on a tiny model, rule judge) serves agents through the
official openai client at full speed for a while; the buffer records, for every
sample with behaviour log-probs, how many versions the trainer had committed past the
policy that sampled it (`nextstate_buffer_sample_staleness_versions`). The script
prints the request rate, the version rate, the distribution, and the share of samples
each candidate bound would refuse — the figures the default `MAX_STALENESS` is chosen
from. The baseline in the same run is a bound of 0 (strictly on-policy): the share it
would refuse is what training on live traffic without any staleness allowance loses.

    python bench/staleness.py [--agents 16] [--seconds 60] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx

from tests.support.load import Load
from tests.support.tiny_model import build_tiny_model
from tests.support.upstack import UpStack

BOUNDS = (0, 1, 2, 4, 8, 16, 32)


def histogram(text: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts of a Prometheus histogram: upper bound -> count."""
    out: dict[float, float] = {}
    for m in re.finditer(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M):
        out[float("inf") if m.group(1) == "+Inf" else float(m.group(1))] = float(m.group(2))
    return out


def refused_share(cum: dict[float, float], bound: int) -> float:
    total = cum.get(float("inf"), 0.0)
    within = max((c for le, c in cum.items() if le <= bound), default=0.0)
    return 0.0 if total == 0 else (total - within) / total


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-wait", type=float, default=5)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ns-bench-staleness-"))
    model = build_tiny_model(root / "model")
    stack = UpStack(model, root / "home", run=f"stale-{uuid.uuid4().hex[:6]}", prefix=f"b-{uuid.uuid4().hex[:6]}",
                    args=["--lr", "1e-4", "--batch-size", str(args.batch_size), "--max-wait", str(args.max_wait), "--no-eval"],
                    env={"NEXTSTATE_BUFFER__MAX_STALENESS": "1000"})  # measure, drop nothing
    await asyncio.to_thread(stack.start)
    try:
        buffer = stack.record()["services"]["buffer"]["url"]
        load = Load(stack.collector, agents=args.agents, turns=3).start()
        r = stack.redis()
        v0 = int(r.get(f"{stack.prefix}:trainer-version") or 0)
        t0 = time.time()
        await asyncio.sleep(args.seconds)
        elapsed = time.time() - t0
        v1 = int(r.get(f"{stack.prefix}:trainer-version") or 0)
        n_served = len(load.served)
        await load.stop()
        text = (await asyncio.to_thread(httpx.get, f"{buffer}/metrics", headers=stack.internal_headers(),
                                        timeout=10)).text
        cum = histogram(text, "nextstate_buffer_sample_staleness_versions")
    finally:
        await asyncio.to_thread(stack.stop)
    total = cum.get(float("inf"), 0.0)
    print(f"{n_served / elapsed:.1f} requests/s with {args.agents} agents, "
          f"{(v1 - v0) / elapsed:.2f} versions/s (batch {args.batch_size}), {total:.0f} samples measured")
    print("staleness (versions behind the trainer at intake), cumulative share:")
    for le, c in sorted(cum.items()):
        print(f"  <= {le:>4}: {c / total:6.1%}" if total else f"  <= {le}: -")
    base = refused_share(cum, 0)
    print(f"bound   refused   vs strictly on-policy (bound 0: {base:.1%} refused)")
    for b in BOUNDS:
        share = refused_share(cum, b)
        ratio = f"{share / base:.3f}x" if base else "-"
        print(f"{b:>5}   {share:7.2%}   {ratio}")


if __name__ == "__main__":
    asyncio.run(main())
