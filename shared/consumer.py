"""A consumer-group worker: at-least-once delivery, deduped, with reclaim and dead letters.

`Consumer.run()` reads a stream in a group and calls `handler(message, delivery)`
with many messages in flight (`concurrency`). The rules:

- **Ack after success.** An entry is acknowledged only once its handler returned; the
  ack and the group's "done" mark for the message id are one transaction.
- **Dedupe by message id.** A message whose id this group already handled is acked
  without calling the handler (redeliveries, producers that retried).
- **Own pending first.** A restarted consumer (same name) reclaims its own pending
  entries before reading new ones.
- **Retry, then dead-letter.** A failed handler leaves the entry pending; it is retried
  with exponential backoff, and after `max_deliveries` it goes to `dead` with its error
  and delivery count. A message that does not even parse goes there at once.
- **Janitor.** Entries idle longer than `claim_idle_ms` belong to a consumer that died:
  they are claimed (XCLAIM is atomic, one claimer wins) and handled here. Live
  consumers heartbeat their in-flight entries so they are never stolen while working.
- **Graceful stop.** `stop()` (wired to SIGTERM/SIGINT by `stop_on_signals`) stops
  reading, lets in-flight handlers finish within `shutdown_grace_s`, then cancels the
  rest and hands them back: marked idle so another consumer's janitor takes them now.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from prometheus_client import Counter, Gauge, Histogram
from redis.exceptions import RedisError

from shared import keys as K
from shared.errors import MalformedMessage
from shared.schemas import Message
from shared.streams import Bus

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

HANDLED = Counter("nextstate_consumer_handled_total", "Messages handled and acked", ["stream", "group"])
FAILED = Counter("nextstate_consumer_failed_total", "Handler failures (will retry)", ["stream", "group"])
DEAD = Counter("nextstate_consumer_dead_total", "Messages moved to the dead stream", ["stream", "group"])
DUPLICATES = Counter(
    "nextstate_consumer_duplicates_total", "Redeliveries of already-handled ids", ["stream", "group"]
)
RECLAIMED = Counter(
    "nextstate_consumer_reclaimed_total", "Entries claimed from silent consumers", ["stream", "group"]
)
JANITOR_PASSES = Counter(
    "nextstate_consumer_janitor_passes_total",
    "Janitor passes completed (reclaim idle entries, trim, export backlog); flat: the janitor is stuck",
    ["stream", "group"],
)
INFLIGHT = Gauge("nextstate_consumer_inflight", "Handlers running now", ["stream", "group"])
GROUP_LAG = Gauge(
    "nextstate_stream_group_lag", "Entries not yet delivered to the group (as seen by a consumer)",
    ["stream", "group"],
)
GROUP_PENDING = Gauge(
    "nextstate_stream_group_pending", "Entries delivered to the group but not acknowledged",
    ["stream", "group"],
)
STREAM_LENGTH = Gauge("nextstate_stream_length", "Entries in the stream", ["stream"])
HANDLE_SECONDS = Histogram(
    "nextstate_consumer_handle_seconds", "Handler duration", ["stream", "group"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)


@dataclass(frozen=True)
class Delivery:
    """Where a message came from, for handlers that care (logging, retries)."""

    stream: str
    entry_id: str
    deliveries: int


Handler = Callable[[M, Delivery], Awaitable[None]]


def consumer_name(configured: str | None, service: str) -> str:
    """The consumer name a service instance uses: `configured` with `{hostname}` and `{pid}`
    filled in (`judge-{hostname}` in a container, `buffer`), else `<service>-<host>-<pid>`.

    A stable name (no `{pid}`) lets a restarted instance take back its own pending entries
    at once; the default is unique per process, so its pending entries wait for the janitor.
    """
    template = configured or f"{service}-{{hostname}}-{{pid}}"
    return template.replace("{hostname}", socket.gethostname()).replace("{pid}", str(os.getpid()))


def default_consumer_name(service: str) -> str:
    """`<service>-<host>-<pid>`: unique per process. Set a stable name to reclaim own work on restart."""
    return consumer_name(None, service)


class Consumer(Generic[M]):
    def __init__(
        self,
        bus: Bus,
        stream: str,
        group: str,
        model: type[M],
        handler: Handler[M],
        *,
        name: str,
        concurrency: int = 16,
        dedupe: bool = True,
    ) -> None:
        self.bus = bus
        self.stream = stream
        self.group = group
        self.model = model
        self.handler = handler
        self.name = name
        self.concurrency = concurrency
        self.dedupe = dedupe
        self.cfg = bus.streams
        self.key = bus.keys.stream(stream)
        self._slot_free = asyncio.Event()
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._acks: list[tuple[str, str | None]] = []  # (entry id, message id to mark done)
        self._ack_ready = asyncio.Event()
        self._stopping = asyncio.Event()
        self._closed = asyncio.Event()  # set once in-flight work is finished or handed back
        self._labels = (stream, group)
        self.handled = 0
        self.janitor_passes = 0  # completed passes: a reclaim that was due has been tried

    # -- lifecycle -----------------------------------------------------------------
    def stop(self) -> None:
        """Begin a graceful stop; `run()` returns once in-flight work is done or handed back."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    async def run(self) -> None:
        await self.bus.ensure_group(self.stream, self.group)
        log.info("consumer started", extra={"stream": self.stream, "group": self.group, "consumer": self.name})
        acker = asyncio.create_task(self._ack_loop(), name="acks")
        side = [
            asyncio.create_task(self._janitor_loop(), name="janitor"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
        ]
        try:
            await self._claim_own_pending()
            await self._read_loop()
        finally:
            # Loops finish their current command and exit: never cancel a Redis call midway.
            self._stopping.set()
            await self._drain()
            self._closed.set()
            self._ack_ready.set()
            await asyncio.gather(*side, acker, return_exceptions=True)
            await self._flush_acks()
            log.info("consumer stopped", extra={"stream": self.stream, "consumer": self.name})

    async def _drain(self) -> None:
        pending = list(self._inflight.values())
        if pending:
            _, still = await asyncio.wait(pending, timeout=self.cfg.shutdown_grace_s)
            for t in still:
                t.cancel()
            await asyncio.gather(*still, return_exceptions=True)
        await self._hand_back()

    async def _hand_back(self) -> None:
        """Mark this consumer's unfinished entries long idle so others claim them at once."""
        with contextlib.suppress(RedisError):
            rows = await self.bus.redis.xpending_range(
                self.key, self.group, "-", "+", 10_000, consumername=self.name
            )
            ids = [r["message_id"] for r in rows]
            if ids:
                await self.bus.redis.xclaim(
                    self.key, self.group, self.name, 0, ids,
                    idle=self.cfg.claim_idle_ms * 10, justid=True,
                )
                log.info("handed back unfinished entries", extra={"count": len(ids)})

    # -- reading -----------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while not self.stopping:
            free = self.concurrency - len(self._inflight)
            if free <= 0:
                self._slot_free.clear()
                await _wait_any(self._slot_free, self._stopping)
                continue
            try:
                resp = await self.bus.redis.xreadgroup(
                    self.group, self.name, {self.key: ">"},
                    count=min(self.cfg.read_count, free), block=self.cfg.block_ms,
                )
            except RedisError as exc:
                log.warning("read failed, retrying", extra={"error": str(exc)})
                await self._sleep(1.0)
                continue
            entries = resp[0][1] if resp else []
            await self._dispatch([(eid, fields, 1) for eid, fields in entries])
            if 0 < len(entries) < self.cfg.read_count and self.cfg.linger_ms:
                await self._sleep(self.cfg.linger_ms / 1000)

    async def _dispatch(self, entries: list[tuple[str, dict[str, str] | None, int]]) -> None:
        if not entries:
            return
        parsed: list[tuple[str, M, int]] = []
        for entry_id, fields, deliveries in entries:
            data = (fields or {}).get(K.FIELD)
            if data is None:
                await self._dead(entry_id, "", "entry has no data field (deleted or foreign)", deliveries)
                continue
            try:
                msg = self.model.from_json(data)
            except MalformedMessage as exc:
                await self._dead(entry_id, data, str(exc), deliveries)
                continue
            parsed.append((entry_id, msg, deliveries))
        if self.dedupe and parsed:
            pipe = self.bus.redis.pipeline(transaction=False)
            for _, msg, _ in parsed:
                pipe.exists(self.bus.keys.done(self.group, msg.id))
            seen = await pipe.execute()
            fresh = []
            for (entry_id, msg, n), was_done in zip(parsed, seen, strict=True):
                if was_done:
                    DUPLICATES.labels(*self._labels).inc()
                    self._queue_ack(entry_id, None)
                else:
                    fresh.append((entry_id, msg, n))
            parsed = fresh
        for entry_id, msg, deliveries in parsed:
            if entry_id in self._inflight:
                continue
            task = asyncio.create_task(self._handle(entry_id, msg, deliveries))
            self._inflight[entry_id] = task

    async def _handle(self, entry_id: str, msg: M, deliveries: int) -> None:
        INFLIGHT.labels(*self._labels).inc()
        started = time.perf_counter()
        try:
            await self.handler(msg, Delivery(self.stream, entry_id, deliveries))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            FAILED.labels(*self._labels).inc()
            error = f"{type(exc).__name__}: {exc}"
            if deliveries >= self.cfg.max_deliveries:
                log.error("handler failed for the last time, dead-lettering",
                          extra={"message_id": msg.id, "deliveries": deliveries, "error": error})
                await self._dead(entry_id, msg.to_json(), error, deliveries)
            else:
                delay = min(self.cfg.retry_delay_ms * 2 ** (deliveries - 1), self.cfg.claim_idle_ms) / 1000
                log.warning("handler failed, will retry",
                            extra={"message_id": msg.id, "deliveries": deliveries,
                                   "retry_in_s": delay, "error": error})
                asyncio.get_running_loop().call_later(
                    delay, lambda: asyncio.ensure_future(self._retry(entry_id, delay))
                )
        else:
            self.handled += 1
            HANDLED.labels(*self._labels).inc()
            HANDLE_SECONDS.labels(*self._labels).observe(time.perf_counter() - started)
            self._queue_ack(entry_id, msg.id)
        finally:
            INFLIGHT.labels(*self._labels).dec()
            self._inflight.pop(entry_id, None)
            self._slot_free.set()

    async def _retry(self, entry_id: str, delay_s: float) -> None:
        if self.stopping:
            return  # left pending; the hand-back makes it claimable
        try:
            # The min-idle guard loses to a janitor that claimed it meanwhile (no double work).
            await self._claim([entry_id], int(delay_s * 500), known_deliveries=None)
        except RedisError as exc:
            log.warning("retry claim failed", extra={"error": str(exc)})

    # -- claiming: own pending at start, silent consumers' entries in the janitor --------
    async def _claim(self, ids: list[str], min_idle_ms: int, known_deliveries: dict[str, int] | None) -> int:
        """XCLAIM `ids` for this consumer and handle what we won. Returns how many."""
        if not ids:
            return 0
        if known_deliveries is None:
            rows = await self.bus.redis.xpending_range(self.key, self.group, ids[0], ids[-1], len(ids))
            known_deliveries = {r["message_id"]: int(r["times_delivered"]) for r in rows if r["message_id"] in ids}
        claimed = await self.bus.redis.xclaim(self.key, self.group, self.name, min_idle_ms, ids)
        entries = []
        got = set()
        for entry_id, fields in claimed:
            got.add(entry_id)
            entries.append((entry_id, fields, known_deliveries.get(entry_id, 0) + 1))
        # Ids that were in the PEL but whose entry is gone (trimmed): nothing to do but ack.
        for entry_id in ids:
            if entry_id not in got and entry_id in known_deliveries and min_idle_ms == 0:
                self._queue_ack(entry_id, None)  # pending, but the entry itself was trimmed
        await self._dispatch(entries)
        return len(entries)

    async def _claim_own_pending(self) -> None:
        rows = await self.bus.redis.xpending_range(
            self.key, self.group, "-", "+", 10_000, consumername=self.name
        )
        if rows:
            log.info("reclaiming own pending entries", extra={"count": len(rows)})
            for i in range(0, len(rows), self.cfg.read_count):
                chunk = rows[i : i + self.cfg.read_count]
                await self._claim(
                    [r["message_id"] for r in chunk], 0,
                    {r["message_id"]: int(r["times_delivered"]) for r in chunk},
                )

    async def _janitor_loop(self) -> None:
        interval = max(self.cfg.claim_idle_ms / 2000, 0.05)
        while not self.stopping:
            try:
                await self.reclaim_idle()
                await self.bus.trim_consumed(self.stream)
                await self._export_backlog()
            except RedisError as exc:
                log.warning("janitor pass failed", extra={"error": str(exc)})
            else:
                self.janitor_passes += 1
                JANITOR_PASSES.labels(*self._labels).inc()
            await self._sleep(interval)

    async def _export_backlog(self) -> None:
        """Publish every group's lag and pending of this stream as gauges (for dashboards)."""
        STREAM_LENGTH.labels(self.stream).set(await self.bus.redis.xlen(self.key))
        for g in await self.bus.redis.xinfo_groups(self.key):
            if g.get("lag") is not None:
                GROUP_LAG.labels(self.stream, g["name"]).set(int(g["lag"]))
            GROUP_PENDING.labels(self.stream, g["name"]).set(int(g["pending"]))

    async def reclaim_idle(self) -> int:
        """Claim entries idle past `claim_idle_ms`; dead-letter those delivered too often."""
        if self.stopping:
            return 0
        rows = await self.bus.redis.xpending_range(
            self.key, self.group, "-", "+", self.cfg.read_count, idle=self.cfg.claim_idle_ms
        )
        rows = [r for r in rows if r["message_id"] not in self._inflight]
        to_claim: list[str] = []
        counts: dict[str, int] = {}
        for r in rows:
            entry_id, n = r["message_id"], int(r["times_delivered"])
            if n >= self.cfg.max_deliveries:
                data = await self.bus.redis.xrange(self.key, entry_id, entry_id)
                raw = data[0][1].get(K.FIELD, "") if data else ""
                await self._dead(entry_id, raw,
                                 f"delivered {n} times without an ack (consumer {r['consumer']} went silent)", n)
            else:
                to_claim.append(entry_id)
                counts[entry_id] = n
        if not to_claim:
            return 0
        won = 0
        for entry_id in to_claim:  # one at a time: XCLAIM's min-idle check makes each atomic
            won += await self._claim([entry_id], self.cfg.claim_idle_ms, {entry_id: counts[entry_id]})
        if won:
            RECLAIMED.labels(*self._labels).inc(won)
            log.info("reclaimed idle entries", extra={"count": won, "stream": self.stream})
        return won

    async def _heartbeat_loop(self) -> None:
        """Keep in-flight entries' idle time low so no janitor takes them from a live consumer."""
        interval = max(self.cfg.claim_idle_ms / 3000, 0.05)
        while not self._closed.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closed.wait(), interval)
            # Running handlers and finished ones whose ack is still queued.
            ids = list(self._inflight) + [entry_id for entry_id, _ in self._acks]
            if ids:
                with contextlib.suppress(RedisError):
                    await self.bus.redis.xclaim(self.key, self.group, self.name, 0, ids, justid=True)

    # -- acks and dead letters ---------------------------------------------------------------
    def _queue_ack(self, entry_id: str, message_id: str | None) -> None:
        self._acks.append((entry_id, message_id))
        self._ack_ready.set()

    async def _ack_loop(self) -> None:
        while not self._closed.is_set():
            await self._ack_ready.wait()
            self._ack_ready.clear()
            try:
                await self._flush_acks()
            except RedisError as exc:
                log.warning("ack failed, will retry", extra={"error": str(exc)})
                await asyncio.sleep(0.5)
                self._ack_ready.set()

    async def _flush_acks(self) -> None:
        if not self._acks:
            return
        batch, self._acks = self._acks, []
        try:
            pipe = self.bus.redis.pipeline(transaction=True)
            if self.dedupe:
                for _, message_id in batch:
                    if message_id is not None:
                        pipe.set(self.bus.keys.done(self.group, message_id), 1, ex=self.cfg.dedupe_ttl_s)
            pipe.xack(self.key, self.group, *[entry_id for entry_id, _ in batch])
            await pipe.execute()
        except BaseException:
            self._acks[:0] = batch
            raise

    async def _dead(self, entry_id: str, data: str, error: str, deliveries: int) -> None:
        DEAD.labels(*self._labels).inc()
        await self.bus.dead_letter(self.stream, self.group, entry_id, data, error, deliveries, self.name)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)


async def _wait_any(*events: asyncio.Event) -> None:
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


def stop_on_signals(*stoppables: Any) -> None:
    """Call `.stop()` on each of `stoppables` on SIGTERM or SIGINT (graceful shutdown)."""
    loop = asyncio.get_running_loop()

    def stop() -> None:
        log.info("signal received, stopping")
        for s in stoppables:
            s.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
