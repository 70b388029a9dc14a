"""The sandbox every tool call of an environment episode runs in: a private working directory,
and for each command a child process confined as far as this machine allows.

One `Sandbox` per episode. Its directory (under `root`, removed by `close()`) is the
command's cwd, HOME and TMPDIR, and outlives each step; nothing else does: when the
command exits, what it left running (background jobs, daemons) is killed. The command
gets a minimal environment (nothing of the worker's: no NEXTSTATE_*, no AWS_*; `env`
adds to it as given), rlimits, and — found by `confine.probe()` once per process — a uid
of the sandbox's own and its own network, mount and pid namespaces (confine.py says what
each buys and needs). `capabilities()` says which hold here; `SandboxConfig.require`
names those a deployment refuses to run without.

Every way a command can end — a crash, an infinite loop, a fork bomb, a memory hog, an
output flood, a write or a connect it is denied — comes back as an `ExecResult` whose
`observation()` the agent reads; the caller never waits past `wall_seconds` (plus a
fraction of a second to kill and drain). A call costs the worker a fork (in `arun` too,
on the event loop: ~5-8 ms with every protection). What the sandbox does not do: cap the
disk the directory may fill (only each file's size), hide world-readable files, or limit
memory by resident size (RLIMIT_AS counts address space: runtimes that reserve large
virtual areas, Go and the JVM, need a higher `memory_bytes`).

That is the `process` backend, the default. Where a Docker engine answers, `backend:
docker` runs each command in a `docker run --rm --network none` container instead, with
the same directory mounted, the same limits (memory and pids as cgroup limits) and the same
`ExecResult` (container.py); `check_backend` says whether the configured one can run here.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import selectors
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Literal

from pydantic import BaseModel, Field

from services.envs import confine, container
from services.envs.container import DockerConfig, DockerUnavailable
from services.envs.execution import ExecResult, Execution, SandboxLimits, ending
from shared.errors import NextstateError

__all__ = ["ExecResult", "Sandbox", "SandboxConfig", "SandboxError", "SandboxLimits", "SandboxUnavailable",
           "check_backend"]

logger = logging.getLogger(__name__)

Protection = Literal["network_isolated", "mounts_isolated", "pids_isolated", "uid_dropped"]
Backend = Literal["process", "docker"]
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class SandboxError(NextstateError):
    """The sandbox itself failed (not the command in it): it was closed, or the child could
    not be started or confined."""


class SandboxUnavailable(SandboxError):
    """A protection the configuration requires does not work on this machine, or the
    sandbox root is unsafe; the message says which and what would make it work."""


class SandboxConfig(BaseModel):
    """The sandbox group of an environment service's settings (NEXTSTATE_<SERVICE>__SANDBOX__*)."""

    # Where episode directories are made; default <tmp>/nextstate-sandboxes. Every
    # directory above it must be searchable by others (the command runs as another uid).
    root: Path | None = None
    # Protections to refuse to run without, e.g. ["network_isolated", "uid_dropped"].
    require: list[Protection] = Field(default_factory=list)
    # The uids sandboxes run as: a range no one else uses — every process of a leased uid
    # is killed when a sandbox takes or releases it. Locks in uid_lock_dir (default
    # <tmp>/nextstate-sandbox-uids) keep two sandboxes on this machine off the same uid.
    uid_base: int = Field(620_000, ge=1000)
    uid_count: int = Field(1000, ge=1)
    uid_lock_dir: Path | None = None
    # process: a confined child process per command (above). docker: a `docker run --rm`
    # container per command (container.py), where a Docker engine answers.
    backend: Backend = "process"
    docker: DockerConfig = DockerConfig()


def check_backend(config: SandboxConfig) -> None:
    """Raise `SandboxUnavailable` when `config`'s sandbox cannot run here: a required
    protection missing (process backend), or no Docker engine answering (docker backend,
    whose containers have no network and mount and pid namespaces of their own)."""
    if config.backend == "docker":
        try:
            container.check_available(config.docker)
        except DockerUnavailable as e:
            raise SandboxUnavailable(str(e)) from e
        return
    check_required(config.require)


def capabilities() -> dict[str, bool]:
    """Which protections a sandboxed command gets on this machine (probed once per process)."""
    return confine.probe().as_dict()


def check_required(required: list[Protection]) -> None:
    """Raise `SandboxUnavailable` naming each required protection that does not work here."""
    caps = confine.probe()
    missing = [p for p in required if not caps.as_dict()[p]]
    if missing:
        why = "; ".join(f"{p}: {caps.missing.get(p, 'unavailable')}" for p in missing)
        raise SandboxUnavailable(
            f"the sandbox configuration requires {', '.join(missing)}, which this machine does not "
            f"allow ({why}); run the worker as root with CAP_SYS_ADMIN and a seccomp profile that "
            "allows unshare and mount, or remove them from sandbox.require"
        )


class Sandbox:
    """One episode's working directory and the confined commands run in it. Commands may run
    concurrently (they share the uid's max_processes); `close()` once, when the episode ends."""

    capabilities = staticmethod(capabilities)

    def __init__(self, config: SandboxConfig | None = None, *, limits: SandboxLimits | None = None) -> None:
        self.config = config or SandboxConfig()
        self.limits = limits or SandboxLimits()
        check_backend(self.config)
        caps = confine.probe()
        tmp = Path(tempfile.gettempdir())
        root = self.config.root or tmp / "nextstate-sandboxes"
        try:
            confine.private_dir(root, mode=0o711)  # others may pass through, not list or write
            if caps.uid_dropped:
                _check_searchable(root)
            self._lease = (
                confine.UidLease.take(self.config.uid_base, self.config.uid_count,
                                      self.config.uid_lock_dir or tmp / "nextstate-sandbox-uids")
                if caps.uid_dropped else None
            )
        except OSError as e:
            raise SandboxUnavailable(str(e)) from e
        try:
            self.path = Path(tempfile.mkdtemp(prefix="ep-", dir=root))
            (self.path / ".tmp").mkdir(mode=0o700)
            if self._lease is not None:
                for p in (self.path, self.path / ".tmp"):
                    os.chown(p, self._lease.uid, self._lease.uid)
        except BaseException:
            if self._lease is not None:
                self._lease.release()
            raise
        self._caps = caps
        self._readonly = confine.shared_writable_dirs() if caps.mounts_isolated else ()
        self._containers_killed = False
        self._removals: list[subprocess.Popen[bytes]] = []  # `docker rm -f` started by kills
        self._closed = False
        logger.debug("sandbox %s (uid %s)", self.path, self._lease.uid if self._lease else os.geteuid())

    @property
    def uid(self) -> int:
        """The uid commands run as."""
        return self._lease.uid if self._lease is not None else os.geteuid()

    def run(self, argv: list[str], *, stdin: str | bytes | None = None, limits: SandboxLimits | None = None,
            env: dict[str, str] | None = None) -> ExecResult:
        """Run `argv` in the sandbox and wait for it (at most wall_seconds, then it is killed)."""
        ex = self._start(argv, stdin, limits or self.limits, env)
        if isinstance(ex, ExecResult):
            return ex
        try:
            with selectors.DefaultSelector() as sel:
                for fd in ex.readers():
                    sel.register(fd, selectors.EVENT_READ)
                for fd in ex.writers():
                    sel.register(fd, selectors.EVENT_WRITE)
                while not ex.finished:
                    for key, _ in sel.select(ex.timeout()):
                        if ex.handle(key.fd):
                            sel.unregister(key.fd)
                            ex.close(key.fd)
                    ex.tick()
        except BaseException:
            ex.abort()
            raise
        return self._finished(argv, ex.result())

    async def arun(self, argv: list[str], *, stdin: str | bytes | None = None, limits: SandboxLimits | None = None,
                   env: dict[str, str] | None = None) -> ExecResult:
        """`run` on the event loop (its readers, no thread); cancelling it kills the command."""
        ex = self._start(argv, stdin, limits or self.limits, env)
        if isinstance(ex, ExecResult):
            return ex
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def ready(fd: int, writer: bool) -> None:
            if ex.handle(fd):
                (loop.remove_writer if writer else loop.remove_reader)(fd)
                ex.close(fd)
            wake.set()

        for fd in ex.readers():
            loop.add_reader(fd, ready, fd, False)
        for fd in ex.writers():
            loop.add_writer(fd, ready, fd, True)
        try:
            while not ex.finished:
                timer = loop.call_later(ex.timeout(), wake.set)
                try:
                    await wake.wait()
                finally:
                    timer.cancel()
                wake.clear()
                ex.tick()
        except BaseException:
            try:
                self._unregister(loop, ex)
            finally:
                ex.abort()
            raise
        self._unregister(loop, ex)
        return self._finished(argv, ex.result())

    @staticmethod
    def _unregister(loop: asyncio.AbstractEventLoop, ex: Execution) -> None:
        for fd, writer in ex.open_fds():
            (loop.remove_writer if writer else loop.remove_reader)(fd)

    def _start(self, argv: list[str], stdin: str | bytes | None, limits: SandboxLimits,
               env: dict[str, str] | None) -> Execution | ExecResult:
        if self._closed:
            raise SandboxError(f"sandbox {self.path} is closed")
        if not argv:
            raise ValueError("argv is empty")
        if self.config.backend == "docker":
            return self._start_container(argv, stdin, limits, env)
        plan = confine.Plan(
            workdir=str(self.path),
            network=self._caps.network_isolated,
            user_namespace=self._caps.user_namespace,
            mounts=self._caps.mounts_isolated,
            pids=self._caps.pids_isolated,
            uid=self._lease.uid if self._lease is not None else None,
            readonly_dirs=self._readonly,
            rlimits=rlimits_for(limits, nproc=self._lease is not None),
        )
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, cwd=self.path,
                env=self._env(env), start_new_session=True, close_fds=True,
                preexec_fn=confine.preexec(plan),
            )
        except OSError as e:
            if e.filename is None:  # the worker could not fork: not the command's doing
                raise SandboxError(f"could not start {argv[0]!r} in {self.path}: {e}") from e
            code = 127 if e.errno == errno.ENOENT else 126  # the shell's codes
            text = "command not found" if e.errno == errno.ENOENT else (e.strerror or str(e))
            return ExecResult(exit_code=code, stdout="", stderr=f"{argv[0]}: {text}\n",
                              wall_ms=(time.monotonic() - started) * 1000)
        except subprocess.SubprocessError as e:
            raise SandboxError(f"the child of {self.path} could not confine itself ({e}); "
                               f"the probe said {self._caps.as_dict()}") from e
        sweep = partial(confine.sweep, self._lease.uid) if self._lease is not None else None
        return Execution(proc, limits, _encoded(stdin), started, sweep,
                         pid_namespace=plan.pids)

    def _start_container(self, argv: list[str], stdin: str | bytes | None, limits: SandboxLimits,
                         env: dict[str, str] | None) -> Execution:
        cfg = self.config.docker
        name = container.container_name()
        cmd = container.run_argv(cfg, argv, name=name, sandbox_id=self.path.name, workdir=str(self.path),
                                 uid=self.uid, env=self._env(env), limits=limits, stdin=stdin is not None)
        started = time.monotonic()
        try:  # the docker CLI is the worker's own client: its environment, no confinement
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0, cwd=self.path,
                env=_client_env(), start_new_session=True, close_fds=True,
            )
        except OSError as e:
            raise SandboxError(f"could not start the docker CLI {cmd[0]!r}: {e}") from e

        def killed() -> None:  # a killed client leaves its container running
            removal = container.remove(cfg, [name])
            if removal is not None:
                self._removals.append(removal)
            self._containers_killed = True

        return Execution(proc, limits, _encoded(stdin), started, None,
                         pid_namespace=False, on_kill=killed)

    def _finished(self, argv: list[str], result: ExecResult) -> ExecResult:
        if self.config.backend == "docker":
            failure = container.docker_failure(result.exit_code, result.stderr)
            if failure is not None:
                raise SandboxError(f"docker could not run {argv[0]!r} in {self.config.docker.image}: {failure}")
            code = container.exit_code(result.exit_code)
            if code != result.exit_code:
                result = replace(result, exit_code=code, killed_by=result.killed_by or ending(code, result.stderr))
        return _logged(argv, result)

    def _env(self, extra: dict[str, str] | None) -> dict[str, str]:
        """The command's whole environment: nothing inherited from the worker."""
        home = str(self.path)
        env = {"PATH": PATH, "HOME": home, "TMPDIR": f"{home}/.tmp", "LANG": "C.UTF-8",
               "USER": "sandbox", "LOGNAME": "sandbox", "PYTHONDONTWRITEBYTECODE": "1"}
        env.update(extra or {})
        return env

    def close(self) -> None:
        """Kill whatever still runs as the sandbox's uid, then remove its directory."""
        if self._closed:
            return
        self._closed = True
        if self._containers_killed:  # the kills' removals done, and nothing of the episode left
            container.finish(self.config.docker, self._removals)
            container.remove_labelled(self.config.docker, self.path.name)
        if self._lease is not None:
            self._lease.release()
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await asyncio.to_thread(self.close)


def _encoded(stdin: str | bytes | None) -> bytes | None:
    return stdin.encode() if isinstance(stdin, str) else stdin


def _logged(argv: list[str], result: ExecResult) -> ExecResult:
    logger.debug("%s: exit %s%s in %.1f ms", argv[0], result.exit_code,
                 f" ({result.killed_by})" if result.killed_by else "", result.wall_ms)
    return result


def _client_env() -> dict[str, str]:
    """What the docker CLI needs of the worker's environment (its engine, its config)."""
    keep = ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONTEXT", "DOCKER_CONFIG", "DOCKER_CERT_PATH",
            "DOCKER_TLS_VERIFY", "DOCKER_API_VERSION")
    return {k: os.environ[k] for k in keep if k in os.environ}


def rlimits_for(limits: SandboxLimits, *, nproc: bool) -> tuple[tuple[int, int, int], ...]:
    """(resource, soft, hard) for a child, never above the worker's own hard limits (raising
    them needs CAP_SYS_RESOURCE). CPU: SIGXCPU at the limit, SIGKILL a second later."""
    wanted = [
        (resource.RLIMIT_CPU, limits.cpu_seconds, limits.cpu_seconds + 1),
        (resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes),
        (resource.RLIMIT_FSIZE, limits.file_size_bytes, limits.file_size_bytes),
        (resource.RLIMIT_NOFILE, limits.open_files, limits.open_files),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    if nproc:  # only for a uid of its own: otherwise it counts the worker's processes too
        wanted.append((resource.RLIMIT_NPROC, limits.max_processes, limits.max_processes))
    out = []
    for which, soft, hard in wanted:
        ceiling = resource.getrlimit(which)[1]
        if ceiling != resource.RLIM_INFINITY:
            hard = min(hard, ceiling)
        out.append((which, min(soft, hard), hard))
    return tuple(out)


def _check_searchable(root: Path) -> None:
    """The command (another uid) must be able to reach its directory by its full path."""
    for p in [root, *root.parents]:
        if not os.stat(p).st_mode & stat.S_IXOTH:
            raise OSError(errno.EACCES, f"sandbox root {root}: {p} is not searchable by others "
                          f"({stat.filemode(os.stat(p).st_mode)}); choose a root every directory "
                          "above which has o+x, or chmod o+x it")
