"""The real vLLM server (its CPU build, from `make vllm`) for tests: started the way `nextstate up
--engine vllm` starts it (shared/vllm_engine.py), on a free port, with one thread.

`require_vllm()` skips a test when the vLLM venv is absent, with the reason, except under
`make test` (NEXTSTATE_REQUIRE_VLLM=1), which installs vLLM first and so must run these tests:
there a missing venv is a failure. vLLM's CPU attention needs a head size that is a multiple of
32 (`tiny_vllm_model`: hidden 128 over 4 heads), and an architecture it has: Llama.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from shared.vllm_engine import EngineChoice, VLLMLaunch, vllm_python
from tests.support.servers import free_port
from tests.support.tiny_model import build_tiny_model

TOKEN = "vllm-test-internal-token"


def require_vllm() -> VLLMLaunch:
    """The launch spec (one thread), or skip/fail when vLLM is not installed."""
    if vllm_python(os.environ.get("NEXTSTATE_ENGINE__VLLM_PYTHON")) is None:
        reason = "vLLM is not installed (.venv-vllm): `make vllm` installs it; `make test` does so first"
        if os.environ.get("NEXTSTATE_REQUIRE_VLLM") == "1":
            pytest.fail(reason + ", yet NEXTSTATE_REQUIRE_VLLM=1 asks for the real-vLLM tests")
        pytest.skip(reason)
    return VLLMLaunch.from_choice(EngineChoice(vllm_python=os.environ.get("NEXTSTATE_ENGINE__VLLM_PYTHON"),
                                               threads=1, max_running=8, context_length=1024))


def tiny_vllm_model(path: Path, seed: int = 0) -> Path:
    return build_tiny_model(path, seed=seed, hidden=128)


@dataclass
class VLLMServer:
    model: Path
    log_path: Path
    spec: VLLMLaunch
    token: str = TOKEN
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 240) -> VLLMServer:
        argv, env = self.spec.command(self.model, self.port)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, env={**os.environ, **env, "NEXTSTATE_INTERNAL__TOKEN": self.token},
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}):\n{self.logs()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.5)
        raise TimeoutError(f"vLLM not ready after {timeout}s:\n{self.logs()}")

    def logs(self, tail: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def count(self, request: str, status: int | None = None) -> int:
        """How often the access log shows `request` ('POST /collective_rpc'), with `status`
        when given."""
        line = f'"{request} HTTP/1.1" {status}' if status is not None else f'"{request} HTTP'
        return self.log_path.read_text(errors="replace").count(line)

    def stop(self, timeout: float = 30) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # vLLM's engine-core child, if it outlived it
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None
        self._log.close()
