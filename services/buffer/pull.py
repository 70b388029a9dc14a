"""`GET /get_data`: hand TrainBatches to trainers that cannot read Redis (e.g. slime's rollout).

Batches are read from `batches` in the **`trainer` consumer group** — the group the
built-in trainer uses — so a batch goes to exactly one trainer, pull or push, and the
group's dedupe marks (`keys.done("trainer", batch id)`) are shared: a batch a pull
trainer received is never trained again by a built-in trainer, and vice versa.

Semantics for pull trainers: a batch is acknowledged (and marked done) in the same
transaction that hands it out, i.e. *at most once*: a response lost on the way (the
trainer crashed mid-request) loses those batches for training (they stay in the
archive). The built-in trainer, which acks only after a checkpoint commits, is the
at-least-once path. Before reading new entries, entries another consumer of the group
left idle past `claim_idle_ms` (a dead trainer) are claimed, as the bus janitor would.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from services.buffer import metrics as M
from shared import keys as K
from shared.errors import MalformedMessage
from shared.schemas import TrainBatch
from shared.streams import Bus

log = logging.getLogger(__name__)

PULL_CONSUMER = "buffer-pull"


class Puller:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.key = bus.keys.batches
        self.group = K.GROUP_TRAINER
        # One blocking read must end well inside the Redis client's socket timeout.
        self._block_ms = max(1, int(bus.settings.redis.socket_timeout * 1000 * 0.6))
        self._group_ready = False

    async def pull(self, n: int, wait_s: float = 0.0) -> list[str]:
        """Up to `n` TrainBatches as their JSON, acknowledged; waits up to `wait_s` for one."""
        if not self._group_ready:
            await self.bus.ensure_group(K.BATCHES, self.group)
            self._group_ready = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        out: list[str] = []
        entries = await self._claim_idle(n)
        while True:
            if len(entries) < n:
                block: int | None = None
                left = deadline - loop.time()
                if not entries and left > 0:
                    block = max(1, min(self._block_ms, int(left * 1000)))
                resp = await self.bus.redis.xreadgroup(
                    self.group, PULL_CONSUMER, {self.key: ">"}, count=n - len(entries), block=block
                )
                entries += resp[0][1] if resp else []
            out += await self._settle(entries)
            if out or loop.time() >= deadline:
                return out
            entries = []

    async def _claim_idle(self, n: int) -> list[tuple[str, dict[str, str] | None]]:
        reply = await self.bus.redis.xautoclaim(
            self.key, self.group, PULL_CONSUMER, self.bus.streams.claim_idle_ms, "0-0", count=n
        )
        return [(eid, fields) for eid, fields in reply[1] if fields is not None]

    async def _settle(self, entries: list[tuple[str, dict[str, str] | None]]) -> list[str]:
        """Parse, drop duplicates, dead-letter garbage; ack and mark the rest, in one go."""
        if not entries:
            return []
        parsed: list[tuple[str, str, str]] = []  # entry id, batch id, json
        for entry_id, fields in entries:
            data = (fields or {}).get(K.FIELD)
            try:
                if data is None:
                    raise MalformedMessage("entry has no data field")
                batch_id = TrainBatch.from_json(data).id
            except MalformedMessage as exc:
                await self.bus.dead_letter(K.BATCHES, self.group, entry_id, data or "", str(exc),
                                           1, PULL_CONSUMER)
                continue
            parsed.append((entry_id, batch_id, data))
        if not parsed:
            return []
        pipe = self.bus.redis.pipeline(transaction=False)
        for _, batch_id, _ in parsed:
            pipe.exists(self.bus.keys.done(self.group, batch_id))
        seen: list[Any] = await pipe.execute()
        fresh = [p for p, done in zip(parsed, seen, strict=True) if not done]
        tx = self.bus.redis.pipeline(transaction=True)
        for _, batch_id, _ in fresh:
            tx.set(self.bus.keys.done(self.group, batch_id), 1, ex=self.bus.streams.dedupe_ttl_s)
        tx.xack(self.key, self.group, *(entry_id for entry_id, _, _ in parsed))
        await tx.execute()
        M.PULLED.inc(len(fresh))
        if fresh:
            log.info("batches pulled", extra={"batches": len(fresh),
                                              "duplicates": len(parsed) - len(fresh)})
        return [data for _, _, data in fresh]
