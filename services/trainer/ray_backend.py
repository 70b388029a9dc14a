"""The trainer on a Ray cluster: the same service, its step data-parallel over Ray Train workers.

    python -m services.trainer   with NEXTSTATE_TRAINER__BACKEND=ray
      this process   ray.init (RAY_ADDRESS / NEXTSTATE_TRAINER__RAY_ADDRESS, else a local
                     cluster) → TorchTrainer(num_workers, use_gpu: NCCL, else gloo).fit()
                     SIGTERM/SIGINT → the stop actor: rank 0 commits what it trained and
                     returns, the others follow; a group still starting is simply shut
                     down; a second signal gives up waiting
      rank 0         the local service unchanged (services/trainer/service.py): consumer on
                     `batches`, resume from LATEST + trainer state, acks after the commit
                     that holds the batch, ops endpoints on TRAINER__HOST:PORT; its step
                     first sends the batch to the other ranks (services/trainer/ray_group.py)
      ranks 1..N-1   build the same model, take rank 0's weights and optimizer state, then
                     train their shard of every batch (services/trainer/ray_step.py)

Ray-side choices: no dashboard, Ray's own logs at WARNING/ERROR (the ranks' logs reach
this process's stderr unless RAY_LOG_TO_DRIVER is off), no usage stats, workers keep
their working directory (on a remote cluster, give paths that exist on every node), and
a failed rank fails the run (max_failures=0): the process exits 1 and its supervisor
restarts it, which resumes from the bucket and replays every unacknowledged batch — the
same recovery as a crash of the local trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

from services.trainer.settings import TrainerConfig, TrainerSettings
from shared.telemetry import configure_logging

log = logging.getLogger(__name__)

STOP_REQUEST_S = 10.0  # to reach the stop actor


class StopSignal:
    """A Ray actor (async) between this process and rank 0: the driver sets it on SIGTERM,
    rank 0 waits on it once its service is about to consume."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.begun = False

    async def begin(self) -> bool:
        """Rank 0 is about to consume; False when a stop came first."""
        self.begun = True
        return not self.event.is_set()

    async def set(self) -> bool:
        """Ask rank 0 to stop; True when it had begun (it will stop by itself)."""
        self.event.set()
        return self.begun

    async def wait(self) -> None:
        await self.event.wait()


def main(settings: TrainerSettings) -> int:
    """Run the group until it stops: 0 after a clean stop, 1 when it failed or could not start."""
    import ray

    cfg = settings.trainer
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")
    try:
        ray.init(
            address=cfg.ray_address, include_dashboard=False, log_to_driver=cfg.ray_log_to_driver,
            logging_level=logging.WARNING,
            logging_config=ray.LoggingConfig(encoding="TEXT", log_level="ERROR"),
        )  # fmt: skip
    except Exception as exc:
        log.error("cannot start or join the Ray cluster", extra={
            "address": cfg.ray_address or os.environ.get("RAY_ADDRESS", "local"), "error": str(exc)})
        return 1
    quiet_logging(settings)  # ray.init applied its logging_config to this process too
    try:
        check_resources(cfg, ray.cluster_resources())  # type: ignore[no-untyped-call]
        return asyncio.run(drive(settings))
    finally:
        ray.shutdown()


def check_resources(cfg: TrainerConfig, cluster: dict[str, float]) -> None:
    """Say so when the cluster cannot hold the group now: Ray Train then waits (for an
    autoscaler, or forever) and nothing else would tell."""
    need = {"CPU": cfg.num_workers * cfg.cpus_per_worker, "GPU": float(cfg.num_workers if cfg.use_gpu else 0)}
    short = {k: (v, cluster.get(k, 0.0)) for k, v in need.items() if v > cluster.get(k, 0.0)}
    if short:
        log.warning("the Ray cluster is too small for the group: waiting for resources", extra={
            "needed": {k: n for k, (n, _) in short.items()}, "cluster": {k: h for k, (_, h) in short.items()}})


async def drive(settings: TrainerSettings) -> int:
    """Fit on a thread of its own; turn a signal into a graceful stop of rank 0."""
    import ray

    stop: Any = ray.remote(num_cpus=0)(StopSignal).remote()
    trainer = torch_trainer(settings, stop)
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[BaseException | None] = loop.create_future()

    def fit() -> None:  # a daemon thread, not the loop's executor: never joined on exit
        error: BaseException | None = None
        try:
            trainer.fit()
        except BaseException as exc:
            error = exc

        def report() -> None:
            if not finished.done():
                finished.set_result(error)

        with contextlib.suppress(RuntimeError):  # the loop is gone: we gave up waiting
            loop.call_soon_threadsafe(report)

    signals: asyncio.Queue[int] = asyncio.Queue()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    threading.Thread(target=fit, name="ray-fit", daemon=True).start()
    log.info("starting the training group on Ray", extra={
        "run": settings.run, "workers": settings.trainer.num_workers, "gpu": settings.trainer.use_gpu})
    asked = False
    while not finished.done():
        waiter = asyncio.ensure_future(signals.get())
        either: set[asyncio.Future[Any]] = {waiter, finished}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            waiter.cancel()
            break
        if asked:
            log.warning("second signal: not waiting for the group; unacked batches will be replayed")
            return 1
        asked = True
        exit_now = await request_stop(stop, waiter.result())
        if exit_now is not None:
            return exit_now
    error = finished.result()
    if error is not None:
        log.error("the training group failed", extra={"error": f"{type(error).__name__}: {error}"})
        return 1
    return 0


async def request_stop(stop: Any, signum: int) -> int | None:
    """Tell rank 0 to stop. None: it will, wait for the group to end; else the exit code now."""
    log.info("signal received, stopping the group", extra={"signal": signum})
    try:
        begun = await asyncio.wait_for(stop.set.remote(), STOP_REQUEST_S)
    except Exception as exc:
        log.error("could not reach the stop actor", extra={"error": f"{type(exc).__name__}: {exc}"})
        return 1
    if not begun:  # still starting (resources, loading): nothing was taken off the stream
        log.info("the group had not begun training: stopping it")
        return 0
    return None


def torch_trainer(settings: TrainerSettings, stop: Any) -> Any:
    """The `TorchTrainer`: N workers, NCCL on GPUs else gloo, no retries (the supervisor's job)."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    cfg = settings.trainer
    resources: dict[str, float] = {"CPU": cfg.cpus_per_worker}
    if cfg.use_gpu:
        resources["GPU"] = 1
    storage = cfg.ray_storage or str(Path(cfg.work_dir or tempfile.gettempdir()) / "nextstate-ray")
    return TorchTrainer(
        rank_main,
        train_loop_config={"settings": settings, "stop": stop},
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, resources_per_worker=resources),
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo",
                                 timeout_s=int(cfg.collective_timeout_s)),
        run_config=ray.train.RunConfig(
            name=f"nextstate-trainer-{settings.run}", storage_path=storage,
            failure_config=ray.train.FailureConfig(max_failures=0),
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),  # type: ignore[call-arg]  # Ray Train v2's RunConfig; the stubs name v1's
    )  # fmt: skip


# -- inside the worker group -------------------------------------------------------------------------
def rank_main(config: dict[str, Any]) -> None:
    """Every rank's entry point (a Ray Train worker, on a thread that is not the main one)."""
    import torch
    import torch.distributed as dist

    settings: TrainerSettings = config["settings"]
    quiet_logging(settings)
    cfg = rank_config(settings.trainer)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if dist.get_rank() == 0:
        lead(settings.model_copy(update={"trainer": cfg}), config["stop"])
    else:
        follow_rank0(cfg)


def quiet_logging(settings: TrainerSettings) -> None:
    """Our logging, as in every service, minus the field Ray stamps on every record (for its
    own formatters; ours would print it)."""
    configure_logging(settings.log, "trainer")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_drop_ray_fields)


def _drop_ray_fields(record: logging.LogRecord) -> bool:
    record.__dict__.pop("_ray_timestamp_ns", None)
    return True


def rank_config(cfg: TrainerConfig) -> TrainerConfig:
    """The configuration as this rank sees it: its device is the one Ray gave it."""
    if not cfg.use_gpu:
        return cfg.model_copy(update={"device": "cpu"})
    import ray.train.torch
    import torch

    device = ray.train.torch.get_device()
    torch.cuda.set_device(device)  # NCCL's object broadcasts use the current device
    return cfg.model_copy(update={"device": str(device)})


def lead(settings: TrainerSettings, stop: Any) -> None:
    """Rank 0: the trainer service, with a step that the whole group takes."""
    from services.trainer.ray_group import Leader, LeadingTrainer
    from services.trainer.ray_step import sync_state
    from services.trainer.service import Hooks, run
    from services.trainer.step import Trainer

    leader = Leader(settings.trainer.heartbeat_s)

    def prepare(trainer: Trainer) -> Trainer:
        leading = LeadingTrainer(trainer, leader)
        sync_state(leading)
        leader.start()
        return leading

    async def stopped() -> None:
        if await stop.begin.remote():
            await stop.wait.remote()

    try:
        asyncio.run(run(settings, Hooks(prepare=prepare, stopped=stopped)))
    finally:
        leader.close()


def follow_rank0(cfg: TrainerConfig) -> None:
    """Ranks 1..N-1: the same model (rank 0's state sent over), then its shard of every step."""
    from services.trainer.build import build_trainer
    from services.trainer.ray_group import follow
    from services.trainer.ray_step import ShardedTrainer, sync_state
    from services.trainer.resume import ResumePoint

    fresh = ResumePoint(version=0, step=0, next_version=1, consumed=[])
    trainer = ShardedTrainer(build_trainer(cfg, fresh))
    sync_state(trainer)
    follow(trainer)
