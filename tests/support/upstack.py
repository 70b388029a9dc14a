"""`nextstate up` as a user runs it, for fault tests and benchmarks: start, find, kill, stop.

`UpStack.start()` launches `nextstate up` (its own Redis and SeaweedFS, the engine on a
tiny model, collector, judge, buffer, trainer, watcher) with a private home, run and
prefix, waits until it prints its OpenAI endpoint, and reads the stack record
(`<home>/up/<run>/stack.json`) for every endpoint and process id. `kill(name)` SIGKILLs
one supervised process; `wait_restarted(name, old_pid)` waits for the supervisor to
bring it back. `stop()` sends SIGTERM and waits (then SIGKILLs the process group).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from tests.support.servers import REPO, free_port

NEXTSTATE = str(Path(sys.executable).parent / "nextstate")


@dataclass
class UpStack:
    model: Path
    home: Path
    run: str
    prefix: str
    args: list[str] = field(default_factory=list)  # extra `nextstate up` flags
    env: dict[str, str] = field(default_factory=dict)  # extra NEXTSTATE_* settings
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.home / "up.log"

    @property
    def record_path(self) -> Path:
        return self.home / "up" / self.run / "stack.json"

    def start(self, timeout: float = 300) -> UpStack:
        self.home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "NEXTSTATE_HOME": str(self.home), "NEXTSTATE_RUN": self.run,
               "NEXTSTATE_REDIS__PREFIX": self.prefix, **self.env}
        for inherited in ("NEXTSTATE_REDIS__URL", "NEXTSTATE_BUCKET__ENDPOINT"):
            env.pop(inherited, None)  # this stack starts its own Redis and S3 server
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [NEXTSTATE, "up", "--model", str(self.model), "--port", str(self.port),
             "--home", str(self.home), *self.args],
            env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while "OpenAI endpoint" not in self.logs(100_000):
            if self.proc.poll() is not None:
                raise RuntimeError(f"nextstate up exited ({self.proc.returncode}):\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stack did not come up in {timeout}s:\n{self.logs()}")
            time.sleep(0.25)
        return self

    def logs(self, tail: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def record(self) -> dict[str, Any]:
        rec: dict[str, Any] = json.loads(self.record_path.read_text())
        return rec

    @property
    def collector(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def engine(self) -> str:
        return str(self.record()["engine"])

    @property
    def redis_url(self) -> str:
        """The operator's (ctl) Redis URL, password included (secrets.json)."""
        return str(self.secrets().get("redis_url") or self.record()["redis_url"])

    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, decode_responses=True, socket_timeout=5,
                                    socket_connect_timeout=2)

    def secrets(self) -> dict[str, str]:
        """The credentials `up` recorded for the CLI (secrets.json, owner-only)."""
        got: dict[str, str] = json.loads((self.record_path.parent / "secrets.json").read_text())
        return got

    def bucket_env(self) -> dict[str, str]:
        """Settings to reach this stack's bucket as its admin (the keys `up` generated)."""
        rec, sec = self.record(), self.secrets()
        return {"NEXTSTATE_BUCKET__ENDPOINT": rec["bucket"]["endpoint"],
                "NEXTSTATE_BUCKET__NAME": rec["bucket"]["name"],
                "NEXTSTATE_BUCKET__ACCESS_KEY": sec["bucket_access_key"],
                "NEXTSTATE_BUCKET__SECRET_KEY": sec["bucket_secret_key"]}

    def pid(self, name: str) -> int | None:
        pid = self.record()["services"].get(name, {}).get("pid")
        return int(pid) if pid else None

    def kill(self, name: str) -> int:
        """SIGKILL one supervised process; returns the pid killed."""
        pid = self.pid(name)
        assert pid is not None, f"{name} has no pid in {self.record_path}"
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_restarted(self, name: str, old_pid: int, timeout: float = 120) -> int:
        """Wait for the supervisor to run `name` again under a new pid."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                pid = self.pid(name)
            except (OSError, ValueError):
                pid = None
            if pid is not None and pid != old_pid and _alive(pid):
                return pid
            time.sleep(0.05)
        raise TimeoutError(f"{name} was not restarted in {timeout}s:\n{self.logs()}")

    def internal_headers(self) -> dict[str, str]:
        """The bearer header of this stack's internal token (`up` records it in secrets.json)."""
        return {"authorization": f"Bearer {self.secrets()['internal_token']}"}

    def engine_version(self) -> str | None:
        try:
            resp = httpx.get(f"{self.engine}/model_info", headers=self.internal_headers(), timeout=2)
            return str(resp.json()["weight_version"])
        except (httpx.HTTPError, KeyError, ValueError, OSError):
            return None

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        rc = self.proc.returncode
        self.proc = None
        self._log.close()
        return rc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
