"""Recovery time per fault: SIGKILL each service of `nextstate up` under load, time the way back.

One stack (`nextstate up` on a tiny model, rule judge) serves agents through the
official openai client that retry what fails. For each service in turn — collector,
judge, buffer, trainer, watcher, engine, Redis — the script SIGKILLs it and measures:

- kill → restarted (the supervisor runs it again under a new pid),
- kill → the first request that succeeds after the kill,
- for the engine, kill → the engine serving the trained policy again (the watcher's
  reconciliation), and the engine answering → policy restored.

Each figure is printed beside what bounds it: the supervisor's first restart delay
(`Backoff.base_s`, jitter shortens it), the watcher's poll interval, and — the baseline
measured in the same run — how long the same service takes to start from cold
(`up`'s own start, from its log) where that dominates.

    python bench/faults.py [--agents 3] [--poll 0.5] [--repeat 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.ctl.supervisor import Backoff
from tests.support.load import Load
from tests.support.tiny_model import build_tiny_model
from tests.support.upstack import UpStack

ORDER = ("collector", "judge-0", "buffer", "trainer", "watcher", "engine", "redis")


def serving(stack: UpStack) -> int:
    v = stack.engine_version()
    return int(v) if v is not None and v.isdigit() else -1


async def until(cond, timeout: float, what: str) -> float:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(cond):
            return time.time()
        await asyncio.sleep(0.05)
    raise TimeoutError(what)


async def one(stack: UpStack, load: Load, name: str) -> dict[str, float]:
    trained = serving(stack)
    t0 = time.time()
    old = stack.kill(name)
    await asyncio.to_thread(stack.wait_restarted, name, old)
    out = {"restart_s": time.time() - t0}
    out["first_request_s"] = await asyncio.wait_for(load.served_since(t0), 300) - t0
    if name == "engine":
        up = await until(lambda: stack.engine_version() is not None, 300, "engine answering")
        back = await until(lambda: serving(stack) >= trained, 120, "policy restored")
        out["policy_restored_s"] = back - t0
        out["engine_up_to_policy_s"] = back - up
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--poll", type=float, default=0.5, help="the watcher's poll interval (s)")
    p.add_argument("--repeat", type=int, default=1, help="rounds of the whole sequence")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ns-bench-faults-"))
    model = build_tiny_model(root / "model")
    tag = uuid.uuid4().hex[:6]
    stack = UpStack(model, root / "home", run=f"faults-{tag}", prefix=f"bf-{tag}",
                    args=["--lr", "1e-3", "--batch-size", "8", "--max-wait", "2", "--no-eval"],
                    env={"NEXTSTATE_WATCHER__POLL_INTERVAL_S": str(args.poll),
                         "NEXTSTATE_COLLECTOR__PENDING_TTL_S": "15"})
    cold = time.time()
    await asyncio.to_thread(stack.start)
    cold_s = time.time() - cold
    results: dict[str, list[dict[str, float]]] = {n: [] for n in ORDER}
    try:
        load = Load(stack.collector, agents=args.agents, turns=3).start()
        await until(lambda: serving(stack) >= 1, 300, "a trained version served")
        for _ in range(args.repeat):
            for name in ORDER:
                results[name].append(await one(stack, load, name))
        await load.stop()
    finally:
        await asyncio.to_thread(stack.stop)
    b = Backoff()
    print(f"bounds: first restart after {b.base_s * (1 - b.jitter):.2f}-{b.base_s:.2f}s (backoff), "
          f"watcher poll {args.poll}s; baseline: the whole stack's cold start took {cold_s:.1f}s")
    print(f"{'fault':<10} {'restart':>8} {'1st ok':>8} {'policy':>8} {'up->pol':>8}   (seconds after SIGKILL, median)")
    for name, rows in results.items():
        def med(key: str, rows: list[dict[str, float]] = rows) -> str:
            vals = [r[key] for r in rows if key in r]
            return f"{statistics.median(vals):8.2f}" if vals else f"{'-':>8}"
        print(f"{name:<10} {med('restart_s')} {med('first_request_s')} {med('policy_restored_s')} "
              f"{med('engine_up_to_policy_s')}")
    print(f"served {len(load.served)} responses, {load.failures} failed attempts retried")


if __name__ == "__main__":
    asyncio.run(main())
