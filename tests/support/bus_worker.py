"""A consumer process for bus tests: `python -m tests.support.bus_worker --mode hang|incr …`.

`hang` marks each message as started in Redis, then never finishes (to be SIGKILLed);
`incr` counts each handling in Redis; `noop` only acks (for the stream benchmark).
All use the real `shared.consumer.Consumer`.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Literal

from shared.consumer import Consumer, Delivery, stop_on_signals
from shared.schemas import Message
from shared.settings import Settings
from shared.streams import Bus


class Ping(Message):
    type: Literal["ping"] = "ping"
    n: int = 0
    body: str = ""


async def main(args: argparse.Namespace) -> None:
    settings = Settings(
        redis={"url": args.url, "prefix": args.prefix},
        streams={"claim_idle_ms": args.claim_idle_ms, "retry_delay_ms": 50, "block_ms": 100},
    )
    async with Bus(settings) as bus:

        async def handle(msg: Ping, d: Delivery) -> None:
            if args.mode == "noop":
                return
            if args.mode == "hang":
                await bus.redis.set(f"{args.prefix}:started:{msg.id}", d.deliveries)
                await asyncio.sleep(3600)
            else:
                await bus.redis.incr(f"{args.prefix}:count:{msg.id}")
                await asyncio.sleep(args.work_s)

        consumer = Consumer(
            bus, args.stream, args.group, Ping, handle, name=args.name, concurrency=args.concurrency
        )
        stop_on_signals(consumer)
        await bus.redis.set(f"{args.prefix}:ready:{args.name}", 1)
        await consumer.run()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--stream", default="turns")
    p.add_argument("--group", default="judge")
    p.add_argument("--name", required=True)
    p.add_argument("--mode", choices=["hang", "incr", "noop"], required=True)
    p.add_argument("--claim-idle-ms", type=int, default=300)
    p.add_argument("--work-s", type=float, default=0.0)
    p.add_argument("--concurrency", type=int, default=8)
    asyncio.run(main(p.parse_args()))
