"""The sandbox's docker backend without a Docker engine: the `docker run` command line it
builds, the clear refusal when no engine answers, and — through a stand-in of the docker
CLI (tests/support/fake_docker.py) — how it drives a step: output, exit codes, a timeout
that kills the client and removes the container, Docker's own failures. The same backend
against a real engine is tests/integration/test_sandbox_docker.py (where `docker info` works).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from services.envs import container
from services.envs.container import DockerConfig, exit_code, run_argv
from services.envs.sandbox import (
    Sandbox,
    SandboxConfig,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
)
from tests.support.servers import REPO

LIMITS = SandboxLimits(cpu_seconds=3, memory_bytes=256 << 20, file_size_bytes=1 << 20, max_processes=32,
                       wall_seconds=2.0, output_bytes=4096, open_files=64)
FAKE = REPO / "tests" / "support" / "fake_docker.py"


def test_run_argv_isolates_limits_and_mounts_the_sandbox_directory() -> None:
    cfg = DockerConfig(image="example/sandbox:1", cpus=1.5, tmpfs_bytes=32 << 20, pull="never")
    argv = run_argv(cfg, ["python3", "-c", "print(1)"], name="nextstate-sb-abc", sandbox_id="ep-x",
                    workdir="/srv/sb/ep-x", uid=620001, env={"HOME": "/srv/sb/ep-x", "LANG": "C.UTF-8"},
                    limits=LIMITS, stdin=False)
    assert argv[:3] == ["docker", "run", "--rm"]
    assert argv[-4:] == ["example/sandbox:1", "python3", "-c", "print(1)"]  # the image, then the command
    options = argv[2:-4]
    assert all(o.startswith("--") for o in options)  # one token each: the image is the first non-option
    assert set(options) == {
        "--rm", "--init", "--name=nextstate-sb-abc", "--label=nextstate.sandbox=ep-x",
        "--network=none", "--cap-drop=ALL", "--security-opt=no-new-privileges", "--read-only",
        "--tmpfs=/tmp:rw,nosuid,nodev,size=33554432", "--user=620001:620001",
        f"--memory={256 << 20}b", f"--memory-swap={256 << 20}b", "--cpus=1.5", "--pids-limit=32",
        "--ulimit=cpu=3:4", f"--ulimit=fsize={1 << 20}:{1 << 20}", "--ulimit=nofile=64:64", "--ulimit=core=0:0",
        "--log-driver=none", "--pull=never",
        "--volume=/srv/sb/ep-x:/srv/sb/ep-x:rw", "--workdir=/srv/sb/ep-x",
        "--env=HOME=/srv/sb/ep-x", "--env=LANG=C.UTF-8",
    }
    with_stdin = run_argv(cfg, ["cat"], name="n", sandbox_id="s", workdir="/w", uid=1, env={}, limits=LIMITS,
                          stdin=True)
    assert "--interactive" in with_stdin and with_stdin[-2:] == ["example/sandbox:1", "cat"]
    with pytest.raises(ValueError):
        run_argv(cfg, [], name="n", sandbox_id="s", workdir="/w", uid=1, env={}, limits=LIMITS, stdin=False)
    assert container.rm_argv(cfg, ["a", "b"]) == ["docker", "rm", "--force", "a", "b"]


def test_exit_codes_and_docker_failures() -> None:
    assert [exit_code(c) for c in (0, 1, 125, 127, 128, 137, 143, 192, 255)] == \
        [0, 1, 125, 127, 128, -9, -15, -64, 255]
    assert container.docker_failure(125, "docker: Error response from daemon: no such image\n")
    assert container.docker_failure(125, "the command's own 125\n") is None
    assert container.docker_failure(1, "docker: something\n") is None


# -- no engine: a clear refusal --------------------------------------------------------------------


def test_no_docker_cli_is_refused_with_what_to_do(tmp_path: Path) -> None:
    cfg = SandboxConfig(root=tmp_path / "sb", backend="docker",
                        docker=DockerConfig(binary=str(tmp_path / "no-docker-here")))
    with pytest.raises(SandboxUnavailable) as e:
        Sandbox(cfg)
    msg = str(e.value)
    assert "no-docker-here" in msg and "not an executable" in msg and "BACKEND=process" in msg
    assert not (tmp_path / "sb").exists()  # refused before anything was made


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI on PATH")
def test_an_unreachable_engine_is_refused_with_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")  # nothing answers there
    with pytest.raises(SandboxUnavailable) as e:
        Sandbox(SandboxConfig(root=tmp_path / "sb", backend="docker"))
    msg = str(e.value)
    assert "`docker info` failed" in msg and "no-engine.sock" in msg and "BACKEND=process" in msg


def test_a_worker_with_the_docker_backend_and_no_engine_refuses_to_start(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "NEXTSTATE_ENV": "test",
           "NEXTSTATE_ENVS__SANDBOX__BACKEND": "docker",
           "NEXTSTATE_ENVS__SANDBOX__DOCKER__BINARY": str(tmp_path / "no-docker-here")}
    out = subprocess.run([sys.executable, "-m", "services.envs"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "docker sandbox backend" in out.stderr and "BACKEND=process" in out.stderr


# -- through the stand-in CLI ------------------------------------------------------------------------


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[tuple[SandboxConfig, Path]]:
    """A docker backend config whose CLI is the stand-in; and its calls file."""
    state = tmp_path / "fake-docker"
    state.mkdir()
    wrapper = state / "docker"
    wrapper.write_text(f"#!/bin/sh\nFAKE_DOCKER_STATE={state} exec {sys.executable} {FAKE} \"$@\"\n")
    wrapper.chmod(0o755)
    root = Path(tempfile.mkdtemp(prefix="nextstate-docker-test-"))
    root.chmod(0o711)
    container._AVAILABLE.discard((str(wrapper), os.environ.get("DOCKER_HOST")))
    yield (SandboxConfig(root=root / "sb", backend="docker",
                         docker=DockerConfig(binary=str(wrapper), image="example/sandbox:1")), state / "calls.jsonl")
    shutil.rmtree(root, ignore_errors=True)


def calls(path: Path) -> list[list[str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_step_runs_through_docker_run_with_the_process_backends_result(fake: tuple[SandboxConfig, Path]) -> None:
    cfg, log = fake
    with Sandbox(cfg, limits=LIMITS) as sb:
        r = sb.run(["sh", "-c", "pwd; echo oops >&2; echo kept > notes.txt; exit 3"])
        assert (r.exit_code, r.timed_out, r.killed_by) == (3, False, None)
        assert r.observation() == f"{sb.path}\n[stderr]\noops\n[exit code 3]"
        assert sb.run(["cat", "notes.txt"]).observation() == "kept"  # the directory outlives the step
        echoed = sb.run(["cat"], stdin="from stdin")
        assert echoed.stdout == "from stdin"
        env = sb.run(["env"]).stdout  # what the container gets: the sandbox's minimal environment
        assert f"HOME={sb.path}\n" in env and "NEXTSTATE" not in env and "FAKE_DOCKER" not in env
        sid, uid = sb.path.name, sb.uid
    runs = [c for c in calls(log) if c[0] == "run"]
    assert len(runs) == 4 and calls(log)[0][0] == "info"
    first = runs[0]
    assert first[first.index("example/sandbox:1") + 1:] == ["sh", "-c", "pwd; echo oops >&2; echo kept > notes.txt; exit 3"]
    assert "--network=none" in first and f"--label=nextstate.sandbox={sid}" in first and f"--user={uid}:{uid}" in first
    assert "--interactive" not in first and "--interactive" in runs[2]
    assert not [c for c in calls(log) if c[0] in ("rm", "ps")]  # nothing was killed: nothing to remove


def test_a_signal_exit_reads_as_the_process_backends(fake: tuple[SandboxConfig, Path]) -> None:
    cfg, _ = fake
    with Sandbox(cfg, limits=LIMITS) as sb:
        r = sb.run(["sh", "-c", "exit 137"])  # how docker reports a container killed by SIGKILL
    assert r.exit_code == -9 and r.killed_by == "SIGKILL (cpu limit or out of memory)"
    assert r.observation() == "[SIGKILL (cpu limit or out of memory): killed by SIGKILL]"


def test_a_timeout_kills_the_client_and_removes_the_container(fake: tuple[SandboxConfig, Path]) -> None:
    cfg, log = fake
    with Sandbox(cfg, limits=replace(LIMITS, wall_seconds=0.75)) as sb:
        r = sb.run(["sleep", "30"])
        assert r.timed_out and r.killed_by == "wall-clock timeout" and r.wall_ms < 5000
        assert r.observation().startswith("[wall-clock timeout: killed after")
        name = next(o.split("=", 1)[1] for o in calls(log)[-1] if o.startswith("--name="))
        sid = sb.path.name
        a = asyncio.run(sb.arun(["sleep", "30"]))  # the event-loop path too
        assert a.timed_out
    removed = [c for c in calls(log) if c[:2] == ["rm", "--force"]]  # started by the kills, waited for by close()
    assert len(removed) == 2 and removed[0] == ["rm", "--force", name]
    assert ["ps", "--all", "--quiet", f"--filter=label=nextstate.sandbox={sid}"] in calls(log)  # close()


def test_dockers_own_failure_is_the_sandboxes_not_the_models(fake: tuple[SandboxConfig, Path]) -> None:
    cfg, _ = fake
    broken = cfg.model_copy(update={"docker": cfg.docker.model_copy(update={"image": "fake/no-such-image"})})
    with Sandbox(broken, limits=LIMITS) as sb, pytest.raises(SandboxError, match="pull access denied"):
        sb.run(["true"])
