"""The trainer service: batches in from `batches`, versions out to the bucket, acks after commit.

    consumer (group `trainer`) ──handle──▶ FIFO ──▶ train loop ──snapshot──▶ upload loop ──▶ bucket
          ▲                                        (one step at a time)     (one commit at a time,
          └──── ack once the version holding the batch is committed ◀──────── in version order)

Why an in-process upload lane and not an rq job: a commit needs the snapshot the trainer
just took (weights, optimizer state); an rq worker would need that on a shared disk or
shipped through Redis, and versions must commit strictly in order. One background lane
gives the same property — the next step never waits on the bucket — with ordering by
construction, and a crash loses nothing that is not replayed: a batch is acked only
once LATEST points at a version containing it, and a replayed batch whose id is in the
committed lineage is acked without training.

Training runs on a worker thread (torch releases the GIL) so the event loop keeps
acking, heartbeating in-flight entries and serving /metrics during a long step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from services.trainer import metrics as M
from services.trainer.checkpoint import (
    ResumePoint,
    Snapshot,
    commit_snapshot,
    find_resume_point,
    take_snapshot,
)
from services.trainer.settings import TrainerSettings
from services.trainer.step import Trainer, TrainerBroken
from shared import keys as K
from shared.checkpoints import manifest_key
from shared.consumer import Consumer, Delivery, consumer_name, stop_on_signals
from shared.errors import BusError, MalformedMessage, StoreError
from shared.runs import claim_run, record_for
from shared.schemas import CheckpointManifest, CheckpointPublished, TrainBatch
from shared.store import AsyncBucket
from shared.streams import Bus
from shared.telemetry import serve_ops

log = logging.getLogger(__name__)


class RecentIds:
    """An insertion-ordered set that forgets its oldest ids beyond `maxlen`."""

    def __init__(self, ids: list[str], maxlen: int) -> None:
        self.maxlen = maxlen
        self._ids: OrderedDict[str, None] = OrderedDict()
        for i in ids:
            self.add(i)

    def add(self, batch_id: str) -> None:
        self._ids[batch_id] = None
        self._ids.move_to_end(batch_id)
        while len(self._ids) > self.maxlen:
            self._ids.popitem(last=False)

    def __contains__(self, batch_id: object) -> bool:
        return batch_id in self._ids

    def list(self) -> list[str]:
        return list(self._ids)


class TrainerService:
    def __init__(
        self, settings: TrainerSettings, bus: Bus, bucket: AsyncBucket, trainer: Trainer,
        resume: ResumePoint, *, work_dir: Path, static_dir: Path | None,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.cfg = settings.trainer
        self.bus = bus
        self.bucket = bucket
        self.trainer = trainer
        self.work_dir = work_dir
        self.static_dir = static_dir
        self.step = resume.step
        self.version = resume.version  # newest version snapshotted (what the weights build on)
        self.committed_version = resume.version
        self.next_version = resume.next_version
        self.lineage = RecentIds(resume.consumed, self.cfg.remember_batches)  # trained, this lineage
        self.committed = RecentIds(resume.consumed, self.cfg.remember_batches)
        self.inflight: dict[str, asyncio.Future[None]] = {}
        self.queue: asyncio.Queue[TrainBatch | None] = asyncio.Queue()
        self.uploads: asyncio.Queue[Snapshot | None] = asyncio.Queue()
        self.upload_slots = asyncio.Semaphore(self.cfg.max_pending_uploads)
        self.window: list[str] = []
        self.window_metrics: list[dict[str, float]] = []
        self.stopping = asyncio.Event()
        self.failed: BaseException | None = None
        M.VERSION.set(resume.version)

    # -- the consumer's handler -------------------------------------------------------------------
    async def handle(self, batch: TrainBatch, delivery: Delivery) -> None:
        """Queue the batch for training; return once a committed version includes it."""
        if batch.run != self.settings.run:
            raise MalformedMessage(f"batch {batch.id} was built for run {batch.run!r}; this trainer "
                                   f"trains run {self.settings.run!r} (check NEXTSTATE_RUN)")
        if batch.id in self.committed:
            M.REPLAYED.inc()
            log.info("batch already in a committed version, acking without training",
                     extra={"batch_id": batch.id, "entry_id": delivery.entry_id})
            return
        fut = self.inflight.get(batch.id)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved
            self.inflight[batch.id] = fut
            self.queue.put_nowait(batch)
        await asyncio.shield(fut)

    def stop(self) -> None:
        """Stop training after the current step; what was trained is still committed."""
        if not self.stopping.is_set():
            self.stopping.set()
            self.queue.put_nowait(None)

    # -- training ------------------------------------------------------------------------------------
    async def train_loop(self) -> None:
        broken: TrainerBroken | None = None
        while True:
            batch = await self.queue.get()
            if batch is None or self.stopping.is_set():
                self._hand_back(batch)
                break
            fut = self.inflight[batch.id]
            try:
                metrics = await asyncio.to_thread(self.trainer.step, batch.samples, self.version)
            except TrainerBroken as exc:  # not the batch's fault: stop, it is replayed on restart
                log.error("trainer broken, stopping", extra={"batch_id": batch.id, "error": str(exc)})
                self._hand_back(batch)
                self.stop()
                broken = exc
                break
            except Exception as exc:
                M.FAILED_BATCHES.inc()
                log.error("training step failed", extra={"batch_id": batch.id, "error": str(exc)})
                self.inflight.pop(batch.id, None)
                fut.set_exception(exc)
                continue
            self.step += 1
            self.window.append(batch.id)
            self.window_metrics.append(metrics)
            self.lineage.add(batch.id)
            M.observe_step(metrics)
            log.info("step", extra={
                "step": self.step, "batch_id": batch.id, "samples": len(batch.samples),
                "loss": round(metrics.get("loss", 0.0), 6), "grad_norm": round(metrics["grad_norm"], 4),
                "clip_frac": round(metrics.get("clip_frac", 0.0), 4),
                "tokens_per_s": round(metrics["tokens_per_s"], 1)})
            if len(self.window) >= self.cfg.checkpoint_every:
                await self.snapshot()
        if self.window:  # stopping: commit what was trained so its batches can be acked
            await self.snapshot()
        self._hand_back_queued()
        await self.uploads.put(None)
        if broken is not None:
            raise broken

    def _hand_back(self, batch: TrainBatch | None) -> None:
        """An untrained batch stays pending in the stream for the next start."""
        if batch is not None and (fut := self.inflight.pop(batch.id, None)) is not None:
            fut.cancel()

    def _hand_back_queued(self) -> None:
        while not self.queue.empty():
            self._hand_back(self.queue.get_nowait())

    async def snapshot(self) -> None:
        await self.upload_slots.acquire()
        version, self.next_version = self.next_version, self.next_version + 1
        started = time.perf_counter()
        snap = await asyncio.to_thread(
            take_snapshot, self.trainer, version, self.step, self.window, self.lineage.list(),
            M.average(self.window_metrics),
        )  # fmt: skip
        M.SNAPSHOT_SECONDS.observe(time.perf_counter() - started)
        self.version = version
        self.window, self.window_metrics = [], []
        M.PENDING_UPLOADS.inc()
        await self.uploads.put(snap)

    # -- committing ----------------------------------------------------------------------------------
    async def upload_loop(self) -> None:
        while (snap := await self.uploads.get()) is not None:
            manifest = await self.commit(snap)
            self.upload_slots.release()
            M.PENDING_UPLOADS.dec()
            await self.announce(manifest)
            self.committed_version = snap.version
            for batch_id in snap.batch_ids:
                self.committed.add(batch_id)
                fut = self.inflight.pop(batch_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(None)

    async def commit(self, snap: Snapshot) -> CheckpointManifest:
        """Commit one version, retrying with backoff until the bucket takes it."""
        delay = 1.0
        while True:
            started = time.perf_counter()
            try:
                manifest = await self.bucket.run(
                    commit_snapshot, self.bucket.sync, self.settings.run, snap, self.trainer.model,
                    work_dir=self.work_dir, static_dir=self.static_dir, base_model=self.cfg.model,
                    keep=self.cfg.keep_versions,
                )  # fmt: skip
            except (StoreError, OSError) as exc:
                M.COMMIT_FAILURES.inc()
                log.error("commit failed, will retry", extra={
                    "version": snap.version, "retry_in_s": delay, "error": str(exc)})
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.cfg.upload_retry_max_s)
                continue
            seconds = time.perf_counter() - started
            M.COMMIT_SECONDS.observe(seconds)
            M.COMMITS.inc()
            M.VERSION.set(snap.version)
            log.info("committed version", extra={
                "version": snap.version, "step": snap.step, "batches": len(snap.batch_ids),
                "seconds": round(seconds, 3), "lag_s": round(time.time() - snap.taken_at, 3)})
            return manifest

    async def announce(self, manifest: CheckpointManifest) -> None:
        """`trainer_version` key and a `checkpoints` entry; informational, so best effort."""
        msg = CheckpointPublished(
            run=manifest.run, version=manifest.version, step=manifest.step,
            manifest=manifest_key(manifest.run, manifest.version), metrics=manifest.metrics,
        )  # fmt: skip
        for attempt in range(3):
            try:
                await self.bus.redis.set(self.bus.keys.trainer_version, manifest.version)
                await self.bus.publish(K.CHECKPOINTS, msg)
                return
            except (RedisError, BusError) as exc:
                log.warning("could not announce version", extra={
                    "version": manifest.version, "attempt": attempt + 1, "error": str(exc)})
                await asyncio.sleep(0.5 * (attempt + 1))

    # -- life --------------------------------------------------------------------------------------------
    async def run(self, consumer: Consumer[TrainBatch]) -> None:
        """Train until `stop()` (or a worker fails); commit what was trained; hand back the rest."""
        workers = [asyncio.create_task(self.train_loop(), name="train"),
                   asyncio.create_task(self.upload_loop(), name="upload")]

        def on_done(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and task.exception() is not None:
                self.failed = task.exception()
                log.error("trainer worker failed", exc_info=task.exception())
                self.stop()
                consumer.stop()

        for w in workers:
            w.add_done_callback(on_done)
        try:
            await consumer.run()
        finally:
            self.stop()
            _, late = await asyncio.wait(workers, timeout=self.cfg.shutdown_upload_s)
            for w in late:
                log.error("gave up waiting for uploads; their batches will be replayed",
                          extra={"task": w.get_name()})
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)


@dataclass(frozen=True)
class Hooks:
    """How another backend runs this same service (services/trainer/ray_backend.py: rank 0)."""

    prepare: Callable[[Trainer], Trainer]  # on a worker thread once built, e.g. join a DDP group
    stopped: Callable[[], Awaitable[object]]  # returns when to stop (instead of SIGTERM/SIGINT)


async def run(settings: TrainerSettings, hooks: Hooks | None = None) -> None:
    """The process: ops endpoints, resume from the bucket (reporting checkpoints refused on the
    way), consume `batches` until SIGTERM."""
    from services.trainer.build import build_trainer
    from services.trainer.model import write_tokenizer
    from shared.cpus import torch_threads

    cfg = settings.trainer
    torch_threads(cfg.threads)
    own_dir = cfg.work_dir is None
    work_dir = Path(cfg.work_dir or tempfile.mkdtemp(prefix="nextstate-trainer-"))
    await asyncio.to_thread(work_dir.mkdir, parents=True, exist_ok=True)
    ready: dict[str, Any] = {}
    async with AsyncExitStack() as stack:
        if own_dir:
            stack.callback(shutil.rmtree, work_dir, True)
        bus = await stack.enter_async_context(Bus(settings))
        bucket = await stack.enter_async_context(AsyncBucket(settings.bucket))

        async def model_loaded() -> None:
            if "service" not in ready:
                raise RuntimeError("loading the model")

        ops = asyncio.create_task(serve_ops(cfg.host, cfg.port, {
            "redis": bus.ping, "bucket": bucket.ping, "model": model_loaded}, settings.internal))
        stack.push_async_callback(_cancel, ops)
        await bucket.ensure()
        # One base model per run: the first trainer claims the run, a later one on another
        # model refuses to start (shared/runs.py).
        await bucket.run(claim_run, bucket.sync, await asyncio.to_thread(record_for, settings.run, cfg.model))
        resume = await bucket.run(
            find_resume_point, bucket.sync, settings.run, work_dir / "resume", need_weights=not cfg.lora
        )
        await report_refusals(bus, resume)
        trainer = await asyncio.to_thread(build_trainer, cfg, resume)
        if hooks is not None:
            trainer = await asyncio.to_thread(hooks.prepare, trainer)
        shutil.rmtree(work_dir / "resume", ignore_errors=True)
        static_dir = await asyncio.to_thread(
            write_tokenizer, cfg.tokenizer or cfg.model, work_dir / "static")
        service = TrainerService(settings, bus, bucket, trainer, resume,
                                 work_dir=work_dir, static_dir=static_dir)
        consumer = Consumer(
            bus, K.BATCHES, K.GROUP_TRAINER, TrainBatch, service.handle,
            name=consumer_name(cfg.consumer_name or f"trainer-{settings.run}", "trainer"),
            concurrency=cfg.consumer_concurrency,
        )
        if hooks is None:
            stop_on_signals(consumer, service)
        else:
            stop_task = asyncio.create_task(_stop_when(hooks.stopped, consumer, service))
            stack.push_async_callback(_cancel, stop_task)
        ready["service"] = service
        log.info("training", extra={"run": settings.run, "version": resume.version,
                                    "next_version": resume.next_version, "step": resume.step})
        await service.run(consumer)
        if service.failed is not None:
            raise service.failed


async def report_refusals(bus: Bus, resume: ResumePoint) -> None:
    """Each checkpoint refused at resume: an error log, a metric, and a `refused_versions`
    record for the operator (best effort: training goes on without Redis)."""
    now = time.time()
    origin = f"v{resume.version}" if resume.version else "the base model"
    records: dict[str, str] = {}
    for r in resume.refused:
        name = "LATEST" if r.version is None else str(r.version)
        M.REFUSED_VERSIONS.labels(r.reason).inc()
        log.error("refused %s (%s); training resumes from %s",
                  "the LATEST pointer" if r.version is None else f"v{r.version}", r.reason, origin,
                  extra={"version": name, "reason": r.reason, "detail": r.detail[:500],
                         "resumed_from": resume.version})
        records[name] = json.dumps({"by": "trainer", "reason": r.reason, "detail": r.detail[:2000], "at": now})
    if not records:
        return
    try:
        await bus.redis.hset(bus.keys.refused_versions, mapping=records)
    except RedisError as exc:
        log.warning("could not record refused versions", extra={"error": str(exc)})


async def _stop_when(
    stopped: Callable[[], Awaitable[object]], consumer: Consumer[TrainBatch], service: TrainerService
) -> None:
    try:
        await stopped()
        log.info("stop requested, stopping")
    except Exception as exc:  # whoever would tell us is gone: stopping is the safe side
        log.warning("lost the stop signal's source, stopping", extra={"error": str(exc)})
    consumer.stop()
    service.stop()


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
