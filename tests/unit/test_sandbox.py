"""The sandbox: every way a command can end comes back as an observation, fast, and nothing
of it reaches outside (the worker's environment, files, network, processes).

Tests of a protection run only where `Sandbox.capabilities()` says it holds, and say so
when skipped. The fork bomb runs only where RLIMIT_NPROC is enforced (a uid of its own):
anywhere else it could take the machine down.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.envs import confine
from services.envs.execution import Capture
from services.envs.sandbox import (
    ExecResult,
    Sandbox,
    SandboxConfig,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
)

FAST = SandboxLimits(cpu_seconds=2, memory_bytes=256 << 20, wall_seconds=4.0, output_bytes=4096,
                     max_processes=32)
CAPS = Sandbox.capabilities()


def _why_not(protection: str) -> str:
    return f"{protection} does not hold here: {confine.probe().missing.get(protection, '?')}"


def _processes_of(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    pids.append(int(name))
            except FileNotFoundError:
                pass
    return pids


@pytest.fixture
def root() -> Iterator[Path]:
    """A root the sandbox's uid can reach by path (pytest's tmp_path is in a 0700 directory)."""
    base = Path(tempfile.mkdtemp(prefix="nextstate-sandbox-test-"))
    base.chmod(0o711)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def config(root: Path) -> SandboxConfig:
    return SandboxConfig(root=root / "sandboxes")  # the machine-wide uid locks: parallel tests never share a uid


@pytest.fixture
def sandbox(config: SandboxConfig) -> Iterator[Sandbox]:
    with Sandbox(config, limits=FAST) as sb:
        yield sb


def test_runs_in_its_own_directory_which_persists_between_steps(sandbox: Sandbox) -> None:
    r = sandbox.run(["sh", "-c", "pwd; echo oops >&2; echo kept > notes.txt; exit 3"])
    assert r.stdout == f"{sandbox.path}\n"
    assert r.stderr == "oops\n"
    assert (r.exit_code, r.timed_out, r.killed_by) == (3, False, None)
    assert r.observation() == f"{sandbox.path}\n[stderr]\noops\n[exit code 3]"
    again = sandbox.run(["cat", "notes.txt"])
    assert (again.exit_code, again.observation()) == (0, "kept")
    assert sandbox.run(["true"]).observation() == "[no output]"


def test_stdin_small_and_larger_than_a_pipe(sandbox: Sandbox) -> None:
    assert sandbox.run(["cat"], stdin="hello\nworld").stdout == "hello\nworld"
    big = "x" * (300 << 10)
    assert sandbox.run(["wc", "-c"], stdin=big).stdout.strip() == str(len(big))


def test_command_not_found_is_an_observation(sandbox: Sandbox) -> None:
    r = sandbox.run(["no-such-command-xyz"])
    assert r.exit_code == 127
    assert "no-such-command-xyz: command not found" in r.observation()


def test_output_is_truncated_in_the_middle_with_a_marker(sandbox: Sandbox) -> None:
    limits = SandboxLimits(output_bytes=1000, wall_seconds=4)
    r = sandbox.run(["python3", "-c", "print('h' * 500 + 'm' * 4000 + 't' * 500, end='')"], limits=limits)
    assert r.stdout == "h" * 500 + "\n[… 4000 bytes truncated]\n" + "t" * 500
    assert (r.exit_code, r.killed_by) == (0, None)


def test_capture_keeps_head_and_tail_across_chunks() -> None:
    cap = Capture(10)
    for chunk in (b"abc", b"defgh", b"ijklmnop", b"qr"):
        cap.add(chunk)
    assert cap.total == 18
    assert cap.text() == "abcde\n[… 8 bytes truncated]\nnopqr"
    small = Capture(10)
    small.add(b"0123456789")
    assert small.text() == "0123456789"


def test_wall_clock_timeout_kills_the_step(sandbox: Sandbox) -> None:
    r = sandbox.run(["sleep", "30"], limits=SandboxLimits(wall_seconds=0.5))
    assert r.timed_out and r.killed_by == "wall-clock timeout"
    assert 400 < r.wall_ms < 2500
    assert r.observation() == f"[wall-clock timeout: killed after {r.wall_ms / 1000:.1f} s]"


def test_cpu_loop_is_stopped_by_the_cpu_limit(sandbox: Sandbox) -> None:
    # ~1.1 s; the wall clock is generous so a loaded machine (other work on 2 cores) does
    # not turn the cpu limit into a timeout.
    r = sandbox.run(["python3", "-c", "while True: pass"],
                    limits=SandboxLimits(cpu_seconds=1, wall_seconds=10))
    assert r.killed_by == "cpu limit" and not r.timed_out
    assert r.observation() == "[cpu limit: killed by SIGXCPU]"


def test_memory_hog_fails_inside_the_limit(sandbox: Sandbox) -> None:
    r = sandbox.run(["python3", "-c", "x = bytearray(1 << 30)"])
    assert r.killed_by == "memory limit"
    assert "MemoryError" in r.stderr
    assert r.observation().endswith("[memory limit: exit code 1]")


def test_output_flood_is_killed_and_bounded(sandbox: Sandbox) -> None:
    r = sandbox.run(["yes"], limits=SandboxLimits(output_bytes=1024, wall_seconds=4))
    assert r.killed_by == "output limit" and not r.timed_out
    assert len(r.stdout) < 1024 + 64 and "bytes truncated]" in r.stdout
    assert r.wall_ms < 2000
    assert r.observation().endswith("[output limit: killed by SIGKILL]")


def test_file_size_limit(sandbox: Sandbox) -> None:
    r = sandbox.run(["python3", "-c", "open('big', 'wb').write(b'x' * (2 << 20))"],
                    limits=SandboxLimits(file_size_bytes=1 << 20))
    assert r.exit_code != 0 and "File too large" in r.stderr
    assert (sandbox.path / "big").stat().st_size <= 1 << 20


@pytest.mark.skipif(not CAPS["nproc_enforced"], reason="RLIMIT_NPROC is not enforced here (no uid of "
                    "the sandbox's own): a fork bomb could take the machine down")
def test_fork_bomb_is_contained(sandbox: Sandbox) -> None:
    limits = SandboxLimits(max_processes=16, cpu_seconds=2, wall_seconds=1.5, output_bytes=2048)
    plain = sandbox.run(["python3", "-c", "import os\nwhile True: os.fork()"], limits=limits)
    assert plain.exit_code != 0 and "Resource temporarily unavailable" in plain.stderr
    # One whose processes survive a failed fork and keep trying, until the wall clock.
    stubborn = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = sandbox.run(["python3", "-c", stubborn], limits=limits)
    assert r.killed_by is not None and r.wall_ms < 4000
    after = sandbox.run(["echo", "still here"])  # no process of the bomb holds the uid's slots
    assert after.stdout == "still here\n"
    if CAPS["pids_isolated"]:
        assert _processes_of(sandbox.uid) == []


def test_nothing_outlives_its_step(sandbox: Sandbox) -> None:
    """A background job and a daemon that left the process group (setsid): the step still
    ends when the command does, and, with a pid namespace, so do they."""
    daemon = "import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(30)\nprint('started')"
    r = sandbox.run(["sh", "-c", f"sleep 30 & python3 -c \"{daemon}\""])
    assert r.stdout == "started\n" and r.wall_ms < 3000
    if not CAPS["uid_dropped"]:
        return
    if CAPS["pids_isolated"]:
        assert _processes_of(sandbox.uid) == []
    sandbox.close()
    assert _processes_of(sandbox.uid) == []


@pytest.mark.skipif(not CAPS["uid_dropped"], reason=_why_not("uid_dropped") + "; commands run as the "
                    "worker's own uid and may write wherever it may")
def test_writes_outside_the_sandbox_are_denied(config: SandboxConfig) -> None:
    escape = Path("/work/escape-test")
    home = Path.home() / "nextstate-escape-test"
    existed = {p: p.exists() for p in (escape, home)}
    with Sandbox(config, limits=FAST) as a, Sandbox(config, limits=FAST) as b:
        script = (
            "import sys\n"
            "for p in sys.argv[1:]:\n"
            "    try:\n"
            "        open(p, 'w').write('x')\n"
            "        print('WROTE', p)\n"
            "    except OSError as e:\n"
            "        print('denied', p, e.strerror)\n"
        )
        targets = [str(escape), str(home), f"../{b.path.name}/planted", "../planted", "/etc/passwd"]
        if CAPS["mounts_isolated"]:
            targets += ["/tmp/nextstate-escape-test", "/dev/shm/nextstate-escape-test"]
        r = a.run(["python3", "-c", script, *targets])
        try:
            assert "WROTE" not in r.stdout, r.stdout
            assert [line.split()[1] for line in r.stdout.splitlines() if line.startswith("denied ")] == targets
            assert not (b.path / "planted").exists() and not (a.path.parent / "planted").exists()
        finally:
            for p, was in existed.items():
                if not was:
                    p.unlink(missing_ok=True)
        assert a.run(["sh", "-c", "echo inside > mine && cat mine"]).stdout == "inside\n"


@pytest.mark.skipif(not CAPS["network_isolated"], reason=_why_not("network_isolated"))
def test_network_is_denied(sandbox: Sandbox) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('CONNECTED')"
        r = sandbox.run(["python3", "-c", connect])
    assert "CONNECTED" not in r.stdout and r.exit_code != 0
    assert "Connection refused" in r.stderr or "unreachable" in r.stderr
    # Its own loopback works: programs that talk to themselves (test servers) still run.
    own = ("import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen();"
           "socket.create_connection(s.getsockname(), timeout=2); print('ok')")
    assert sandbox.run(["python3", "-c", own]).stdout == "ok\n"


def test_environment_is_minimal_and_has_no_secrets(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXTSTATE_INTERNAL__TOKEN", "internal-secret-token")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    r = sandbox.run(["env"], env={"TASK": "demo"})
    env = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert not [k for k in env if k.startswith(("NEXTSTATE_", "AWS_"))]
    assert "secret" not in r.stdout
    assert env["HOME"] == str(sandbox.path) and env["TMPDIR"].startswith(f"{sandbox.path}/")
    assert (env["LANG"], env["PYTHONDONTWRITEBYTECODE"], env["TASK"]) == ("C.UTF-8", "1", "demo")


def test_close_removes_the_directory(config: SandboxConfig) -> None:
    sb = Sandbox(config, limits=FAST)
    sb.run(["sh", "-c", "mkdir -p a/b && echo x > a/b/c && chmod 000 a/b"])
    assert sb.path.is_dir()
    sb.close()
    assert not sb.path.exists()
    sb.close()  # twice is fine
    with pytest.raises(SandboxError, match="closed"):
        sb.run(["true"])


def test_required_protection_missing_is_a_clear_error(config: SandboxConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    weak = confine.Capabilities(network_isolated=False, mounts_isolated=False, pids_isolated=False,
                                uid_dropped=False, user_namespace=False,
                                missing={"network_isolated": "unshare(CLONE_NEWNET) failed"})
    monkeypatch.setattr(confine, "_probed", weak)
    with pytest.raises(SandboxUnavailable, match=r"requires network_isolated.*CLONE_NEWNET"):
        Sandbox(config.model_copy(update={"require": ["network_isolated"]}))


def test_observation_shapes() -> None:
    assert ExecResult(0, "out\n", "").observation() == "out"
    assert ExecResult(-11, "", "", killed_by="SIGSEGV").observation() == "[killed by SIGSEGV]"
    assert ExecResult(1, "", "boom\n").observation() == "[stderr]\nboom\n[exit code 1]"


async def test_arun_runs_on_the_event_loop(sandbox: Sandbox) -> None:
    r1, r2 = await asyncio.gather(sandbox.arun(["sh", "-c", "echo one"]),
                                  sandbox.arun(["cat"], stdin="two"))
    assert (r1.stdout, r2.stdout) == ("one\n", "two")
    timed = await sandbox.arun(["sleep", "30"], limits=SandboxLimits(wall_seconds=0.3))
    assert timed.timed_out and timed.wall_ms < 2500


async def test_cancelling_arun_kills_the_command(sandbox: Sandbox) -> None:
    task = asyncio.create_task(sandbox.arun(["sh", "-c", "touch started; exec sleep 30"]))
    for _ in range(400):
        if (sandbox.path / "started").exists():
            break
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    if CAPS["uid_dropped"]:
        assert _processes_of(sandbox.uid) == []
