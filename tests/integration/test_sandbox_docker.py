"""The sandbox's docker backend against a real Docker engine: runs only where `docker info`
answers (skipped otherwise, with docker's reason), with the image of
NEXTSTATE_TEST_DOCKER_IMAGE (default nextstate-offline/python:3.11, the offline Python base
that deploy/offline/bases.sh builds from Debian's packages, as the compose tests do: built
here when missing; another image is pulled when missing). The same steps as the process backend's tests: output and files,
no network, a read-only filesystem outside the directory, a non-root user, the memory and
process limits, and a timeout that leaves no container behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from services.envs.container import DockerConfig
from services.envs.sandbox import Sandbox, SandboxConfig, SandboxLimits

OFFLINE = "nextstate-offline/python:3.11"
IMAGE = os.environ.get("NEXTSTATE_TEST_DOCKER_IMAGE", OFFLINE)
REPO = Path(__file__).resolve().parents[2]
LIMITS = SandboxLimits(cpu_seconds=5, memory_bytes=128 << 20, max_processes=32, wall_seconds=20.0, output_bytes=4096)


def _engine() -> str | None:
    """None when a Docker engine answers here, else why not."""
    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    try:
        got = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                             timeout=20, check=False)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer in 20 s"
    if got.returncode != 0 or not got.stdout.strip():
        lines = (got.stderr.strip() or got.stdout.strip() or f"exit code {got.returncode}").splitlines()
        return f"`docker info` failed: {lines[-1]}"
    return None


WHY_NOT = _engine()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(WHY_NOT is not None, reason=f"no Docker engine: {WHY_NOT}"),
              pytest.mark.timeout(1500)]  # the first one may build the offline base (debootstrap)


def _containers(label: str) -> list[str]:
    out = subprocess.run(["docker", "ps", "--all", "--quiet", f"--filter=label=nextstate.sandbox={label}"],
                         capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.split()


@pytest.fixture(scope="module")
def image() -> str:
    have = subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, timeout=60, check=False)
    if have.returncode == 0:
        return IMAGE
    if IMAGE == OFFLINE:  # Debian's packages only, no registry (a few minutes the first time)
        made = subprocess.run(["bash", str(REPO / "deploy/offline/bases.sh")], capture_output=True, text=True,
                              timeout=1200, check=False)  # fmt: skip
        assert made.returncode == 0, f"deploy/offline/bases.sh failed:\n{made.stderr[-3000:]}"
    else:
        pulled = subprocess.run(["docker", "pull", IMAGE], capture_output=True, text=True, timeout=600, check=False)
        assert pulled.returncode == 0, f"image {IMAGE} missing and not pullable: {pulled.stderr.strip()[-300:]}"
    return IMAGE


@pytest.fixture
def sandbox(image: str) -> Iterator[Sandbox]:
    root = Path(tempfile.mkdtemp(prefix="nextstate-docker-it-"))
    root.chmod(0o711)
    cfg = SandboxConfig(root=root / "sb", backend="docker",
                        docker=DockerConfig(image=image, pull="never"))
    with Sandbox(cfg, limits=LIMITS) as sb:
        yield sb
    shutil.rmtree(root, ignore_errors=True)


def test_a_step_runs_in_a_container_on_the_sandbox_directory(sandbox: Sandbox) -> None:
    r = sandbox.run(["sh", "-c", "pwd; id -u; echo oops >&2; echo kept > notes.txt; exit 3"])
    assert r.stdout == f"{sandbox.path}\n{sandbox.uid}\n" and r.stderr == "oops\n" and r.exit_code == 3
    assert (sandbox.path / "notes.txt").read_text() == "kept\n"  # the worker sees what the step wrote
    assert sandbox.run(["python3", "-"], stdin="print(6 * 7)").stdout == "42\n"


def test_no_network_and_nothing_writable_outside(sandbox: Sandbox) -> None:
    net = sandbox.run(["python3", "-c", "import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)"])
    assert net.exit_code != 0 and ("unreachable" in net.stderr or "OSError" in net.stderr), net
    ifaces = sandbox.run(["ls", "/sys/class/net"])
    assert ifaces.stdout.split() == ["lo"]
    for path in ("/etc/owned", "/usr/owned", "/root/owned"):
        w = sandbox.run(["sh", "-c", f"echo x > {path}"])
        assert w.exit_code != 0, path


def test_memory_and_process_limits(sandbox: Sandbox) -> None:
    hog = sandbox.run(["python3", "-c", "x = bytearray(1 << 30); print('allocated')"])
    assert "allocated" not in hog.stdout and (hog.exit_code < 0 or "MemoryError" in hog.stderr), hog
    forks = sandbox.run(["sh", "-c", "for i in $(seq 100); do sleep 1 & done; wait"])
    assert forks.exit_code != 0 or "fork" in forks.stderr.lower() or "resource" in forks.stderr.lower(), forks


def test_a_timeout_kills_the_container(sandbox: Sandbox) -> None:
    r = sandbox.run(["sleep", "60"], limits=replace(LIMITS, wall_seconds=3.0))
    assert r.timed_out and r.killed_by == "wall-clock timeout"
    label = sandbox.path.name
    sandbox.close()  # waits for the removal
    assert _containers(label) == []
