"""The watcher against real processes: SeaweedFS, Redis, the CPU engine, the watcher itself.

A checkpoint published to the bucket is loaded by the engine (`/model_info` shows its
version, generations change); a corrupt one is refused while the engine keeps serving;
`nextstate rollback` sends the engine back to an earlier version.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shared import checkpoints as ckpt
from shared.schemas import PolicyLoaded
from shared.settings import Settings
from shared.store import Bucket
from shared.streams import Bus
from tests.support.servers import REPO, ServiceProcess, free_port
from tests.support.tiny_model import build_tiny_model
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

NEXTSTATE = str(Path(sys.executable).parent / "nextstate")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("watcher-models")
    return {name: build_tiny_model(root / name, seed=seed) for name, seed in (("a", 1), ("b", 2), ("c", 3))}


@pytest.fixture
def engine(models: dict[str, Path], s3_env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    proc = ServiceProcess("engine", s3_env, ["--model", str(models["a"]), "--port", str(port)]).start()
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(f"{url}/health", timeout=120)
        yield url
    finally:
        proc.stop()


@pytest.fixture
def watcher(engine: str, s3_env: dict[str, str], tmp_path: Path) -> Iterator[ServiceProcess]:
    env = {
        **s3_env,
        "NEXTSTATE_WATCHER__ENGINE_URL": engine,
        "NEXTSTATE_WATCHER__POLL_INTERVAL_S": "0.2",
        "NEXTSTATE_WATCHER__LOCAL_DIR": str(tmp_path / "ckpts"),
        "NEXTSTATE_WATCHER__RETRY_BAD_AFTER_S": "3600",
        "NEXTSTATE_WATCHER__PORT": str(free_port()),
    }
    proc = ServiceProcess("watcher", env).start()
    proc.wait_http(f"http://127.0.0.1:{env['NEXTSTATE_WATCHER__PORT']}/readyz", timeout=60)
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.logs()


def greedy(url: str) -> list[float]:
    """Log-probs the serving weights give a fixed sequence: a fingerprint of the weights."""
    r = httpx.post(f"{url}/generate", json={
        "input_ids": [5, 60, 7, 80, 9, 100], "return_logprob": True, "logprob_start_len": 1,
        "sampling_params": {"max_new_tokens": 0}}, timeout=30)
    r.raise_for_status()
    return [round(lp, 5) for lp, _, _ in r.json()["meta_info"]["input_token_logprobs"][1:]]


def weight_version(url: str) -> str:
    return str(httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"])


async def test_publish_load_refuse_corrupt_and_rollback(
    s3_settings: Settings, engine: str, watcher: ServiceProcess, models: dict[str, Path],
    s3_env: dict[str, str],
) -> None:
    run = s3_settings.run
    base_out = greedy(engine)
    with Bucket(s3_settings.bucket) as bucket:
        ckpt.publish_checkpoint(bucket, run, 1, models["b"], step=1)
        await eventually(lambda: weight_version(engine) == "1")
        v1_out = greedy(engine)
        assert v1_out != base_out  # other weights serve now

        async with Bus(s3_settings) as bus:
            rows = await bus.redis.xrange(bus.keys.policy)
            (loaded,) = [PolicyLoaded.from_json(f["data"]) for _, f in rows]
            assert loaded.version == 1 and loaded.weight_version == "1" and loaded.sync_s is not None
            assert await bus.redis.get(bus.keys.policy_version) == "1"

            # v2 is corrupt in the bucket: its weights no longer match the manifest.
            ckpt.publish_checkpoint(bucket, run, 2, models["c"], step=2)
            key = ckpt.version_prefix(run, 2) + "model.safetensors"
            data = bytearray(bucket.get_bytes(key))
            data[-1] ^= 0xFF
            bucket.put_bytes(key, bytes(data))
            await eventually(lambda: "refused" in watcher.logs(20000), 30)
            assert "checksum" in watcher.logs(20000)
            assert weight_version(engine) == "1" and greedy(engine) == v1_out  # still serving v1

            # v3 is good; then roll back to v1 with the CLI.
            ckpt.publish_checkpoint(bucket, run, 3, models["c"], step=3)
            await eventually(lambda: weight_version(engine) == "3")
            out = subprocess.run([NEXTSTATE, "rollback", "1"], env={**os.environ, **s3_env},
                                 cwd=REPO, capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            assert "LATEST -> v1 (was v3)" in out.stdout
            await eventually(lambda: weight_version(engine) == "1")
            assert greedy(engine) == v1_out
            assert not list((Path(watcher.env["NEXTSTATE_WATCHER__LOCAL_DIR"])).glob(".staging-*"))
            listed = subprocess.run([NEXTSTATE, "rollback", "--list"], env={**os.environ, **s3_env},
                                    cwd=REPO, capture_output=True, text=True, timeout=30).stdout
            assert "v1   <- LATEST" in listed and "v3" in listed and "v2" in listed
