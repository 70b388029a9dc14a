"""What a sandboxed child does between fork and exec, and which of it this machine allows.

Before it execs the command, the child of `Sandbox.run` confines itself with whatever
`probe()` found to work here:

    network   unshare(CLONE_NEWNET): a network namespace of its own whose only interface
              is a private loopback, so nothing of the host answers, not even on
              127.0.0.1. Root needs CAP_SYS_ADMIN (and a seccomp profile that allows
              unshare); another user needs unprivileged user namespaces.
    mounts    unshare(CLONE_NEWNS | CLONE_NEWIPC): the world-writable directories
              (/tmp, /var/tmp, /dev/shm, /run/lock) read-only, the sandbox's own
              directory writable, System V IPC of its own.
    pids      unshare(CLONE_NEWPID), and a small init (pid 1) that reaps every orphan:
              when the command exits, everything it started dies with the namespace —
              a daemon that left the process group (setsid) included — and no zombie
              outlives the step to count against the next one's RLIMIT_NPROC. With
              mounts, a /proc of its own: the command sees only its processes, not the
              command lines of the services around it.
    uid       a uid of its own (a `UidLease`), no groups, no capabilities. Only then does
              RLIMIT_NPROC hold (root ignores it), do file permissions deny writes
              outside the sandbox, and can leftovers be killed all at once (`sweep`).
              Without it a root child keeps CAP_SYS_ADMIN and could undo every namespace
              above, so `probe` reports none of them as effective.
    always    rlimits (cpu, address space, file size, open files, no core dumps) and
              no_new_privs: a setuid binary cannot hand root back.

This runs as subprocess's `preexec_fn`: Python between fork and exec, which CPython warns
can deadlock in a threaded parent. So `preexec` only calls functions resolved in the
parent (libc through ctypes, os, resource) on values computed in the parent: no imports,
no logging, no locks; subprocess keeps the garbage collector off there, so no finalizer
of the worker's objects runs in a child. The pid namespace's relay and init are such
children that never exec: idle copies of the worker (shared pages) for one step.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import pwd
import random
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
PR_SET_NO_NEW_PRIVS = 38
SIOCSIFFLAGS, IFF_UP = 0x8914, 0x1

# Directories anyone may write to; a mount namespace makes them read-only for the child.
SHARED_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.unshare.argtypes = [ctypes.c_int]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_char_p]
_libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
_SIGNALS = [int(s) for s in signal.valid_signals()
            if s not in (signal.SIGKILL, signal.SIGSTOP) and s < signal.SIGRTMIN]
_MAX_FD = os.sysconf("SC_OPEN_MAX")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


@dataclass(frozen=True)
class Plan:
    """What one child does before exec; everything decided in the parent."""

    workdir: str
    network: bool = False
    user_namespace: bool = False  # the unprivileged way to a network namespace
    mounts: bool = False
    pids: bool = False  # a pid namespace (and, with mounts, a /proc of its own)
    uid: int | None = None
    readonly_dirs: tuple[str, ...] = ()
    rlimits: tuple[tuple[int, int, int], ...] = ()  # (resource, soft, hard)


def preexec(plan: Plan) -> Callable[[], None]:
    """The child's confinement, as a `preexec_fn`: namespaces, mounts, rlimits, no_new_privs,
    then the uid (last: everything before it needs root)."""
    workdir = os.fsencode(plan.workdir)
    flags = (CLONE_NEWNET if plan.network else 0) | (CLONE_NEWNS | CLONE_NEWIPC if plan.mounts else 0)
    flags |= (CLONE_NEWUSER if plan.user_namespace else 0) | (CLONE_NEWPID if plan.pids else 0)
    readonly = [os.fsencode(d) for d in plan.readonly_dirs]
    ids = (os.getuid(), os.getgid())
    maps = [(b"/proc/self/setgroups", b"deny"), (b"/proc/self/uid_map", b"%d %d 1" % (ids[0], ids[0])),
            (b"/proc/self/gid_map", b"%d %d 1" % (ids[1], ids[1]))]
    ifreq = ctypes.create_string_buffer(b"lo".ljust(16, b"\0") + IFF_UP.to_bytes(2, sys.byteorder), 40)
    rlimits = plan.rlimits

    def child() -> None:
        for sig in _SIGNALS:  # the worker's handlers and ignores are not the command's
            _libc.signal(sig, None)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        if flags:
            _check(_libc.unshare(flags), "unshare")
        if plan.user_namespace:  # be ourselves inside it, not the overflow uid
            for path, text in maps:
                fd = os.open(path, os.O_WRONLY)
                os.write(fd, text)
                os.close(fd)
        if plan.network:  # a loopback of its own, for programs that talk to themselves
            sock = _libc.socket(2, 2, 0)  # AF_INET, SOCK_DGRAM
            if sock >= 0:
                _libc.ioctl(sock, SIOCSIFFLAGS, ifreq)
                _libc.close(sock)
        if plan.mounts:
            _check(_libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
            # The workdir first, so the read-only bind of its parent carries it writable.
            _check(_libc.mount(workdir, workdir, None, MS_BIND | MS_REC, None), "bind workdir")
            for d in readonly:
                _check(_libc.mount(d, d, None, MS_BIND | MS_REC, None), "bind")
                flags_ro = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
                _check(_libc.mount(None, d, None, flags_ro, None), "remount read-only")
        if plan.pids:
            _fork_into_namespace(mount_proc=plan.mounts)
        os.chdir(workdir)  # onto the new mounts: the old cwd is the path under them
        for which, soft, hard in rlimits:
            resource.setrlimit(which, (soft, hard))
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        if plan.uid is not None:
            os.setgroups([])
            os.setgid(plan.uid)
            os.setuid(plan.uid)

    return child


def _fork_into_namespace(mount_proc: bool) -> None:
    """Returns in the command-to-be, pid 2 of the new pid namespace. Its parent is the
    namespace's init (pid 1), which reaps every orphan and, when the command exits, hands
    its wait status to the relay and exits: the kernel then kills whatever is left in the
    namespace, escapees from the process group included. The relay — the caller, the
    process subprocess started — stays outside (unshare(CLONE_NEWPID) never moves its
    caller) and exits the way the command did. Neither keeps the command's pipes open."""
    r, w = os.pipe()
    init = os.fork()
    if init:
        os.close(w)
        os.closerange(0, r)  # the pipes to the worker, and the exec-error pipe
        os.closerange(r + 1, _MAX_FD)
        status = b""
        while len(status) < 4 and (chunk := os.read(r, 4 - len(status))):
            status += chunk
        _, own = os.waitpid(init, 0)
        _exit_like(int.from_bytes(status, "little") if len(status) == 4 else own)
    os.close(r)
    if mount_proc:  # mounted by pid 1 it shows this namespace only; hidepid: not pid 1 either
        proc_flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
        _check(_libc.mount(b"proc", b"/proc", b"proc", proc_flags, b"hidepid=2"), "mount proc")
    command = os.fork()
    if command:
        os.closerange(0, w)
        os.closerange(w + 1, _MAX_FD)
        while True:  # reap everyone; the command's end is the namespace's
            try:
                pid, status_ = os.waitpid(-1, 0)
            except ChildProcessError:
                os._exit(0)
            if pid == command:
                os.write(w, status_.to_bytes(4, "little"))
                os._exit(0)
    os.close(w)


def _exit_like(status: int) -> None:
    """Exit with a child's wait status: the same code, or death by the same signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core of a copy of the worker
        os.kill(os.getpid(), sig)  # its disposition is the default: reset in child()
        os._exit(128 + sig)  # one whose default is to be ignored
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def shared_writable_dirs() -> tuple[str, ...]:
    """The world-writable directories of `SHARED_WRITABLE` that exist here, resolved."""
    found: list[str] = []
    for d in SHARED_WRITABLE:
        real = os.path.realpath(d)
        try:
            st = os.stat(real)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_IWOTH and real not in found:
            found.append(real)
    return tuple(found)


@dataclass(frozen=True)
class Capabilities:
    """Which protections a sandboxed child gets on this machine, and why some do not."""

    network_isolated: bool
    mounts_isolated: bool
    pids_isolated: bool
    uid_dropped: bool
    user_namespace: bool  # network isolation is through an unprivileged user namespace
    missing: dict[str, str] = field(default_factory=dict)  # protection -> why not

    def as_dict(self) -> dict[str, bool]:
        return {
            "network_isolated": self.network_isolated,
            "mounts_isolated": self.mounts_isolated,
            "pids_isolated": self.pids_isolated,
            "uid_dropped": self.uid_dropped,
            "nproc_enforced": self.uid_dropped,
            "rlimits": True,
            "no_new_privs": True,
        }


_probed: Capabilities | None = None


def probe() -> Capabilities:
    """Try each protection once in a throwaway child (a few ms each); remembered per process."""
    global _probed
    if _probed is None:
        _probed = _probe()
        logger.info("sandbox protections: %s%s", _probed.as_dict(),
                    f"; missing: {_probed.missing}" if _probed.missing else "")
    return _probed


def _probe() -> Capabilities:
    scratch = tempfile.mkdtemp(prefix="nextstate-probe-")
    try:
        def works(plan: Plan) -> bool:
            try:
                return _spawn_true(plan) == 0
            except (OSError, subprocess.SubprocessError):
                return False

        missing: dict[str, str] = {}
        if os.geteuid() != 0:
            network = works(Plan(scratch, network=True, user_namespace=True))
            if not network:
                missing["network_isolated"] = "unprivileged user namespaces are not allowed here"
            why = "not root: cannot change uid or mount"
            missing.update(uid_dropped=why, mounts_isolated=why, pids_isolated=why)
            return Capabilities(network, False, False, False, network, missing)
        uid = works(Plan(scratch, uid=65534))
        network = works(Plan(scratch, network=True))
        readonly = shared_writable_dirs()
        mounts = works(Plan(scratch, mounts=True, readonly_dirs=readonly))
        pids = works(Plan(scratch, mounts=mounts, pids=True, readonly_dirs=readonly if mounts else ()))
        denied = "failed (no CAP_SYS_ADMIN, or seccomp denies it)"
        for name, ok, why in (
            ("uid_dropped", uid, "setuid failed"),
            ("network_isolated", network, f"unshare(CLONE_NEWNET) {denied}"),
            ("mounts_isolated", mounts, f"unshare(CLONE_NEWNS) or a bind mount {denied}"),
            ("pids_isolated", pids, f"unshare(CLONE_NEWPID) {denied}"),
        ):
            if not ok:
                missing[name] = why
        if not uid:  # a root child could undo the namespaces
            for name in ("network_isolated", "mounts_isolated", "pids_isolated"):
                missing.setdefault(name, "the child stays root and could undo it")
            network = mounts = pids = False
        return Capabilities(network, mounts, pids, uid, False, missing)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _spawn_true(plan: Plan) -> int:
    argv = [shutil.which("true") or sys.executable, *([] if shutil.which("true") else ["-c", ""])]
    return subprocess.run(argv, cwd=plan.workdir, env={}, preexec_fn=preexec(plan),
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, timeout=10, check=False).returncode


def sweep(uid: int) -> None:
    """Kill every process of `uid` (of this pid namespace): `kill -KILL -1` run as that uid
    reaches exactly those, escapees from the process group (setsid) and forks in flight
    included. Only for uids of the lease range: anything else running as them dies."""
    kill = shutil.which("kill")
    argv = [kill, "-KILL", "--", "-1"] if kill else [sys.executable, "-S", "-c", "import os; os.kill(-1, 9)"]
    try:
        subprocess.run(argv, user=uid, group=uid, extra_groups=[], env={}, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("could not sweep the processes of uid %s: %s", uid, e)


class UidLease:
    """A uid of the range [base, base + count) that no other sandbox holds: an flock on
    `<lock_dir>/<uid>` for as long as the sandbox lives (the kernel drops it if the worker
    dies). Uids with a passwd entry are skipped: they belong to someone. Taking and
    releasing sweep the uid, so a sandbox starts with no process of a crashed one counted
    against its RLIMIT_NPROC."""

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self._fd: int | None = fd

    @classmethod
    def take(cls, base: int, count: int, lock_dir: Path) -> UidLease:
        private_dir(lock_dir, mode=0o700)
        start = random.randrange(count)  # concurrent takers rarely try the same uid first
        for i in range(count):
            uid = base + (start + i) % count
            if _has_passwd_entry(uid):
                continue
            fd = os.open(lock_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            sweep(uid)
            return cls(uid, fd)
        raise OSError(errno.EBUSY, f"every uid of {base}..{base + count - 1} is held by a sandbox "
                      f"(locks in {lock_dir}); raise uid_count or close sandboxes")

    def release(self) -> None:
        if self._fd is not None:
            sweep(self.uid)
            os.close(self._fd)
            self._fd = None


def _has_passwd_entry(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def private_dir(path: Path, mode: int) -> None:
    """Create `path` (mode `mode`) or check it: ours, and nobody else may write to it — a
    directory someone else made first could be theirs to swap things in."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise OSError(errno.EPERM, f"{path} must be a directory owned by uid {os.geteuid()} and "
                      f"writable by no one else (it is {stat.filemode(st.st_mode)}, uid {st.st_uid}); "
                      "remove it or choose another path")
