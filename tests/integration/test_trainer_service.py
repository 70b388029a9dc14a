"""The real `python -m services.trainer` against real Redis and S3: versions, announcements,
and crashes — SIGKILL mid-upload and after the commit but before the ack — that replay
without training any batch twice and resume the optimizer.

The trainer reaches S3 through a small TCP proxy in this test that can hold the response
to one matching request (the request itself goes through), so the kill lands exactly
where the test wants it: mid-upload of a model file, or after LATEST moved.
"""

from __future__ import annotations

import io
import random
import re
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import torch

from services.trainer.checkpoint import STATE_TENSORS, state_key
from shared import keys as K
from shared.checkpoints import (
    download_checkpoint,
    list_versions,
    manifest_key,
    read_latest,
    read_manifest,
)
from shared.keys import Keys
from shared.schemas import CheckpointPublished, TrainBatch, TrainSample
from shared.settings import Settings
from shared.store import Bucket
from tests.support.servers import S3Server, ServiceProcess, free_port, wait_until

pytestmark = pytest.mark.integration


class HoldingProxy:
    """TCP proxy to S3; `hold(pattern)` swallows the response to the next request whose
    head matches, leaving its client waiting (the server still receives and applies it)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.pattern: re.Pattern[bytes] | None = None
        self.held = threading.Event()
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def hold(self, pattern: bytes) -> None:
        with self.lock:
            self.pattern = re.compile(pattern)
            self.held.clear()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream, timeout=10)
            server.settimeout(None)
            self.sockets += [client, server]
            state = {"held": False}
            threading.Thread(target=self._up, args=(client, server, state), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, state), daemon=True).start()

    def _up(self, src: socket.socket, dst: socket.socket, state: dict[str, bool]) -> None:
        tail = b""
        while chunk := _recv(src):
            with self.lock:
                if self.pattern is not None and self.pattern.search(tail + chunk):
                    state["held"] = True  # before forwarding: no byte of the answer escapes
                    self.pattern = None
                    self.held.set()
            tail = chunk[-512:]
            try:
                dst.sendall(chunk)
            except OSError:
                return

    def _down(self, src: socket.socket, dst: socket.socket, state: dict[str, bool]) -> None:
        while chunk := _recv(src):
            if state["held"]:
                continue
            try:
                dst.sendall(chunk)
            except OSError:
                return

    def close(self) -> None:
        self.listener.close()
        for s in self.sockets:
            try:
                s.close()
            except OSError:
                pass


def _recv(s: socket.socket) -> bytes:
    try:
        return s.recv(65536)
    except OSError:
        return b""


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[HoldingProxy]:
    p = HoldingProxy(("127.0.0.1", s3.ports["s3"]))
    yield p
    p.close()


def batch(n: int, run: str) -> TrainBatch:
    rng = random.Random(n)
    samples = []
    for _ in range(3):
        p, r = rng.randint(3, 12), rng.randint(2, 8)
        samples.append(TrainSample(
            session_id=f"s{n}", tokens=[rng.randrange(500) for _ in range(p + r)], response_length=r,
            loss_mask=[1] * r, reward=rng.choice([1.0, -1.0]), policy_version=max(0, n - 2),
            rollout_logprobs=[-rng.uniform(1, 5) for _ in range(r)], temperature=0.7,
        ))  # fmt: skip
    return TrainBatch(id=f"batch-{n}", run=run, samples=samples)


def sigkill(proc: ServiceProcess) -> None:
    """SIGKILL, then reap it and close its log (`stop` on a dead process only cleans up)."""
    assert proc.proc is not None
    proc.proc.kill()
    proc.proc.wait(10)
    proc.stop()


class Harness:
    def __init__(self, env: dict[str, str], settings: Settings, tiny_model: Path, proxy: HoldingProxy) -> None:
        self.port = free_port()
        self.env = {
            **env,
            "NEXTSTATE_BUCKET__ENDPOINT": proxy.endpoint,
            "NEXTSTATE_BUCKET__TIMEOUT": "60",
            "NEXTSTATE_STREAMS__BLOCK_MS": "100",
            "NEXTSTATE_TRAINER__MODEL": str(tiny_model),
            "NEXTSTATE_TRAINER__LR": "1e-3",
            "NEXTSTATE_TRAINER__KEEP_VERSIONS": "10",
            "NEXTSTATE_TRAINER__THREADS": "1",
            "NEXTSTATE_TRAINER__PORT": str(self.port),
        }
        self.run = settings.run
        self.keys = Keys(settings.redis.prefix)
        self.redis: Any = redis.Redis.from_url(settings.redis.url, decode_responses=True, socket_timeout=5)
        self.bucket = Bucket(settings.bucket)  # direct, not through the proxy
        self.tmp = Path(tempfile.mkdtemp(prefix="ns-trainer-test-"))

    def start(self) -> ServiceProcess:
        proc = ServiceProcess("trainer", self.env).start()
        try:
            proc.wait_http(f"http://127.0.0.1:{self.port}/readyz", timeout=90)
        except Exception:
            sigkill(proc)
            raise
        return proc

    def publish(self, b: TrainBatch) -> None:
        self.redis.xadd(self.keys.batches, {K.FIELD: b.to_json()})

    def latest(self) -> int:
        pointer = read_latest(self.bucket, self.run)
        return pointer.version if pointer else 0

    def wait_latest(self, version: int, proc: ServiceProcess) -> None:
        wait_until(lambda: self.latest() >= version, 60, f"LATEST {version}\n{proc.logs()}")

    def pending(self) -> int:
        return int(self.redis.xpending(self.keys.batches, K.GROUP_TRAINER)["pending"])

    def close(self) -> None:
        self.redis.close()
        self.bucket.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def test_versions_announcements_and_crash_replay(
    s3_env: dict[str, str], s3_settings: Settings, tiny_model: Path, proxy: HoldingProxy
) -> None:
    h = Harness(s3_env, s3_settings, tiny_model, proxy)
    procs: list[ServiceProcess] = []
    try:
        # -- A: batches in, versions 1 and 2 out, announced and acked --------------------------
        a = h.start()
        procs.append(a)
        h.publish(batch(1, h.run))
        h.publish(batch(2, h.run))
        h.wait_latest(2, a)
        wait_until(lambda: h.pending() == 0 and h.redis.get(h.keys.trainer_version) == "2", 30, "acks")
        announced = [CheckpointPublished.from_json(f[K.FIELD])
                     for _, f in h.redis.xrange(h.keys.checkpoints)]
        assert [m.version for m in announced] == [1, 2]
        assert announced[1].manifest == manifest_key(h.run, 2) and "loss" in announced[1].metrics

        # -- A is killed mid-upload of version 3: batch 3 trained, not committed, not acked ---
        proxy.hold(rb"PUT /[^ ]*/v000003/model\.safetensors ")
        h.publish(batch(3, h.run))
        assert proxy.held.wait(60), a.logs()
        sigkill(a)
        assert h.latest() == 2 and h.pending() == 1

        # -- B replays batch 3 into v4 (v3 is half-uploaded: never reused); killed after LATEST
        #    moved, before the ack ------------------------------------------------------------
        proxy.hold(rb"PUT /[^ ]*/LATEST ")
        b = h.start()
        procs.append(b)
        assert proxy.held.wait(60), b.logs()
        h.wait_latest(4, b)
        sigkill(b)
        assert h.pending() == 1

        # -- C: batch 3 is already in v4 (acked untrained); batch 4 makes v5 --------------------
        c = h.start()
        procs.append(c)
        wait_until(lambda: h.pending() == 0, 30, f"replayed batch acked\n{c.logs()}")
        h.publish(batch(4, h.run))
        h.wait_latest(5, c)
        wait_until(lambda: h.pending() == 0, 30, "batch 4 acked")
        metrics = httpx.get(f"http://127.0.0.1:{h.port}/metrics", timeout=5).text
        assert "nextstate_trainer_replayed_batches_total 1.0" in metrics
        assert "nextstate_trainer_steps_total 1.0" in metrics  # C trained batch 4 only
        assert c.stop() == 0, c.logs()
    finally:
        for p in procs:
            if p.proc is not None:
                sigkill(p)

    try:
        assert list_versions(h.bucket, h.run) == [1, 2, 4, 5]
        manifests = [read_manifest(h.bucket, manifest_key(h.run, v)) for v in (1, 2, 4, 5)]
        assert [m.consumed_batch_ids for m in manifests] == [["batch-1"], ["batch-2"], ["batch-3"], ["batch-4"]]
        assert [m.step for m in manifests] == [1, 2, 3, 4]
        assert all(m.metrics["staleness"] >= 0 and "grad_norm" in m.metrics for m in manifests)
        # The optimizer carried over every restart: Adam has taken 4 steps, not 1 or 2.
        raw = h.bucket.get_bytes(state_key(h.run, 5, STATE_TENSORS))
        state = torch.load(io.BytesIO(raw), weights_only=True)
        steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
        assert steps == {4.0}
        assert h.redis.get(h.keys.trainer_version) == "5"
    finally:
        h.close()


def test_sigterm_commits_the_partial_window_and_exits_cleanly(
    s3_env: dict[str, str], s3_settings: Settings, tiny_model: Path, proxy: HoldingProxy
) -> None:
    h = Harness({**s3_env, "NEXTSTATE_TRAINER__CHECKPOINT_EVERY": "2", "NEXTSTATE_TRAINER__KL_BETA": "0"},
                s3_settings, tiny_model, proxy)
    proc = h.start()
    try:
        for n in (1, 2, 3):
            h.publish(batch(n, h.run))
        h.wait_latest(1, proc)

        def steps() -> str:
            return httpx.get(f"http://127.0.0.1:{h.port}/metrics", timeout=5).text

        wait_until(lambda: "nextstate_trainer_steps_total 3.0" in steps(), 30, "three steps")
        wait_until(lambda: h.pending() == 1, 30, "batches 1 and 2 acked")  # 3 waits for a version
        assert proc.stop() == 0, proc.logs()
        assert h.latest() == 2 and h.pending() == 0
        m1, m2 = (read_manifest(h.bucket, manifest_key(h.run, v)) for v in (1, 2))
        assert (m1.consumed_batch_ids, m1.step, m1.metrics["steps"]) == (["batch-1", "batch-2"], 2, 2.0)
        assert (m2.consumed_batch_ids, m2.step) == (["batch-3"], 3)
        assert "kl" not in m2.metrics  # beta = 0: no reference forward, no KL to report
    finally:
        if proc.proc is not None:
            sigkill(proc)
        h.close()


@pytest.mark.parametrize("layout", ["delta", "adapter"])
def test_training_goes_on_beside_a_stuck_upload_and_a_kill_mid_upload_loses_nothing(
    s3_env: dict[str, str], s3_settings: Settings, tiny_model: Path, proxy: HoldingProxy, layout: str,
) -> None:  # fmt: skip
    """v3's weights upload hangs: batch 4 is trained meanwhile (the commit does not stall training),
    neither batch is acked. Killed there, the next trainer trains each of them once into new
    versions — the first after the restart a full snapshot (deltas), or an adapter (LoRA) —
    numbered above the half-uploaded v3."""
    env = {**s3_env, "NEXTSTATE_TRAINER__KL_BETA": "0"}
    if layout == "delta":
        env |= {"NEXTSTATE_TRAINER__SNAPSHOT_EVERY": "4", "NEXTSTATE_TRAINER__LR": "1e-5"}
        held = rb"PUT /[^ ]*/v000003/model\.safetensors\.xor\.zst"
    else:
        env |= {"NEXTSTATE_TRAINER__LORA": "true", "NEXTSTATE_TRAINER__LORA_RANK": "4"}
        held = rb"PUT /[^ ]*/v000003/adapter_model\.safetensors"
    h = Harness(env, s3_settings, tiny_model, proxy)
    h.env.update({k: v for k, v in env.items() if k.startswith("NEXTSTATE_TRAINER__")})

    def steps() -> float:
        text = httpx.get(f"http://127.0.0.1:{h.port}/metrics", timeout=5).text
        return float(re.search(r"^nextstate_trainer_steps_total (\S+)", text, re.M).group(1))  # type: ignore[union-attr]

    procs: list[ServiceProcess] = []
    try:
        a = h.start()
        procs.append(a)
        for n in (1, 2):
            h.publish(batch(n, h.run))
        h.wait_latest(2, a)
        proxy.hold(held)
        h.publish(batch(3, h.run))
        assert proxy.held.wait(60), a.logs()
        h.publish(batch(4, h.run))
        wait_until(lambda: steps() == 4.0, 60, f"batch 4 trained beside v3's upload\n{a.logs()}")
        wait_until(lambda: h.pending() == 2, 30, "batches 3 and 4 delivered, unacked")
        assert h.latest() == 2
        sigkill(a)

        b = h.start()
        procs.append(b)
        h.wait_latest(5, b)
        wait_until(lambda: h.pending() == 0, 30, f"batches 3 and 4 acked\n{b.logs()}")
        assert steps() == 2.0  # each replayed batch trained once
        assert b.stop() == 0, b.logs()
    finally:
        for p in procs:
            if p.proc is not None:
                sigkill(p)
    try:
        assert list_versions(h.bucket, h.run) == [1, 2, 4, 5]
        m = {v: read_manifest(h.bucket, manifest_key(h.run, v)) for v in (1, 2, 4, 5)}
        assert [m[v].consumed_batch_ids for v in (1, 2, 4, 5)] == [["batch-1"], ["batch-2"], ["batch-3"], ["batch-4"]]
        if layout == "delta":
            # v2 builds on v1; v4, the first version of the new process, is whole; v5 builds on v4.
            assert [[e.base_version for e in m[v].encoded] for v in (1, 2, 4, 5)] == [[], [1], [], [4]]
            folder = download_checkpoint(h.bucket, m[5], h.tmp / "reader")
            assert (folder / "model.safetensors").stat().st_size == next(
                f.size for f in m[5].files if f.path == "model.safetensors")
        else:
            assert {m[v].format for v in m} == {"adapter"} and all(m[v].adapter for v in m)
    finally:
        h.close()
