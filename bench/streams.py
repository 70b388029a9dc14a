"""Stream bus throughput: publish → consume → ack, against a raw redis-py XADD loop.

Both run in this script against one private redis-server, with the same payload (a
~1 KB message). The raw loop is sequential awaited XADDs — what a producer minimally
pays. The pipeline publishes the same number of messages with `Bus.publish` (bounded,
Lua-checked) while 1 or 4 consumer processes (`shared.consumer.Consumer`, no-op
handler, dedupe marks and acks on) drain them; it is timed from the first publish to
the moment every message is acknowledged. Printed as messages/s and as a ratio to the
raw loop. Target: ≥ 0.30 with acking consumers.

    python bench/streams.py [--messages 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.settings import Settings
from shared.streams import Bus
from tests.support.bus_worker import Ping
from tests.support.servers import REPO, RedisServer

BODY = "x" * 900


async def raw_xadd(url: str, n: int) -> float:
    import redis.asyncio as aioredis

    r = aioredis.from_url(url, decode_responses=True)
    key = f"raw-{uuid.uuid4().hex[:6]}"
    payloads = [Ping(n=i, body=BODY).to_json() for i in range(n)]
    t0 = time.perf_counter()
    for p in payloads:
        await r.xadd(key, {"data": p})
    dt = time.perf_counter() - t0
    await r.delete(key)
    await r.aclose()
    return n / dt


async def pipeline(url: str, n: int, consumers: int) -> float:
    prefix = f"bench-{uuid.uuid4().hex[:6]}"
    settings = Settings(redis={"url": url, "prefix": prefix}, streams={"maxlen": n * 2})
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.bus_worker", "--url", url, "--prefix", prefix,
             "--name", f"c{i}", "--mode", "noop", "--concurrency", "64",
             "--claim-idle-ms", "30000"],
            cwd=REPO,
        )
        for i in range(consumers)
    ]
    async with Bus(settings) as bus:
        await bus.ensure_group("turns", "judge")
        ready = [f"{prefix}:ready:c{i}" for i in range(consumers)]
        while await bus.redis.exists(*ready) < consumers:
            await asyncio.sleep(0.05)
        msgs = [Ping(n=i, body=BODY) for i in range(n)]
        t0 = time.perf_counter()
        for m in msgs:
            await bus.publish("turns", m)
        while True:
            (g,) = await bus.redis.xinfo_groups(bus.keys.turns)
            if int(g["pending"]) == 0 and g["lag"] == 0:
                break
            await asyncio.sleep(0.01)
        dt = time.perf_counter() - t0
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        await bus.redis.delete(*await bus.redis.keys(f"{prefix}:*"))
    return n / dt


async def main(n: int) -> None:
    server = RedisServer().start()
    try:
        raw = await raw_xadd(server.url, n)
        one = await pipeline(server.url, n, 1)
        four = await pipeline(server.url, n, 4)
        raw2 = await raw_xadd(server.url, n)  # again, to show the baseline's own drift
    finally:
        server.close()
    base = (raw + raw2) / 2
    print(f"messages: {n}, payload ~1 KB, redis-server on a private port")
    print(f"raw redis-py XADD loop          {raw:9.0f} msg/s  (again after: {raw2:.0f})")
    print(f"publish→consume→ack, 1 consumer {one:9.0f} msg/s  ratio {one / base:.2f}")
    print(f"publish→consume→ack, 4 consumers{four:9.0f} msg/s  ratio {four / base:.2f}")
    print(f"target: ratio >= 0.30  -> {'met' if min(one, four) / base >= 0.30 else 'NOT met'}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=20000)
    asyncio.run(main(ap.parse_args().messages))
