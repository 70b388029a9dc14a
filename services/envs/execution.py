"""One sandboxed process from spawn to `ExecResult`, and what the agent is shown of it.

An `Execution` reads the child's pipes as they fill and keeps at most `output_bytes` of
each (the first and the last half, with a marker for what fell between), so a flood
cannot fill the worker's memory; past `OUTPUT_KILL_FACTOR` times that in all it kills the
process group ("output limit"). It kills the group at the wall-clock deadline, and as soon
as the command itself exits, so nothing it left behind runs on into the next step.

With a pid namespace (confine.py) the process started is a relay outside it whose child is
the namespace's init. A kill goes to that init: the kernel kills everything in the
namespace, the relay reaps the init and exits, so when the result is out no process of
the step is left, and no orphan is handed to the worker's own parent (in a container
the worker may be pid 1, and would never reap it). Without one, the kill goes to the
process group.

It is driven by events — a pipe is readable or writable, the child exited (a pidfd), a
timer is due — so the same code serves `Sandbox.run` (a selector) and `Sandbox.arun` (the
event loop's readers). The leader is reaped only at the end: until then its pid cannot be
reused, so `killpg` never reaches a stranger.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

OUTPUT_KILL_FACTOR = 16  # past this many times output_bytes in all, the group is killed
DRAIN_S = 0.25  # after the group is killed, how long its pipes may take to close
READ_CHUNK = 1 << 16

_MEMORY_ERRORS = re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc|[Oo]ut of memory")


@dataclass(frozen=True)
class SandboxLimits:
    """What one command may use. The rlimits hold per process; wall_seconds and output for the
    whole step (every process the command starts)."""

    cpu_seconds: int = 10
    memory_bytes: int = 512 << 20  # address space (RLIMIT_AS)
    file_size_bytes: int = 16 << 20  # largest file it may write
    max_processes: int = 64  # of the sandbox's uid: enforced only when the uid is dropped
    wall_seconds: float = 20.0
    output_bytes: int = 64 << 10  # kept per stream
    open_files: int = 256


@dataclass(frozen=True)
class ExecResult:
    exit_code: int  # negative: killed by that signal (subprocess's convention)
    stdout: str
    stderr: str
    timed_out: bool = False
    # What stopped it: "wall-clock timeout", "cpu limit", "memory limit", "output limit",
    # "file size limit", a signal's name ("SIGSEGV"), "cancelled"; None when it just ended.
    killed_by: str | None = None
    wall_ms: float = 0.0

    def observation(self) -> str:
        """What the agent sees: the output, then how the command ended when that is news."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append("[stderr]\n" + self.stderr.rstrip("\n"))
        code = self.exit_code
        how = f"exit code {code}" if code >= 0 else f"killed by {_signame(-code)}"
        if self.timed_out:
            parts.append(f"[wall-clock timeout: killed after {self.wall_ms / 1000:.1f} s]")
        elif self.killed_by:
            parts.append(f"[{how}]" if how.endswith(self.killed_by) else f"[{self.killed_by}: {how}]")
        elif self.exit_code != 0:
            parts.append(f"[{how}]")
        elif not parts:
            parts.append("[no output]")
        return "\n".join(parts)


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def ending(exit_code: int, stderr: str) -> str | None:
    """What stopped a command the sandbox did not kill itself, when a limit or a signal did."""
    if exit_code < 0:
        sig = -exit_code
        named = {int(signal.SIGXCPU): "cpu limit", int(signal.SIGXFSZ): "file size limit",
                 int(signal.SIGKILL): "SIGKILL (cpu limit or out of memory)"}
        return named.get(sig) or _signame(sig)
    if exit_code != 0 and _MEMORY_ERRORS.search(stderr[-4096:]):
        return "memory limit"
    return None


class Capture:
    """At most `limit` bytes of one stream: the first half and the last half of it."""

    def __init__(self, limit: int) -> None:
        self._head_cap = limit // 2
        self._tail_cap = limit - self._head_cap
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data and self._tail_cap:
            self._tail += data[-self._tail_cap:]
            del self._tail[: max(0, len(self._tail) - self._tail_cap)]

    def text(self) -> str:
        head = self._head.decode("utf-8", "replace")
        tail = self._tail.decode("utf-8", "replace")
        dropped = self.total - len(self._head) - len(self._tail)
        if dropped <= 0:
            return head + tail
        return f"{head}\n[… {dropped} bytes truncated]\n{tail}"


class Execution:
    """A started child: feed it events (`handle`, `tick`) until `finished`, then `result()`.

    A driver registers `readers()` for reading and `writers()` for writing; when `handle(fd)`
    returns True that fd is done: the driver unregisters it, then calls `close(fd)`. Between
    events it waits at most `timeout()` seconds and then calls `tick()`.
    """

    def __init__(self, proc: subprocess.Popen[bytes], limits: SandboxLimits, stdin: bytes | None,
                 started: float, sweep: Callable[[], None] | None, pid_namespace: bool,
                 on_kill: Callable[[], None] | None = None) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self._limits = limits
        self._started = started
        self._deadline = started + limits.wall_seconds
        self._sweep = sweep  # kills every process of the sandbox's uid, when it has one
        self._files: dict[int, IO[bytes]] = {f.fileno(): f for f in (proc.stdout, proc.stderr)}
        self._out, self._err = Capture(limits.output_bytes), Capture(limits.output_bytes)
        self._captures = {proc.stdout.fileno(): self._out, proc.stderr.fileno(): self._err}
        self._stdin = memoryview(stdin or b"")
        self._stdin_fd = proc.stdin.fileno() if proc.stdin is not None else -1
        if proc.stdin is not None:
            os.set_blocking(self._stdin_fd, False)
            self._files[self._stdin_fd] = proc.stdin
        try:
            self._pidfd: int | None = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # before Linux 5.3: poll instead
            self._pidfd = None
        self._exited = False
        self._drain_until: float | None = None
        self._swept = False
        self._pid_namespace = pid_namespace  # proc is the relay; its child the namespace's init
        self._on_kill = on_kill  # what else a kill must stop (the docker backend: the container)
        self.killed_by: str | None = None
        self.timed_out = False
        self.finished = False

    def readers(self) -> list[int]:
        return [*self._captures] + ([self._pidfd] if self._pidfd is not None else [])

    def writers(self) -> list[int]:
        return [self._stdin_fd] if self._stdin_fd >= 0 else []

    def open_fds(self) -> list[tuple[int, bool]]:
        """Fds still registered, each with whether it is a writer."""
        fds = [(fd, fd == self._stdin_fd) for fd in self._files]
        return fds + ([(self._pidfd, False)] if self._pidfd is not None and not self._exited else [])

    def handle(self, fd: int) -> bool:
        if fd == self._pidfd:
            self._on_exit()
            return True
        if fd not in self._captures:
            return self._write(fd)
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return False
        if not data:
            return True
        self._captures[fd].add(data)
        total = self._out.total + self._err.total
        if self.killed_by is None and total > OUTPUT_KILL_FACTOR * self._limits.output_bytes:
            self.kill("output limit")
        return False

    def _write(self, fd: int) -> bool:
        try:
            n = os.write(fd, self._stdin[:READ_CHUNK])
        except BlockingIOError:
            return False
        except OSError:  # EPIPE: it stopped reading
            return True
        self._stdin = self._stdin[n:]
        return not self._stdin

    def close(self, fd: int) -> None:
        if fd == self._pidfd:
            return  # closed in result(): until the leader is reaped it names the process
        f = self._files.pop(fd, None)
        if f is not None:
            f.close()

    def timeout(self) -> float:
        now = time.monotonic()
        due = [self._drain_until] if self._drain_until is not None else []
        if not self._exited:
            due.append(self._deadline)
            if self._pidfd is None:
                due.append(now + 0.05)
        return max(0.0, min(due, default=now) - now)

    def tick(self) -> None:
        now = time.monotonic()
        if not self._exited and self._pidfd is None and _exited_unreaped(self.proc.pid):
            self._on_exit()
        if not self._exited and not self.timed_out and now >= self._deadline:
            self.timed_out = True
            self.kill("wall-clock timeout")
            self._drain_until = self._drain_until or now + DRAIN_S
        reading = [fd for fd in self._files if fd in self._captures]
        if self._exited and not reading:
            self.finished = True
        elif self._drain_until is not None and now >= self._drain_until:
            if self._sweep is not None and not self._swept:  # something left the group and holds a pipe
                self._swept = True
                self._sweep()
                self._drain_until = now + DRAIN_S
            elif self._exited or now >= self._deadline + 2 * DRAIN_S:
                self.finished = True

    def _on_exit(self) -> None:
        """The command exited: kill what it left in its group (the leader is a zombie until
        reaped, so the group id is still its own)."""
        self._exited = True
        self._killpg()
        self._drain_until = time.monotonic() + DRAIN_S

    def kill(self, reason: str) -> None:
        if self.killed_by is None:
            self.killed_by = reason
        if self._on_kill is not None and not self._exited:
            on_kill, self._on_kill = self._on_kill, None
            on_kill()
        if self._pid_namespace and not self._exited and _kill_child(self.proc.pid):
            return  # the namespace's init: the kernel kills the rest, the relay reports it
        self._killpg()

    def _killpg(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def abort(self) -> None:
        """Stop now (the caller was cancelled or failed): kill, close, reap."""
        self.kill("cancelled")
        self._reap()

    def _reap(self) -> int:
        for fd in list(self._files):
            self.close(fd)
        try:
            code = self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:  # stuck in the kernel: Popen reaps it later
            code = -signal.SIGKILL
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return code

    def result(self) -> ExecResult:
        code = self._reap()
        stdout, stderr = self._out.text(), self._err.text()
        return ExecResult(
            exit_code=code, stdout=stdout, stderr=stderr, timed_out=self.timed_out,
            killed_by=self.killed_by or ending(code, stderr),
            wall_ms=(time.monotonic() - self._started) * 1000,
        )


def _kill_child(pid: int) -> bool:
    """SIGKILL `pid`'s child (the namespace's init), through a pidfd taken while `pid` — ours,
    not yet reaped — has not reaped it either; False when there is none."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = f.read().split()
        if not children:
            return False
        fd = os.pidfd_open(int(children[0]))
    except (AttributeError, OSError, ValueError):
        return False
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)
    return True


def _exited_unreaped(pid: int) -> bool:
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True
