"""The watcher against real processes: SeaweedFS, Redis, the CPU engine, the watcher itself.

A checkpoint published to the bucket is loaded by the engine (`/model_info` shows its
version, generations change); a corrupt one is refused while the engine keeps serving;
`nextstate rollback` sends the engine back to an earlier version. Reconciliation: an
engine that restarts on its base weights (SIGKILL, same port) gets its policy back; a
corrupt LATEST keeps the last good version, even for a fresh watcher next to a restarted
engine; weights loaded behind the watcher's back are replaced; /readyz names a mismatch
the watcher could not fix, and Redis always says what the engine really serves. The
engine and the watcher run with an internal token, as every deployment does: the watcher
sends it, and the test's own calls to the engine and the watcher's /metrics send it too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared import checkpoints as ckpt
from shared.auth import bearer
from shared.schemas import PolicyLoaded
from shared.settings import Settings
from shared.store import Bucket
from shared.streams import Bus
from tests.support.servers import REPO, ServiceProcess, free_port
from tests.support.tiny_model import build_tiny_model
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

NEXTSTATE = str(Path(sys.executable).parent / "nextstate")
TOKEN = "watcher-test-internal-token"
AUTH = bearer(TOKEN)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("watcher-models")
    return {name: build_tiny_model(root / name, seed=seed) for name, seed in (("a", 1), ("b", 2), ("c", 3))}


def url_of(proc: ServiceProcess) -> str:
    return f"http://127.0.0.1:{proc.args[proc.args.index('--port') + 1]}"


@pytest.fixture
def engine_proc(models: dict[str, Path], s3_env: dict[str, str]) -> Iterator[ServiceProcess]:
    env = {**s3_env, "NEXTSTATE_INTERNAL__TOKEN": TOKEN}
    proc = ServiceProcess("engine", env, ["--model", str(models["a"]), "--port", str(free_port())]).start()
    try:
        proc.wait_http(f"{url_of(proc)}/health", timeout=120)
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def engine(engine_proc: ServiceProcess) -> str:
    return url_of(engine_proc)


def restart_engine(proc: ServiceProcess) -> None:
    """SIGKILL the engine and start it again on the same port: base weights, version "0"."""
    proc.kill()
    proc.start()
    proc.wait_http(f"{url_of(proc)}/health", timeout=120)


@pytest.fixture
def watcher(engine: str, s3_env: dict[str, str], tmp_path: Path) -> Iterator[ServiceProcess]:
    env = {
        **s3_env,
        "NEXTSTATE_WATCHER__ENGINE_URL": engine,
        "NEXTSTATE_WATCHER__POLL_INTERVAL_S": "0.2",
        "NEXTSTATE_WATCHER__LOCAL_DIR": str(tmp_path / "ckpts"),
        "NEXTSTATE_WATCHER__RETRY_BAD_AFTER_S": "3600",
        "NEXTSTATE_WATCHER__PORT": str(free_port()),
        "NEXTSTATE_INTERNAL__TOKEN": TOKEN,
    }
    proc = ServiceProcess("watcher", env).start()
    proc.wait_http(ops_url(proc, "readyz"), timeout=60)
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.logs()


def ops_url(watcher: ServiceProcess, path: str) -> str:
    return f"http://127.0.0.1:{watcher.env['NEXTSTATE_WATCHER__PORT']}/{path}"


def readyz(watcher: ServiceProcess) -> tuple[int, dict[str, str]]:
    r = httpx.get(ops_url(watcher, "readyz"), timeout=10)
    return r.status_code, r.json()["checks"]


def metric(watcher: ServiceProcess, name: str, **labels: str) -> float | None:
    text = httpx.get(ops_url(watcher, "metrics"), headers=AUTH, timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def greedy(url: str) -> list[float]:
    """Log-probs the serving weights give a fixed sequence: a fingerprint of the weights."""
    r = httpx.post(f"{url}/generate", json={
        "input_ids": [5, 60, 7, 80, 9, 100], "return_logprob": True, "logprob_start_len": 1,
        "sampling_params": {"max_new_tokens": 0}}, headers=AUTH, timeout=30)
    r.raise_for_status()
    return [round(lp, 5) for lp, _, _ in r.json()["meta_info"]["input_token_logprobs"][1:]]


def weight_version(url: str) -> str:
    return str(httpx.get(f"{url}/model_info", headers=AUTH, timeout=10).json()["weight_version"])


def load_behind_the_watchers_back(url: str, model: Path, version: str) -> None:
    r = httpx.post(f"{url}/update_weights_from_disk", timeout=120, headers=AUTH,
                   json={"model_path": str(model), "weight_version": version})
    assert r.status_code == 200 and r.json()["success"], r.text


async def watcher_state(bus: Bus) -> dict[str, str]:
    return dict(await bus.redis.hgetall(bus.keys.watcher_state))


async def state_where(bus: Bus, since: float = 0.0, error_has: str = "", **want: str) -> dict[str, str] | None:
    """The watcher-state hash once a pass checked after `since` and it shows `want`."""
    state = await watcher_state(bus)
    if not state or float(state["checked_at"]) < since or error_has not in state["error"]:
        return None
    return state if all(state.get(k) == v for k, v in want.items()) else None


async def loads(bus: Bus, at_least: int = 0) -> list[tuple[int, str]] | None:
    """(version, cause) of every PolicyLoaded on the `policy` stream, oldest first (None
    while there are fewer than `at_least`)."""
    rows = await bus.redis.xrange(bus.keys.policy)
    got = [(m.version, m.cause) for m in (PolicyLoaded.from_json(f["data"]) for _, f in rows)]
    return got if len(got) >= at_least else None


async def refused(bus: Bus, version: int) -> dict[str, object] | None:
    raw = await bus.redis.hget(bus.keys.refused_versions, str(version))
    return None if raw is None else dict(json.loads(raw))


def corrupt_weights(bucket: Bucket, run: str, version: int) -> None:
    key = ckpt.version_prefix(run, version) + "model.safetensors"
    data = bytearray(bucket.get_bytes(key))
    data[-1] ^= 0xFF
    bucket.put_bytes(key, bytes(data))


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
            # The engine answers with v1 a moment before the watcher's pass announces it.
            await eventually(lambda: state_where(bus, engine_version="1", mismatch="0"), 10, "v1 reported")
            rows = await bus.redis.xrange(bus.keys.policy)
            (loaded,) = [PolicyLoaded.from_json(f["data"]) for _, f in rows]
            assert loaded.version == 1 and loaded.weight_version == "1" and loaded.sync_s is not None
            assert await bus.redis.get(bus.keys.policy_version) == "1"

            # v2 is corrupt in the bucket: its weights no longer match the manifest.
            ckpt.publish_checkpoint(bucket, run, 2, models["c"], step=2)
            corrupt_weights(bucket, run, 2)
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


# A reload is a poll (0.2 s here) plus a swap of tiny weights from the local copy; the
# bound leaves room for two shared cores.
RELOAD_BOUND_S = 20.0


async def test_restarted_engine_gets_its_policy_back(
    s3_settings: Settings, engine_proc: ServiceProcess, engine: str, watcher: ServiceProcess,
    models: dict[str, Path],
) -> None:
    run = s3_settings.run
    with Bucket(s3_settings.bucket) as bucket:
        ckpt.publish_checkpoint(bucket, run, 1, models["b"], step=1)
        await eventually(lambda: weight_version(engine) == "1", 60, "the engine serving v1")
        # From now on v1 exists only in the watcher's local copy: the reload below cannot
        # download it again (LATEST still names it).
        bucket.delete_prefix(ckpt.version_prefix(run, 1))
    v1_out = greedy(engine)
    async with Bus(s3_settings) as bus:
        await eventually(lambda: state_where(bus, engine_version="1", mismatch="0"), 10, "v1 reported")
        assert await bus.redis.get(bus.keys.policy_version) == "1"

        engine_proc.kill()
        # The watcher notes the engine is gone, stops claiming v1 is served, and does not crash.
        state = await eventually(lambda: state_where(bus, error_has="engine unreachable", engine_version=""),
                                 30, "watcher-state: engine unreachable")
        assert state["target_version"] == "1" and state["mismatch"] == "1"
        assert state["engine"] == engine and state["latest_version"] == "1"
        assert await bus.redis.get(bus.keys.policy_version) is None
        status, checks = readyz(watcher)
        assert status == 503 and "should serve v1" in checks["policy"], checks

        engine_proc.start()  # same port, base weights
        engine_proc.wait_http(f"{engine}/health", timeout=120)
        await eventually(lambda: weight_version(engine) == "1", RELOAD_BOUND_S, "v1 served again")
        assert greedy(engine) == v1_out
        state = await eventually(lambda: state_where(bus, engine_version="1", mismatch="0", error=""),
                                 10, "watcher-state: reconciled")
        assert state["target_version"] == "1"
        assert await bus.redis.get(bus.keys.policy_version) == weight_version(engine) == "1"
        assert await loads(bus) == [(1, "new_version"), (1, "reconcile")]
        assert metric(watcher, "nextstate_watcher_reloads_total", cause="reconcile") == 1
        assert metric(watcher, "nextstate_watcher_reloads_total", cause="new_version") == 1
        assert metric(watcher, "nextstate_watcher_policy_version") == 1
        assert metric(watcher, "nextstate_watcher_target_version") == 1
        assert metric(watcher, "nextstate_watcher_mismatch") == 0
        assert readyz(watcher)[0] == 200
    assert "Traceback" not in watcher.logs(50000)


async def test_corrupt_latest_keeps_the_last_good_version(
    s3_settings: Settings, engine_proc: ServiceProcess, engine: str, watcher: ServiceProcess,
    models: dict[str, Path], tmp_path: Path,
) -> None:
    run = s3_settings.run
    with Bucket(s3_settings.bucket) as bucket:
        async with Bus(s3_settings) as bus:
            ckpt.publish_checkpoint(bucket, run, 1, models["b"], step=1)
            await eventually(lambda: weight_version(engine) == "1", 60, "the engine serving v1")
            ckpt.publish_checkpoint(bucket, run, 2, models["c"], step=2)
            await eventually(lambda: weight_version(engine) == "2", 60, "the engine serving v2")
            v2_out = greedy(engine)

            # v3 does not verify: refused and recorded; the engine stays on v2.
            ckpt.publish_checkpoint(bucket, run, 3, models["b"], step=3)
            corrupt_weights(bucket, run, 3)
            record = await eventually(lambda: refused(bus, 3), 30, "v3 in refused-versions")
            assert record["by"] == "watcher" and record["reason"] == "checksum"
            assert "model.safetensors" in str(record["detail"]) and float(str(record["at"])) > 0
            await eventually(lambda: state_where(bus, error_has="v3", engine_version="2", target_version="2",
                                                 latest_version="3", mismatch="0"), 10, "v3 refused, v2 kept")

            # LATEST becomes garbage: the engine keeps serving v2, and the state says why.
            bucket.put_bytes(ckpt.latest_key(run), b"\x00not a pointer{")
            await eventually(lambda: state_where(bus, error_has="LATEST unreadable", latest_version="",
                                                 target_version="2", mismatch="0"), 30, "LATEST unreadable")
            assert weight_version(engine) == "2" and greedy(engine) == v2_out
            assert readyz(watcher)[0] == 200

            # The engine restarts while LATEST is garbage: the watcher puts v2 back.
            restart_engine(engine_proc)
            await eventually(lambda: weight_version(engine) == "2", RELOAD_BOUND_S, "v2 served again")
            assert greedy(engine) == v2_out
            assert (await loads(bus, 3) or [])[-1] == (2, "reconcile")

            # Both restart: a fresh watcher (nothing on its disk, no memory) next to an engine
            # on its base weights. It serves the newest version that verifies: v2, not "0".
            assert watcher.stop() == 0, watcher.logs()
            restart_engine(engine_proc)
            assert weight_version(engine) == "0"
            watcher.env["NEXTSTATE_WATCHER__LOCAL_DIR"] = str(tmp_path / "fresh")
            since = time.time()
            watcher.start()
            await eventually(lambda: weight_version(engine) == "2", 60, "the fresh watcher serving v2")
            assert greedy(engine) == v2_out
            await eventually(lambda: state_where(bus, since, engine_version="2", target_version="2",
                                                 mismatch="0"), 10, "the fresh watcher reporting v2")
            assert await bus.redis.get(bus.keys.policy_version) == "2"
            record = await refused(bus, 3) or {}
            assert record["reason"] == "checksum" and float(str(record["at"])) >= since  # tried first


async def test_foreign_weights_are_replaced_and_an_unfixed_mismatch_is_not_ready(
    s3_settings: Settings, engine: str, watcher: ServiceProcess, models: dict[str, Path],
) -> None:
    run = s3_settings.run
    with Bucket(s3_settings.bucket) as bucket:
        async with Bus(s3_settings) as bus:
            ckpt.publish_checkpoint(bucket, run, 1, models["b"], step=1)
            await eventually(lambda: weight_version(engine) == "1", 60, "the engine serving v1")
            v1_out = greedy(engine)

            # Someone loads other weights behind the watcher's back: v1 is put back.
            load_behind_the_watchers_back(engine, models["c"], "99")
            assert await eventually(lambda: loads(bus, 2), RELOAD_BOUND_S, "a reconcile") == [
                (1, "new_version"), (1, "reconcile")]
            assert weight_version(engine) == "1" and greedy(engine) == v1_out

            # Now v1 can no longer be installed (gone from the bucket and the watcher's disk):
            # the mismatch stays, /readyz says so, Redis says what the engine really serves.
            bucket.delete_prefix(ckpt.version_prefix(run, 1))
            shutil.rmtree(Path(watcher.env["NEXTSTATE_WATCHER__LOCAL_DIR"]) / "v000001")
            load_behind_the_watchers_back(engine, models["c"], "99")
            await eventually(lambda: readyz(watcher)[0] == 503, 30, "/readyz failing")
            checks = readyz(watcher)[1]
            assert checks["policy"].startswith("RuntimeError: engine serves v99, should serve v1"), checks
            assert checks["engine"] == "ok"
            state = await watcher_state(bus)
            assert (state["engine_version"], state["target_version"], state["mismatch"]) == ("99", "1", "1")
            assert await bus.redis.get(bus.keys.policy_version) == "99"
            assert (await refused(bus, 1) or {}).get("reason") == "download"
            assert metric(watcher, "nextstate_watcher_mismatch") == 1

            # A new good version fixes it: ready again.
            ckpt.publish_checkpoint(bucket, run, 2, models["b"], step=2)
            await eventually(lambda: weight_version(engine) == "2", 60, "the engine serving v2")
            await eventually(lambda: readyz(watcher)[0] == 200, 10, "/readyz ready again")
            await eventually(lambda: state_where(bus, engine_version="2", mismatch="0"), 10, "v2 reported")
            assert await bus.redis.get(bus.keys.policy_version) == "2"


async def test_a_version_in_another_dtype_than_served_is_refused(
    s3_settings: Settings, engine: str, watcher: ServiceProcess, models: dict[str, Path], tmp_path: Path,
) -> None:
    """The engine serves its float32 folder as v0; a bf16 version (a trainer publishing
    another dtype than the one served) is refused as incompatible, like a version of other
    shapes, and the engine keeps v0 until a float32 version comes."""
    import torch
    from safetensors.torch import load_file, save_file

    bf16 = tmp_path / "bf16"
    shutil.copytree(models["b"], bf16)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(bf16 / "model.safetensors")).items()}
    save_file(tensors, str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    run = s3_settings.run
    with Bucket(s3_settings.bucket) as bucket:
        async with Bus(s3_settings) as bus:
            ckpt.publish_checkpoint(bucket, run, 1, bf16, step=1)
            record = await eventually(lambda: refused(bus, 1), 30, "v1 in refused-versions")
            assert record["by"] == "watcher" and record["reason"] == "incompatible", record
            assert "weights are bfloat16, the engine serves float32" in str(record["detail"]), record
            assert weight_version(engine) == "0"
            ckpt.publish_checkpoint(bucket, run, 2, models["c"], step=2)
            await eventually(lambda: weight_version(engine) == "2", 60, "the engine serving v2")
