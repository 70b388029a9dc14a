"""Real infrastructure for tests: redis-server and SeaweedFS on free ports, and service processes.

Every server here is a real process the test owns: it picks free ports, waits until the
server answers (never a bare sleep), and stops it (SIGTERM, then SIGKILL) at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from services.ctl.infra import free_port as free_port
from services.ctl.infra import redis_argv, weed_argv, weed_ports

REPO = Path(__file__).resolve().parents[2]


def wait_until(pred: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except Exception:
            pass
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@dataclass
class RedisServer:
    """A private redis-server; `stop()` and `start()` keep the same port (outage tests)."""

    port: int = field(default_factory=free_port)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ns-redis-")))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            redis_argv(self.port, self.workdir, persist=False),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)
        wait_until(lambda: bool(client.ping()), 10, f"redis-server on :{self.port}")
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class S3Server:
    """SeaweedFS `weed mini` serving a real S3 API on a free port, with one bucket."""

    bucket: str = "nextstate-test"
    access_key: str = "nextstate-test"
    secret_key: str = "nextstate-test-secret"
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ns-weed-")))
    ports: dict[str, int] = field(default_factory=weed_ports)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        return {
            "NEXTSTATE_BUCKET__ENDPOINT": self.endpoint,
            "NEXTSTATE_BUCKET__ACCESS_KEY": self.access_key,
            "NEXTSTATE_BUCKET__SECRET_KEY": self.secret_key,
            "NEXTSTATE_BUCKET__NAME": self.bucket,
            "NEXTSTATE_BUCKET__SECURE": "false",
        }

    def start(self) -> S3Server:
        from minio import Minio

        args = weed_argv(self.workdir, self.ports, self.bucket)
        env = dict(os.environ, AWS_ACCESS_KEY_ID=self.access_key,
                   AWS_SECRET_ACCESS_KEY=self.secret_key)
        self.log = open(self.workdir / "weed.log", "wb")
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        client = Minio(self.endpoint, access_key=self.access_key,
                       secret_key=self.secret_key, secure=False)

        def ready() -> bool:
            assert self.proc is not None and self.proc.poll() is None, "weed exited"
            return client.bucket_exists(self.bucket)

        try:
            wait_until(ready, 60, f"SeaweedFS S3 on {self.endpoint}", interval=0.2)
        except Exception:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None
        with contextlib.suppress(Exception):
            self.log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class ServiceProcess:
    """`python -m services.<name>` as a user starts it, with its log kept for failures."""

    name: str
    env: dict[str, str]
    args: list[str] = field(default_factory=list)
    log_path: Path = field(default_factory=lambda: Path(tempfile.mktemp(prefix="ns-svc-", suffix=".log")))
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServiceProcess:
        env = dict(os.environ)
        env.update(self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{self.name}", *self.args],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )
        return self

    def wait_http(self, url: str, timeout: float = 60.0) -> ServiceProcess:
        def ok() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.logs()}")
            return httpx.get(url, timeout=1.0).status_code == 200

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if ok():
                    return self
            except RuntimeError:
                raise
            except Exception:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready at {url} after {timeout}s:\n{self.logs()}")

    def logs(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        stop_process(self.proc, timeout)
        rc = self.proc.returncode
        self.proc = None
        with contextlib.suppress(Exception):
            self._log.close()
        return rc

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None
        with contextlib.suppress(Exception):
            self._log.close()


@contextlib.contextmanager
def running(*procs: ServiceProcess) -> Iterator[tuple[ServiceProcess, ...]]:
    try:
        yield procs
    finally:
        for p in reversed(procs):
            p.stop()
