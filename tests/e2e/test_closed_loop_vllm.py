"""The closed loop on the real vLLM: `nextstate up --engine vllm` + `nextstate demo`, real processes.

`up` starts its own Redis and SeaweedFS, vLLM's CPU build (its own venv, one thread) on a tiny
Llama, the collector, judge (rule), buffer, trainer and watcher. The demo's traffic trains
new versions that the watcher hot-reloads into vLLM; the turns carry them.

Then vLLM dies anyway (SIGKILL): the watcher says so loudly, the collector answers 502 at
once meanwhile (no request waits for its 120 s engine timeout), the supervisor restarts
vLLM, and the watcher puts the last good version (or a newer one) back on it.
(test_vllm_real.py shows a reload that fails in vLLM leaving it serving what it served.)
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from shared.engine_client import VLLMClient
from shared.schemas import PolicyLoaded, Turn
from tests.support.upstack import NEXTSTATE, UpStack
from tests.support.vllm_server import require_vllm, tiny_vllm_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def test_up_with_vllm_trains_serves_and_survives_a_dead_engine(unique: str, tmp_path: Path) -> None:
    spec = require_vllm()
    model = tiny_vllm_model(tmp_path / "tiny")
    stack = UpStack(model=model, home=tmp_path / "home", run=f"vllm-{unique}", prefix=f"v-{unique}",
                    args=["--engine", "vllm", "--no-eval", "--lr", "2e-3", "--batch-size", "8",
                          "--max-wait", "3"],
                    env={"NEXTSTATE_WATCHER__POLL_INTERVAL_S": "0.5", "NEXTSTATE_ENGINE__THREADS": "1",
                         "NEXTSTATE_ENGINE__VLLM_PYTHON": spec.python})  # fmt: skip
    try:
        stack.start(timeout=420)
        assert stack.record()["engine_kind"] == "vllm"
        r = stack.redis()

        def policies() -> list[PolicyLoaded]:
            return [PolicyLoaded.from_json(f["data"]) for _, f in r.xrange(f"{stack.prefix}:policy")]

        def served_a_trained_version() -> bool:
            loaded = policies()
            recent = r.xrevrange(f"{stack.prefix}:turns", count=100)
            return len(loaded) >= 2 and any(
                int(Turn.from_json(f["data"]).weight_version) >= loaded[1].version for _, f in recent)

        # The demo in rounds of 30 s until turns carry a version trained on earlier ones.
        budget = time.monotonic() + 240
        while True:
            demo = subprocess.run(
                [NEXTSTATE, "demo", "--url", stack.collector, "--task", "vowel", "--turns", "800",
                 "--minutes", "0.5", "--max-tokens", "2", "--concurrency", "4", "--json"],
                capture_output=True, text=True, timeout=300,
            )
            assert demo.returncode == 0, demo.stderr[-2000:]
            assert json.loads(demo.stdout.strip().splitlines()[-1])["errors"] == 0
            if served_a_trained_version() or time.monotonic() > budget:
                break
        loaded = policies()
        assert len(loaded) >= 2, f"only {len(loaded)} versions loaded:\n{stack.logs()}"
        turns = [Turn.from_json(f["data"]) for _, f in r.xrange(f"{stack.prefix}:turns")]
        served = {int(t.weight_version) for t in turns}
        assert max(served) >= loaded[1].version, "new turns do not carry the new weight_version"
        assert all(t.policy_version == int(t.weight_version) for t in turns)
        assert r.xlen(f"{stack.prefix}:dead") == 0

        token = stack.secrets()["internal_token"]
        engine = stack.engine
        old_pid = stack.pid("engine")
        assert old_pid is not None

        async def serving() -> str:
            async with VLLMClient(engine, api_key=token, timeout=30) as client:
                return await client.weight_version()

        good = int(asyncio.run(serving()))  # training goes on: whatever it serves now
        assert good >= loaded[-1].version
        stack.kill("engine")
        # While vLLM is down or starting again: 502 at once, never a wait for the timeout.
        body = {"model": "policy", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
        refusals, deadline = [], time.monotonic() + 300
        while True:
            t0 = time.monotonic()
            resp = httpx.post(f"{stack.collector}/chat/completions", json=body, timeout=150)
            if resp.status_code == 200:
                break
            refusals.append((resp.status_code, time.monotonic() - t0))
            assert time.monotonic() < deadline, f"the collector never served again:\n{stack.logs()}"
            time.sleep(0.5)
        assert refusals, "the collector served while vLLM was down"
        assert all(code == 502 and took < 10 for code, took in refusals), refusals
        new_pid = stack.wait_restarted("engine", old_pid, timeout=60)
        assert new_pid != old_pid

        # The restarted vLLM serves its base weights ("0") until the watcher puts the last good
        # version back (or a newer one the trainer committed meanwhile).
        deadline = time.monotonic() + 120
        while int(now := asyncio.run(serving())) < good:
            assert time.monotonic() < deadline, f"v{good} not restored (serving {now}):\n{stack.logs()}"
            time.sleep(0.5)
        after = [PolicyLoaded.from_json(f["data"]) for _, f in r.xrange(f"{stack.prefix}:policy")]
        assert after[-1].version >= good
        assert "THE ENGINE STOPPED ANSWERING" in stack.logs(1_000_000)
        print(f"vLLM loop: {len(loaded)} versions loaded during the demo; after vLLM's death "
              f"{len(refusals)} requests answered 502 in at most {max(t for _, t in refusals):.2f}s; "
              f"v{good} or newer restored (now {now})")
    finally:
        rc = stack.stop()
    assert rc == 0, stack.logs()
