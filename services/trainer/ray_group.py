"""Rank 0 drives the data-parallel group: each command it broadcasts is what every rank does next.

    rank 0  the trainer service (consumer, bucket, commits)
              └─ LeadingTrainer.step ── Step(samples, version) ──▶ ranks 1..N-1: follow()
            heartbeat thread ────────── Noop while idle ────────▶ (keeps them inside the timeout)
            on stop ─────────────────── Stop ───────────────────▶ follow() returns

A rank waiting for its next command sits in a collective, and a collective that waits
longer than the process group's timeout fails the group. Traffic can pause for hours,
so while no step is running rank 0 sends a `Noop` every `heartbeat_s`. Commands are
serialised by one lock: a step's broadcast and its gradient all-reduce never interleave
with a heartbeat.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch.distributed as dist

from services.trainer.ray_step import GroupBroken, ShardedTrainer, collective
from services.trainer.step import Trainer
from shared.errors import MalformedMessage
from shared.schemas import TrainSample

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Command:
    kind: Literal["step", "noop", "stop"]
    samples: list[TrainSample] = field(default_factory=list)
    version: int = 0


NOOP = Command("noop")
STOP = Command("stop")


def exchange(command: Command | None) -> Command:
    """Rank 0 sends `command`; every other rank passes None and gets it."""
    box: list[Command | None] = [command]
    with collective("exchanging a command"):
        dist.broadcast_object_list(box, src=0)
    received = box[0]
    if not isinstance(received, Command):
        raise MalformedMessage(f"rank 0 sent {type(received).__name__}, not a Command")
    return received


class Leader:
    """Rank 0's end of the command channel: send under one lock, heartbeat while idle."""

    def __init__(self, heartbeat_s: float) -> None:
        self.heartbeat_s = heartbeat_s
        self.lock = threading.Lock()
        self.last_sent = time.monotonic()
        self.closed = threading.Event()
        self.started = False
        self.stopped = False
        self.broken = False  # a collective failed: nothing more is sent
        self.beats = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin heartbeats; from now on `close` tells the other ranks to stop."""
        self.started = True
        self.last_sent = time.monotonic()
        self._thread = threading.Thread(target=self._beat, name="ddp-heartbeat", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def command(self, command: Command) -> Iterator[None]:
        """Send `command` and hold the channel for the collectives it implies (a step)."""
        with self.lock:
            self._send(command)
            try:
                yield
            except GroupBroken:
                self.broken = True
                raise

    def _send(self, command: Command) -> None:
        if self.stopped or self.broken:
            raise GroupBroken("the data-parallel group was told to stop, or broke")
        try:
            exchange(command)
        except GroupBroken:
            self.broken = True
            raise
        self.last_sent = time.monotonic()

    def _beat(self) -> None:
        while not self.closed.wait(max(0.0, self.last_sent + self.heartbeat_s - time.monotonic())):
            with self.lock:
                if self.closed.is_set() or self.stopped or self.broken:
                    return
                if time.monotonic() - self.last_sent < self.heartbeat_s:
                    continue
                try:
                    self._send(NOOP)
                    self.beats += 1
                except Exception as exc:  # the group is broken; Ray tears it down
                    log.error("heartbeat to the other ranks failed", extra={"error": str(exc)})
                    return

    def close(self) -> None:
        """Stop heartbeats and tell the other ranks to return (idempotent; no-op before start)."""
        self.closed.set()
        if self._thread is not None:
            self._thread.join()
        if not self.started:
            return  # they are still waiting for the initial state: the group fails instead
        with self.lock:
            if not (self.stopped or self.broken):
                try:
                    self._send(STOP)
                except Exception as exc:  # a broken group: Ray tears the other ranks down
                    log.error("could not tell the other ranks to stop", extra={"error": str(exc)})
                finally:
                    self.stopped = True


class LeadingTrainer(ShardedTrainer):
    """Rank 0's trainer: each step is first sent to the other ranks, then taken together."""

    def __init__(self, trainer: Trainer, leader: Leader) -> None:
        super().__init__(trainer)
        self.leader = leader

    def step(self, samples: Sequence[TrainSample], version: int = 0) -> dict[str, float]:
        with self.leader.command(Command("step", list(samples), version)):
            return super().step(samples, version)


def follow(trainer: ShardedTrainer) -> int:
    """Ranks 1..N-1: take every step rank 0 sends until it says stop; return the steps taken.

    A step that fails fails on every rank (ShardedTrainer agrees on it); rank 0 reports
    it and decides (retry, dead letter), so here it is only logged. A broken group raises.
    """
    steps = 0
    while True:
        command = exchange(None)
        if command.kind == "stop":
            log.info("rank 0 says stop", extra={"rank": dist.get_rank(), "steps": steps})
            return steps
        if command.kind == "step":
            try:
                trainer.step(command.samples, command.version)
                steps += 1
            except GroupBroken:
                raise
            except Exception as exc:
                log.warning("step failed on this rank too", extra={"rank": dist.get_rank(),
                                                                   "error": str(exc)})
