"""`docker compose` beside `nextstate up`: the same loop, the same tiny model, the same run.

Two arms, interleaved round by round so a burst of other load hits each alike:

- `up`: the baseline, `nextstate up` (its own Redis and SeaweedFS, the engine, collector,
  one rule judge, buffer, trainer, watcher, evaluation engine and evaluator);
- `compose`: `nextstate compose init --offline` + `docker compose up -d` of the cpu
  profile (tests/support/composestack.py; images built beforehand, from the layer cache
  when warm — the build is reported, not timed in the arm).

Measured in each arm, in seconds: launch → every service healthy (compose: every
container's healthcheck; up: its "OpenAI endpoint" line, printed once all are ready);
healthy → the first chat completion answered through the official `openai` client;
traffic (3 agents) → the first response from a trained version (`X-Policy-Version` > 0);
SIGKILL of the collector's process → a request answered again (compose: Docker's restart
policy and the healthcheck; up: its supervisor). Each compose figure is printed beside
up's and as a ratio of it.

    python bench/compose.py [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.composestack import ComposeStack, docker_unavailable
from tests.support.load import Load
from tests.support.tiny_model import build_tiny_model
from tests.support.upstack import UpStack

FIGURES = ("healthy", "first request", "first version", "SIGKILL collector -> back")
SETTINGS = {"BUFFER_BATCH_SIZE": "4", "BUFFER_MAX_WAIT_S": "5"}


async def first_answer(url: str, key: str, timeout: float = 120) -> float:
    client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=10)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < timeout:
            try:
                await client.chat.completions.create(model="policy", max_tokens=4,
                                                     messages=[{"role": "user", "content": "hello"}])
                return time.monotonic() - t0
            except (openai.APIError, openai.APIConnectionError):
                await asyncio.sleep(0.1)
        raise TimeoutError(f"no answer from {url} in {timeout}s")
    finally:
        await client.close()


async def traffic(url: str, key: str, kill: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """(traffic → first trained version served, SIGKILL → a request answered again)."""
    load = Load(url=url, agents=3, turns=3, max_tokens=4, api_key=key).start()
    try:
        t0 = time.monotonic()
        while not any(x.weight_version.isdigit() and int(x.weight_version) > 0 for x in load.served):
            if time.monotonic() - t0 > 600:
                raise TimeoutError("no trained version served in 600 s")
            await asyncio.sleep(0.1)
        first_version = time.monotonic() - t0
        killed = time.time()
        await kill()
        await asyncio.wait_for(load.served_since(killed), 300)
        back = time.time() - killed
    finally:
        await load.stop()
    return first_version, back


async def arm_up(model: Path, work: Path) -> dict[str, float]:
    stack = UpStack(model=model, home=work / f"up-{uuid.uuid4().hex[:6]}", run="bench",
                    prefix=f"bench{uuid.uuid4().hex[:6]}", args=["--batch-size", "4", "--max-wait", "5"])
    t0 = time.monotonic()
    await asyncio.to_thread(stack.start, 600)
    out = {"healthy": time.monotonic() - t0}
    key = "unused"
    try:
        out["first request"] = await first_answer(stack.collector, key)

        async def kill() -> None:
            stack.kill("collector")

        out["first version"], out["SIGKILL collector -> back"] = await traffic(stack.collector, key, kill)
    finally:
        await asyncio.to_thread(stack.stop)
    return out


async def arm_compose(model: Path, work: Path) -> dict[str, float]:
    stack = ComposeStack(model=model, workdir=work / f"compose-{uuid.uuid4().hex[:6]}", settings=SETTINGS)
    await asyncio.to_thread(stack.init)
    try:
        build = await asyncio.to_thread(stack.build)
        print(f"  (compose build: {build:.1f} s)", flush=True)
        out = {"healthy": await asyncio.to_thread(stack.up)}
        out["first request"] = await first_answer(stack.url, stack.api_key)
        collector = stack.container_ids("collector")[0]

        async def kill() -> None:
            stack.kill(collector)

        out["first version"], out["SIGKILL collector -> back"] = await traffic(stack.url, stack.api_key, kill)
    finally:
        await asyncio.to_thread(stack.close)
    return out


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    why = docker_unavailable()
    if why:
        print(f"docker compose is unavailable: {why}", file=sys.stderr)
        return 1
    results: dict[str, list[dict[str, float]]] = {"up": [], "compose": []}
    with tempfile.TemporaryDirectory(prefix="bench-compose-") as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "model")
        for r in range(args.rounds):
            for name, arm in (("up", arm_up), ("compose", arm_compose)):
                print(f"round {r + 1}: {name}", flush=True)
                got = await arm(model, work)
                print("  " + ", ".join(f"{k} {v:.1f} s" for k, v in got.items()), flush=True)
                results[name].append(got)
    print(f"\nmedian of {args.rounds} round(s), seconds (compose as a ratio of up):")
    print(f"  {'':28} {'up':>8} {'compose':>8} {'ratio':>6}")
    for fig in FIGURES:
        up = statistics.median(x[fig] for x in results["up"])
        co = statistics.median(x[fig] for x in results["compose"])
        print(f"  {fig:28} {up:8.1f} {co:8.1f} {co / up:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
