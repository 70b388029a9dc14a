"""The buffer's FastAPI app: the `scored` consumer in the lifespan, the HTTP API beside it.

Lifespan start: Redis bus, (tokenizer for imports), the batcher, the consumer group
`buffer` on `scored`, the final-turn loop of the at-least-one rule (finals.py), the
consumer group `buffer` on `outcomes` and the sweep that joins episodes' held turns with
their Outcome (episodes.py), the sweep that rewards chat groups' members against each
other under a group advantage (chat_groups.py), and, when archiving, the bucket and the `archive` group on
`batches` — each a background task. Shutdown is the graceful order: stop reading
`scored` and `outcomes`, claiming final turns and episode sessions; publish partial
batches at once, so in-flight handlers finish and their entries are acknowledged (held
episode turns stay in Redis); stop the batcher (whatever is still unpublished stays
unacknowledged and is redelivered); stop reading `batches`, seal and upload the archive
(batches not uploaded stay pending for the next start); close the clients.

Routes: `GET /get_data` (pull.py), `POST /receive` (seeds.py), `/healthz`, `/readyz`
(Redis answers, both consumers run, the bucket answers when archiving), `/metrics`.
`/get_data`, `/receive` and `/metrics` need the internal token (shared/auth.py; /metrics
not when NEXTSTATE_INTERNAL__METRICS_PUBLIC): one hands out training data, the other
injects it. Errors use OpenAI's error shape: `{"error": {"message", "type", "code"}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from services.buffer import metrics as M
from services.buffer.archive import Archiver
from services.buffer.batcher import Batcher
from services.buffer.chat_groups import ChatGroups
from services.buffer.episodes import Episodes
from services.buffer.finals import Finals
from services.buffer.intake import Intake
from services.buffer.ledger import Ledger, parse_version
from services.buffer.pull import Puller
from services.buffer.seeds import TurnBuilder, parse_records
from services.buffer.settings import BufferSettings
from shared import keys as K
from shared.auth import Guard, InternalAuth
from shared.consumer import Consumer, consumer_name
from shared.errors import BusError, MalformedMessage
from shared.schemas import Message, Outcome, ScoredTurn, TrainBatch
from shared.store import AsyncBucket
from shared.streams import Bus
from shared.telemetry import add_ops_routes

log = logging.getLogger(__name__)

MsgT = TypeVar("MsgT", bound=Message)


def error(status: int, message: str, kind: str = "invalid_request_error", **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}, **extra},
                        status_code=status)


@dataclass
class Runtime:
    """Everything the routes need, built by the lifespan."""

    bus: Bus
    puller: Puller
    builder: TurnBuilder | None = None
    bucket: AsyncBucket | None = None


class ConsumerLoop(Generic[MsgT]):
    """Runs a consumer, starting a fresh one if it dies (e.g. Redis down at start)."""

    def __init__(self, make: Callable[[], Consumer[MsgT]]) -> None:
        self._make = make
        self.current: Consumer[MsgT] | None = None
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()
        if self.current is not None:
            self.current.stop()

    async def run(self) -> None:
        delay = 0.5
        while not self._stopping.is_set():
            self.current = self._make()
            try:
                await self.current.run()
            except Exception as exc:
                log.error("consumer failed, restarting", extra={"error": str(exc), "retry_in_s": delay})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            delay = min(delay * 2, 10.0)

    @property
    def running(self) -> bool:
        return self.current is not None and not self.current.stopping


def build_app(settings: BufferSettings) -> FastAPI:
    cfg = settings.buffer

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            bus = Bus(settings)
            stack.push_async_callback(bus.aclose)
            rt = Runtime(bus=bus, puller=Puller(bus))
            if cfg.tokenizer:
                rt.builder = await asyncio.to_thread(load_builder, cfg.tokenizer)
            ledger = Ledger(bus, settings, cfg.session_ttl_s)
            try:
                await ledger.claim_prefix()  # RunMismatch: another run's prefix, refuse to start
            except RedisError as exc:
                log.warning("could not check which run owns the prefix (Redis down); going on",
                            extra={"error": str(exc)})
            batcher = Batcher(
                ledger.publish_batch, size=cfg.batch_size, max_wait_s=cfg.max_wait_s,
                retry_max_s=cfg.publish_retry_max_s,
            )
            episodes = Episodes(ledger, batcher, cfg)
            groups = ChatGroups(ledger, batcher, cfg)
            intake = Intake(ledger, batcher, cfg, hold_episode=episodes.hold, take_group=groups.take)
            finals = Finals(ledger, batcher, cfg)
            name = consumer_name(cfg.consumer_name, "buffer")
            loop = ConsumerLoop(lambda: Consumer(
                bus, K.SCORED, K.GROUP_BUFFER, ScoredTurn, intake.handle,
                name=name, concurrency=cfg.in_flight,
            ))
            outcome_loop = ConsumerLoop(lambda: Consumer(
                bus, K.OUTCOMES, K.GROUP_OUTCOMES, Outcome, episodes.handle_outcome, name=name,
            ))
            batch_task = asyncio.create_task(batcher.run(), name="batcher")
            consume_task = asyncio.create_task(loop.run(), name="consumer")
            outcome_task = asyncio.create_task(outcome_loop.run(), name="outcomes-consumer")
            finals_task = asyncio.create_task(finals.run(), name="finals")
            episodes_task = asyncio.create_task(episodes.run(), name="episodes")
            groups_task = asyncio.create_task(groups.run(), name="chat-groups")
            archiving: tuple[Archiver, ConsumerLoop[TrainBatch], asyncio.Task[None], asyncio.Task[None]] | None = None
            if cfg.archive:
                rt.bucket = AsyncBucket(settings.bucket, max_workers=2)
                stack.push_async_callback(rt.bucket.aclose)
                archive_name = f"{name}-archive"

                async def report(state: dict[str, Any]) -> None:  # for `nextstate status`
                    await bus.redis.hset(bus.keys.archive_state, archive_name, json.dumps(state))

                archiver = Archiver(
                    rt.bucket, settings.run, roll_samples=cfg.archive_roll_samples,
                    roll_s=cfg.archive_roll_s, max_pending=cfg.archive_max_pending,
                    retry_max_s=cfg.archive_retry_max_s, max_batches=cfg.archive_in_flight // 2,
                    report=report,
                )
                archive_loop = ConsumerLoop(lambda: Consumer(
                    bus, K.BATCHES, K.GROUP_ARCHIVE, TrainBatch, archiver.handle,
                    name=archive_name, concurrency=cfg.archive_in_flight,
                ))
                archiving = (archiver, archive_loop,
                             asyncio.create_task(archiver.run(), name="archive"),
                             asyncio.create_task(archive_loop.run(), name="archive-consumer"))
            app.state.rt = rt
            app.state.consumers = {K.SCORED: loop, K.OUTCOMES: outcome_loop}
            log.info("buffer started", extra={
                "consumer": name, "batch_size": cfg.batch_size, "mode": cfg.mode,
                "max_staleness": cfg.max_staleness, "archive": cfg.archive,
                "imports": rt.builder is not None, "auth": settings.internal.token is not None})
            try:
                yield
            finally:
                loop.stop()
                outcome_loop.stop()
                finals.stop()
                episodes.stop()
                groups.stop()
                batcher.drain()
                grace = settings.streams.shutdown_grace_s
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        asyncio.gather(consume_task, outcome_task, finals_task, episodes_task, groups_task),
                        grace + 5)
                batcher.stop()
                await batch_task
                if archiving is not None:
                    archiver, archive_loop, archive_task, archive_consumer = archiving
                    archive_loop.stop()
                    await archiver.close(archive_task, timeout=grace)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(archive_consumer, grace + 5)
                log.info("buffer stopped")

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def rt() -> Runtime:
        runtime: Runtime = app.state.rt
        return runtime

    async def redis_ok() -> None:
        await rt().bus.ping()

    async def consumer_ok() -> None:
        for stream, consumer in app.state.consumers.items():
            if not consumer.running:
                raise RuntimeError(f"the {stream} consumer is not running")

    checks: dict[str, Callable[[], Awaitable[object]]] = {"redis": redis_ok, "consumer": consumer_ok}
    if cfg.archive:
        async def bucket_ok() -> None:
            bucket = rt().bucket
            assert bucket is not None
            await bucket.ping()

        checks["bucket"] = bucket_ok
    add_ops_routes(app, checks)

    @app.get("/get_data")
    async def get_data(
        n: int = Query(1, ge=1, le=cfg.get_data_max),
        wait: float = Query(0.0, ge=0, le=cfg.get_data_max_wait_s),
    ) -> Response:
        try:
            batches = await rt().puller.pull(n, wait)
        except (RedisError, BusError) as exc:
            return error(503, f"Redis did not answer: {exc}; retry", "server_error")
        body = f'{{"count":{len(batches)},"batches":[{",".join(batches)}]}}'
        return Response(body, media_type="application/json")

    @app.post("/receive")
    async def receive(request: Request) -> JSONResponse:
        return await _receive(rt(), request, cfg.receive_max_records, tokenize_lock)

    tokenize_lock = asyncio.Lock()

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', 'invalid')}"
            for e in exc.errors())
        return error(400, problems)

    @app.exception_handler(Exception)
    async def unhandled(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", extra={"path": request.url.path})
        return error(500, f"internal error: {type(exc).__name__}", "server_error")

    app.add_middleware(InternalAuth, guard=Guard.of(settings.internal), refuse=lambda m: error(401, m))
    return app


def load_builder(tokenizer: str) -> TurnBuilder:
    from shared.chat import ChatTemplate  # transformers: only when imports are configured

    return TurnBuilder(ChatTemplate.from_pretrained(tokenizer))


async def _receive(rt: Runtime, request: Request, max_records: int, lock: asyncio.Lock) -> JSONResponse:
    if rt.builder is None:
        return error(503, "imports are off: set NEXTSTATE_BUFFER__TOKENIZER to the policy's "
                          "tokenizer folder and restart the buffer", "server_error")
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        M.IMPORT_REJECTED.inc()
        return error(400, f"the body is not JSON: {exc}")
    try:
        records = parse_records(body)
    except MalformedMessage as exc:
        M.IMPORT_REJECTED.inc()
        return error(400, str(exc))
    if len(records) > max_records:
        M.IMPORT_REJECTED.inc()
        return error(413, f"{len(records)} records in one request; send at most {max_records}")
    builder = rt.builder
    try:
        version = parse_version(await rt.bus.redis.get(rt.bus.keys.trainer_version)) or 0
        async with lock:
            turns, counts = await asyncio.to_thread(builder.turns, records, version)
    except RedisError as exc:
        return error(503, f"Redis did not answer: {exc}; retry the request", "server_error")
    except ValueError as exc:  # the chat template cannot render it
        M.IMPORT_REJECTED.inc()
        return error(400, f"cannot tokenize: {exc}")
    published = 0
    try:
        for turn in turns:
            if await rt.bus.publish(K.TURNS, turn) is None:
                raise BusError("the turns stream is over its bound (the judges are behind)")
            published += 1
    except (BusError, RedisError) as exc:
        M.IMPORTED.labels("published").inc(published)
        log.warning("import interrupted", extra={"published": published, "of": len(turns),
                                                 "error": str(exc)})
        return error(503, f"{exc}; published {published} of {len(turns)} turns: retry the whole "
                          "request (turn ids are deterministic, so nothing is imported twice)",
                     "server_error", published=published)
    M.IMPORTED.labels("published").inc(counts.published)
    M.IMPORTED.labels("side").inc(counts.side)
    M.IMPORTED.labels("untrainable").inc(counts.untrainable)
    log.info("records imported", extra={"records": len(records), "published": counts.published,
                                        "side": counts.side, "untrainable": counts.untrainable})
    return JSONResponse({"records": len(records), "published": counts.published,
                         "side": counts.side, "untrainable": counts.untrainable,
                         "turn_ids": [t.id for t in turns]})
