"""LoRA versions end to end, as a user runs them: `nextstate up --lora 8`, agents through the
official openai client, real processes only (SeaweedFS, Redis, our engine on a tiny model,
collector, rule judge, buffer, trainer, watcher).

- every version is a PEFT adapter (`format: adapter`, rank 8, the base model's fingerprint),
  served by name: the engine holds the newest one only, answers carry its version
  (`X-Policy-Version`), and the captured turns record it;
- `nextstate rollback K` puts adapter version K back into the engine and the answers;
- a killed engine comes back on its base weights and the watcher loads its adapter again;
- a corrupt adapter (its bytes differ from the manifest) is refused, and the last good
  adapter keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from shared import checkpoints as ckpt
from shared.keys import Keys
from shared.runs import model_fingerprint
from shared.schemas import CheckpointManifest, LatestPointer, Turn
from shared.settings import BucketSettings
from shared.store import Bucket
from tests.support.load import Load
from tests.support.servers import REPO
from tests.support.upstack import NEXTSTATE, UpStack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

T = TypeVar("T")


async def until(cond: Callable[[], T | None], timeout: float, what: str, stack: UpStack) -> T:
    deadline = time.monotonic() + timeout
    while not (got := await asyncio.to_thread(cond)):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{stack.logs(8000)}")
        await asyncio.sleep(0.25)
    return got


def bucket(stack: UpStack) -> Bucket:
    env = stack.bucket_env()
    return Bucket(BucketSettings(endpoint=env["NEXTSTATE_BUCKET__ENDPOINT"], name=env["NEXTSTATE_BUCKET__NAME"],
                                 access_key=env["NEXTSTATE_BUCKET__ACCESS_KEY"],
                                 secret_key=env["NEXTSTATE_BUCKET__SECRET_KEY"]))


async def test_adapter_versions_served_by_name_rolled_back_restored_and_a_corrupt_one_refused(
    tiny_model: Path, tmp_path: Path, unique: str
) -> None:
    stack = UpStack(tiny_model, tmp_path / "home", run=f"lora-{unique}", prefix=f"l-{unique}",
                    args=["--lora", "8", "--lr", "1e-2", "--batch-size", "4", "--max-wait", "2", "--no-eval"],
                    env={"NEXTSTATE_WATCHER__POLL_INTERVAL_S": "0.5", "NEXTSTATE_WATCHER__RETRY_BAD_AFTER_S": "600",
                         "NEXTSTATE_TRAINER__KEEP_VERSIONS": "100"})
    await asyncio.to_thread(stack.start)
    load = Load(stack.collector, agents=2, turns=3).start()
    b = bucket(stack)
    run, keys = stack.run, Keys(stack.prefix)

    def engine_info() -> dict[str, Any]:
        info: dict[str, Any] = httpx.get(f"{stack.engine}/model_info", headers=stack.internal_headers(),
                                         timeout=5).json()
        return info

    def answered(since: float) -> set[str]:
        return {s.weight_version for s in load.served if s.started >= since}

    try:
        # Versions advance, each an adapter served by name; the engine holds the newest only.
        seen = await until(lambda: (v := {x for x in answered(0) if x.isdigit() and int(x) > 0}) and len(v) >= 2
                           and v, 300, "answers from two adapter versions", stack)
        served = int(stack.engine_version() or 0)
        info = engine_info()
        assert list(info["lora_adapters"]) == [str(served)] and info["base_weight_version"] == "0"
        m = ckpt.read_manifest(b, ckpt.manifest_key(run, served))
        assert (m.format, m.adapter and m.adapter.rank, m.base_fingerprint) == (
            "adapter", 8, model_fingerprint(tiny_model))
        assert {f.path for f in m.files} == {"adapter_config.json", "adapter_model.safetensors"}
        with stack.redis() as r:
            turns = [Turn.from_json(f["data"]) for _, f in r.xrange(keys.turns)]
        assert {t.weight_version for t in turns} & seen and all(
            t.policy_version == int(t.weight_version) for t in turns)

        # A rollback to the first trained version: its adapter is served again.
        first = min(int(x) for x in seen)
        t0 = time.time()
        out = subprocess.run([NEXTSTATE, "rollback", str(first)], cwd=REPO, capture_output=True, text=True,
                             timeout=60, env={**os.environ, "NEXTSTATE_HOME": str(stack.home), "NEXTSTATE_RUN": run})
        assert out.returncode == 0, out.stderr
        await until(lambda: str(first) in answered(t0 + 0.5), 120, f"answers from v{first} after the rollback", stack)
        after_rollback = await until(lambda: (v := stack.engine_version()) and v.isdigit() and int(v) > first
                                     and int(v), 240, "a version trained after the rollback", stack)
        parent = ckpt.read_manifest(b, ckpt.manifest_key(run, after_rollback)).parent
        assert parent is not None and parent >= first

        # The engine killed: back on its base weights, then its adapter again.
        good = int(stack.engine_version() or 0)
        old = stack.kill("engine")
        await asyncio.to_thread(stack.wait_restarted, "engine", old)
        restored = await until(lambda: (v := stack.engine_version()) and v.isdigit() and int(v) >= good and v,
                               240, "the restarted engine serving an adapter again", stack)
        assert str(restored) in engine_info()["lora_adapters"]

        # A corrupt adapter: refused, the last good one keeps serving.
        await load.stop()
        good = int(stack.engine_version() or 0)
        bad = max(ckpt.all_versions(b, run)) + 100
        source = ckpt.read_manifest(b, ckpt.manifest_key(run, good))
        for f in source.files:
            data = bytearray(b.get_bytes(ckpt.version_prefix(run, good) + f.path))
            if f.path == "adapter_model.safetensors":
                data[-1] ^= 0xFF
            b.put_bytes(ckpt.version_prefix(run, bad) + f.path, bytes(data))
        b.put_json(ckpt.manifest_key(run, bad), CheckpointManifest.model_validate(
            {**source.model_dump(), "version": bad, "id": f"corrupt-{unique}"}))
        b.put_json(ckpt.latest_key(run), LatestPointer(version=bad, manifest=ckpt.manifest_key(run, bad)))

        def refused() -> str | None:
            with stack.redis() as r:
                return r.hget(keys.refused_versions, str(bad))

        assert "checksum" in await until(refused, 120, f"v{bad} refused", stack)
        assert stack.engine_version() == str(good)
        probe = Load(stack.collector, agents=1, turns=1).start()
        await until(lambda: probe.served, 60, "an answer after the refusal", stack)
        await probe.stop()
        assert {s.weight_version for s in probe.served} == {str(good)}
    except BaseException:
        print(stack.logs(20_000))
        raise
    finally:
        if not load._stop.is_set():
            await load.stop()
        b.close()
        await asyncio.to_thread(stack.stop)
