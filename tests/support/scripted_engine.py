"""The scripted stand-in engine (tests/support/standin_engine.py `--script`) as a process for
end-to-end tests, and the counts of the rules it fired.

    engine = scripted_engine_process(model_folder, model="agent-model")  # (process, url)
    wait_ready(engine, collector)                     # tests.support.collector_harness
    counts = ScriptCounts(engine[1])                  # before the run
    ...
    assert counts.fired() == {"codex-call": 1, "codex-answer": 1}  # and none refused
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.support.servers import REPO, ServiceProcess, free_port


@dataclass
class StandInProcess(ServiceProcess):
    """`python -m tests.support.standin_engine` with its log kept (ServiceProcess's
    wait_http, logs and stop)."""

    module: str = "tests.support.standin_engine"

    def start(self) -> StandInProcess:
        env = {**os.environ, **self.env}
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], cwd=REPO, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)  # fmt: skip
        return self


def scripted_engine_process(folder: Path, model: str, script: Path | None = None,
                            latency_ms: float = 1.0) -> tuple[StandInProcess, str]:  # fmt: skip
    """The stand-in on a free port answering by `script` (default: the folder's script.json)
    with the folder's tokenizer, served as `model` (started, not yet waited for)."""
    port = free_port()
    args = ["--port", str(port), "--script", str(script or folder / "script.json"),
            "--tokenizer", str(folder), "--model", model, "--latency-ms", str(latency_ms)]  # fmt: skip
    return StandInProcess("standin-engine", env={}, args=args).start(), f"http://127.0.0.1:{port}"


def script_counts(url: str) -> dict[str, Any]:
    """The engine's `GET /script_counts`: {"counts": {rule: n}, "refused": n, "unmatched": [...]}."""
    resp = httpx.get(f"{url}/script_counts", timeout=10)
    resp.raise_for_status()
    got: dict[str, Any] = resp.json()
    return got


class ScriptCounts:
    """The rules fired since it was made; `fired()` also asserts that no prompt was refused."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.before = script_counts(url)

    def fired(self) -> dict[str, int]:
        now = script_counts(self.url)
        refused = now["refused"] - self.before["refused"]
        assert refused == 0, (
            f"the scripted engine refused {refused} prompt(s); last messages: {now['unmatched']}"
        )
        return {k: n - self.before["counts"].get(k, 0) for k, n in now["counts"].items()
                if n != self.before["counts"].get(k, 0)}  # fmt: skip
