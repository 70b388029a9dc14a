"""The sandbox's container backend: each tool execution in its own `docker run --rm` container.

`NEXTSTATE_ENVS__SANDBOX__BACKEND=docker` runs every command of an episode as

    docker run --rm --init --name=nextstate-sb-<id> --label=nextstate.sandbox=<episode>
        --network=none --cap-drop=ALL --security-opt=no-new-privileges --read-only
        --tmpfs=/tmp:rw,nosuid,nodev,size=64m --user=<uid>:<uid>
        --memory=<memory_bytes>b --memory-swap=<memory_bytes>b --cpus=<cpus>
        --pids-limit=<max_processes> --ulimit=cpu=<s>:<s+1> --ulimit=fsize=... --ulimit=nofile=...
        --ulimit=core=0 --log-driver=none --pull=<pull>
        --volume=<sandbox dir>:<sandbox dir>:rw --workdir=<sandbox dir> --env=K=V ... [-i]
        <image> <argv...>

The episode's directory is mounted at the same path as on the worker, so what an
environment writes there and what the command sees agree; the container's only writable
places are that directory and a small /tmp. The wall clock, the output limit and the
observation are the process backend's own (execution.py drives the `docker` client like any
child): when a step times out or floods, the client's process group is killed and the
container removed (`docker rm -f`, which kills it: a killed client alone leaves its
container running); `Sandbox.close()` removes whatever of the episode is left (by label).
A container killed by a signal exits 128+n; that is reported as killed by signal n, as
the process backend does. Docker's own failures (exit 125, `docker: ...`: no such image,
a daemon error) raise `SandboxError`: they are the deployment's, not the model's.

What it needs: a Docker engine the worker can reach (`docker info` answers) on the same
machine (the bind mount is a path of the worker's filesystem), and an image with the
programs the environment runs (`python3` and `bash` for the shipped ones; the default
`python:3.12-slim` has both). `check_available` says what is missing; a worker with the
docker backend refuses to start without it. Starting a container costs a few hundred ms
per tool call, against ~5-8 ms for the process backend.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, Field

from services.envs.execution import SandboxLimits
from shared.errors import NextstateError

log = logging.getLogger(__name__)

LABEL = "nextstate.sandbox"
DOCKER_ERROR = 125  # `docker run` itself failed (no image, a daemon error): not the command


class DockerUnavailable(NextstateError):
    """The docker backend was chosen but no Docker engine answers here."""


class DockerConfig(BaseModel):
    """NEXTSTATE_<SERVICE>__SANDBOX__DOCKER__*: the container backend."""

    binary: str = "docker"  # the docker CLI (it honours DOCKER_HOST, DOCKER_CONTEXT)
    image: str = "python:3.12-slim"  # needs what the environment runs (python3, bash)
    cpus: float = Field(1.0, gt=0)  # --cpus
    tmpfs_bytes: int = Field(64 << 20, ge=1 << 20)  # the container's /tmp
    pull: Literal["missing", "never", "always"] = "missing"  # --pull
    probe_timeout_s: float = Field(15.0, gt=0)  # `docker info`, `docker rm -f`, `docker ps`


def container_name() -> str:
    return f"nextstate-sb-{secrets.token_hex(8)}"


def run_argv(cfg: DockerConfig, argv: Sequence[str], *, name: str, sandbox_id: str, workdir: str, uid: int,
             env: Mapping[str, str], limits: SandboxLimits, stdin: bool) -> list[str]:
    """The `docker run` command line of one tool execution (options as single `--opt=value`
    tokens: the image is the first token that is not an option)."""
    if not argv:
        raise ValueError("argv is empty")
    mem = f"{limits.memory_bytes}b"
    out = [
        cfg.binary, "run", "--rm", "--init", f"--name={name}", f"--label={LABEL}={sandbox_id}",
        "--network=none", "--cap-drop=ALL", "--security-opt=no-new-privileges", "--read-only",
        f"--tmpfs=/tmp:rw,nosuid,nodev,size={cfg.tmpfs_bytes}", f"--user={uid}:{uid}",
        f"--memory={mem}", f"--memory-swap={mem}", f"--cpus={cfg.cpus:g}", f"--pids-limit={limits.max_processes}",
        f"--ulimit=cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",
        f"--ulimit=fsize={limits.file_size_bytes}:{limits.file_size_bytes}",
        f"--ulimit=nofile={limits.open_files}:{limits.open_files}", "--ulimit=core=0:0",
        "--log-driver=none", f"--pull={cfg.pull}",
        f"--volume={workdir}:{workdir}:rw", f"--workdir={workdir}",
        *(f"--env={k}={v}" for k, v in env.items()),
    ]
    if stdin:
        out.append("--interactive")
    return [*out, cfg.image, *argv]


def rm_argv(cfg: DockerConfig, names: Sequence[str]) -> list[str]:
    return [cfg.binary, "rm", "--force", *names]


def exit_code(code: int) -> int:
    """A container's exit status in the process backend's convention: 128+n (killed by
    signal n) as -n."""
    return -(code - 128) if 128 < code <= 128 + 64 else code


def docker_failure(code: int, stderr: str) -> str | None:
    """Docker's own error, when `docker run` failed before or around the command."""
    if code == DOCKER_ERROR and ("docker:" in stderr or "Error response from daemon" in stderr):
        return stderr.strip()[-2000:]
    return None


def remove(cfg: DockerConfig, names: Sequence[str]) -> subprocess.Popen[bytes] | None:
    """Start `docker rm -f` (it kills the container) without waiting; `finish` reaps it."""
    try:
        return subprocess.Popen(rm_argv(cfg, names), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        log.warning("could not remove containers %s: %s", ", ".join(names), e)
        return None


def finish(cfg: DockerConfig, removals: Sequence[subprocess.Popen[bytes]]) -> None:
    """Wait for started removals (each at most probe_timeout_s, then it is killed)."""
    for proc in removals:
        try:
            proc.wait(cfg.probe_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("`docker rm -f` did not finish in %ss", cfg.probe_timeout_s)
            proc.kill()
            proc.wait()


def remove_labelled(cfg: DockerConfig, sandbox_id: str) -> None:
    """Remove every container of one sandbox (its label), waiting at most probe_timeout_s."""
    try:
        found = subprocess.run([cfg.binary, "ps", "--all", "--quiet", f"--filter=label={LABEL}={sandbox_id}"],
                               capture_output=True, text=True, timeout=cfg.probe_timeout_s, check=False)
        ids = found.stdout.split()
        if ids:
            subprocess.run(rm_argv(cfg, ids), capture_output=True, timeout=cfg.probe_timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("could not remove the containers of sandbox %s: %s", sandbox_id, e)


# (CLI, DOCKER_HOST) pairs whose engine answered: only successes are remembered, and only for
# the engine they reached (another DOCKER_HOST is asked again).
_AVAILABLE: set[tuple[str, str | None]] = set()


def check_available(cfg: DockerConfig) -> None:
    """Raise `DockerUnavailable` saying what is missing when no Docker engine answers (asked
    once per process and CLI once it did; a failure is asked again next time)."""
    key = (cfg.binary, os.environ.get("DOCKER_HOST"))
    if key in _AVAILABLE:
        return
    path = shutil.which(cfg.binary)
    if path is None:
        raise DockerUnavailable(
            f"the docker sandbox backend needs the docker CLI, and {cfg.binary!r} is not an executable "
            "on PATH; install Docker (or set NEXTSTATE_ENVS__SANDBOX__DOCKER__BINARY), or use "
            "NEXTSTATE_ENVS__SANDBOX__BACKEND=process")
    try:
        got = subprocess.run([path, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                             timeout=cfg.probe_timeout_s, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired as e:
        raise DockerUnavailable(
            f"the docker sandbox backend: `{cfg.binary} info` did not answer in {cfg.probe_timeout_s:g}s; "
            "is the Docker engine healthy? Or use NEXTSTATE_ENVS__SANDBOX__BACKEND=process") from e
    except OSError as e:
        raise DockerUnavailable(f"the docker sandbox backend: cannot run {path!r}: {e}") from e
    version = got.stdout.strip()
    if got.returncode != 0 or not version or version.startswith("<no value>"):
        lines = (got.stderr.strip() or got.stdout.strip() or f"exit code {got.returncode}").splitlines()
        raise DockerUnavailable(
            f"the docker sandbox backend needs a Docker engine, and `{cfg.binary} info` failed: {lines[-1]} "
            "Start the engine (dockerd) or point DOCKER_HOST at one on this machine, or use "
            "NEXTSTATE_ENVS__SANDBOX__BACKEND=process")
    _AVAILABLE.add(key)
