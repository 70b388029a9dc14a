"""The judge-model engine is training side: `nextstate up --judge-model` with a judge model
that cannot load still comes up and serves the users; the judge-model engine is restarted
(with backoff) and shown failing in `nextstate status`, the judges wait for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.servers import REPO
from tests.support.upstack import UpStack

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_judge_model_that_fails_never_stops_the_serving_path(tiny_model: Path, tmp_path: Path, unique: str) -> None:
    broken = tmp_path / "broken-judge"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_model / "config.json").read_text())  # no weights: cannot load
    stack = UpStack(tiny_model, tmp_path / "home", f"jmfail-{unique}", f"jmfail-{unique}",
                    args=["--no-train", "--judge-model", str(broken)])
    stack.start()  # returns once up says its OpenAI endpoint: the serving path is up
    try:
        with httpx.Client(timeout=60) as http:
            done = http.post(f"{stack.collector}/chat/completions", json={
                "model": "policy", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert done.status_code == 200, done.text
        env = {k: v for k, v in os.environ.items() if not k.startswith("NEXTSTATE_")}
        env.update(NEXTSTATE_HOME=str(stack.home), NEXTSTATE_RUN=stack.run)
        deadline = time.monotonic() + 120
        while True:  # the judge-model engine exits, is restarted, exits again...
            out = subprocess.run([sys.executable, "-m", "services.ctl", "status", "--json", "--window", "0"],
                                 cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            procs = json.loads(out.stdout)["services"]
            if procs.get("judge-model", {}).get("restarts", 0) >= 1:
                break
            assert time.monotonic() < deadline, f"the judge-model engine was never restarted:\n{stack.logs()}"
            time.sleep(0.5)
        judge_model = procs["judge-model"]
        assert judge_model["serving_path"] is False and judge_model["state"] in ("restarting", "crash-loop", "starting")
        assert {procs[n]["state"] for n in ("engine", "collector")} == {"ready"}
        assert procs["judge-0"]["state"] in ("starting", "running", "ready")  # waits for its judge model
        with httpx.Client(timeout=60) as http:  # still serving after the judge model's failures
            again = http.post(f"{stack.collector}/chat/completions", json={
                "model": "policy", "max_tokens": 2, "messages": [{"role": "user", "content": "again"}]})
            assert again.status_code == 200, again.text
    finally:
        assert stack.stop() == 0, stack.logs()
