"""Run a set of processes as one: dependency order, readiness waits, prefixed logs, restarts.

`nextstate up` describes each service as a `Proc` (argv, environment, how to tell it is
ready, whether it is on the serving path); `Supervisor.start` launches one, and
`start_together` a group of processes that do not depend on each other, at once; each
call returns once its processes answer ready, so what comes next may depend on them.
Degrade, never fall:

- A process that exits is restarted, forever, after a capped exponential backoff with
  jitter (`Backoff`); the count starts over once it stayed up `stable_s`. What it left
  running in its process group is killed first (`exit_of`: vLLM's engine core outlives a
  killed API server and holds its output pipe). A run of quick
  exits is a *crash loop*: said once, loudly, and once more when it recovers.
- At start, a serving-path process (Redis, bucket, engine, collector) that cannot become
  ready is an error (`ProcessFailed`): there would be nothing to serve. Any other one is
  reported and left to the restart loop while the rest starts.
- A process that exits before it was ever ready because its port was taken in the
  meantime (its output says so) is relaunched on new port(s) chosen by its `rebind`
  hook. Once it was ready, a restart keeps its ports: dependents know them.
- Each process has a state record (`Proc.record`); `report_states` writes them into one
  Redis hash on every change and every few seconds, for `nextstate status`. A Redis that
  does not answer only costs a skipped write.
- `stop` sends SIGTERM in reverse start order (a group together), waits, SIGKILLs
  stragglers and leaves every record `stopped`.

Every line a child prints is echoed with its name as a coloured prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TextIO

import httpx

from services.ctl.infra import is_bind_failure
from services.ctl.proc_states import RedisStates

Ready = Callable[[], Awaitable[bool]]
State = Literal["starting", "ready", "running", "restarting", "crash-loop", "stopped"]

COLORS = ["36", "32", "33", "35", "34", "91", "92", "93", "94", "95", "96"]
LOUD = "1;91"  # bold bright red: crash loops and failed starts


def http_ready(url: str) -> Ready:
    async def check() -> bool:
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                return (await client.get(url)).status_code == 200
        except httpx.HTTPError:
            return False

    return check


@dataclass(frozen=True)
class Backoff:
    """Delay before the n-th restart in a row: `base_s`·2^(n−1), at most `cap_s`, shortened
    at random by up to `jitter` of itself (so processes that fail together spread out)."""

    base_s: float = 1.0
    cap_s: float = 60.0
    jitter: float = 0.25

    def delay(self, failures: int, rand: Callable[[], float] = random.random) -> float:
        nominal = min(self.cap_s, self.base_s * 2.0 ** min(max(failures - 1, 0), 64))
        return nominal * (1.0 - self.jitter * rand())


def exit_status(returncode: int) -> int | str:
    """The exit code, or the name of the signal that ended the process (`SIGKILL`)."""
    if returncode >= 0:
        return returncode
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


@dataclass
class Proc:
    """One supervised process: how to launch it and tell it is ready, and its live state."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready: Ready | None = None
    ready_timeout_s: float = 180.0
    restart: bool = True
    cwd: str | None = None
    serving_path: bool = False
    port: int | None = None
    # Called after a bind failure before the process was ever ready: choose new port(s)
    # and update argv, env, ready and port in place.
    rebind: Callable[[Proc], None] | None = None
    # This process is the Redis the records are written to: its own record goes in first.
    state_store: bool = False
    # -- live state, kept by the supervisor ---------------------------------------------
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    color: str = "37"
    state: State = "starting"
    since: float = field(default_factory=time.time)
    last_exit: int | str | None = None
    error: str | None = None
    failures: int = 0  # exits in a row without staying up `stable_s`
    backoff_s: float | None = None
    ever_ready: bool = False
    ready_now: bool = False  # this run of the process answered ready
    spawned_at: float = 0.0
    output: deque[str] = field(default_factory=lambda: deque(maxlen=100))  # this run's last lines
    pipe: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        proc = self.process
        return proc.pid if proc is not None and proc.returncode is None else None

    def record(self) -> dict[str, Any]:
        """What `nextstate status` shows of this process (JSON-ready)."""
        return {
            "state": self.state, "pid": None if self.state == "stopped" else self.pid, "restarts": self.restarts,
            "last_exit": self.last_exit, "since": round(self.since, 3), "port": self.port,
            "serving_path": self.serving_path, "error": self.error,
            "backoff_s": None if self.backoff_s is None else round(self.backoff_s, 3),
        }


class ProcessFailed(RuntimeError):
    pass


async def exit_of(proc: asyncio.subprocess.Process, poll_s: float = 0.5) -> int:
    """`proc`'s exit status once it exits. `proc.wait()` alone also waits for its output pipe
    to close, which a child it left behind keeps open (vLLM's engine core, when the API
    server is killed): once the process itself is gone, the rest of its process group (its
    own session, see `_spawn`) is killed too, so that it can be restarted."""
    waiting = asyncio.ensure_future(proc.wait())
    try:
        while not waiting.done():
            if proc.returncode is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(waiting), 10)
                return proc.returncode
            await asyncio.wait({waiting}, timeout=poll_s)
        return waiting.result()
    finally:
        waiting.cancel()


class Supervisor:
    def __init__(
        self, *, out: TextIO | None = None, backoff: Backoff | None = None, stable_s: float = 60.0,
        crash_loop_after: int = 3, bind_attempts: int = 4, publish_every_s: float = 5.0,
    ) -> None:
        self.procs: list[Proc] = []
        self._groups: list[list[Proc]] = []  # started together; stopped together, in reverse
        self.cancel_wait_s = 5.0  # how long `stop` waits for its own tasks to end
        self.out = out or sys.stdout
        self.backoff = backoff or Backoff()
        self.stable_s = stable_s
        self.crash_loop_after = crash_loop_after
        self.bind_attempts = bind_attempts
        self.publish_every_s = publish_every_s
        # Called on every change of a process (state, pid, port): `up` keeps its record.
        self.on_change: Callable[[Proc], None] | None = None
        self._stopping = False
        self._watchers: list[asyncio.Task[None]] = []
        self._pipes: set[asyncio.Task[None]] = set()
        self._width = 10
        self._states: RedisStates | None = None
        self._states_ok = True
        self._publisher: asyncio.Task[None] | None = None
        self._dirty = asyncio.Event()

    def say(self, name: str, line: str, color: str = "1") -> None:
        tty = getattr(self.out, "isatty", lambda: False)()
        prefix = f"{name:<{self._width}}|"
        if tty:
            prefix = f"\x1b[{color}m{prefix}\x1b[0m"
        print(f"{prefix} {line}", file=self.out, flush=True)

    # -- state records ----------------------------------------------------------------
    def records(self) -> dict[str, dict[str, Any]]:
        return {p.name: p.record() for p in self.procs}

    def _touch(self, p: Proc) -> None:
        """`p` changed (pid, port, counters): publish it."""
        self._dirty.set()
        if self.on_change is not None:
            self.on_change(p)

    def _set(self, p: Proc, state: State, error: str | None = None) -> None:
        if state != p.state:
            p.state, p.since = state, time.time()
        p.error = error
        self._touch(p)

    @staticmethod
    def _alive_state(p: Proc) -> State:
        if p.ready_now:
            return "ready"
        return "running" if p.ready is None else "starting"

    def report_states(self, url: str, key: str) -> None:
        """Write every record into the Redis hash `key` at `url`: now, on each change and
        every `publish_every_s` (a Redis that restarted gets them back)."""
        self._states = RedisStates(url, key)
        self._dirty.set()
        self._publisher = asyncio.create_task(self._publish_loop(), name="publish-states")

    async def _publish(self) -> bool:
        if self._states is None:
            return True
        ok = await self._states.write(self.records())
        if ok != self._states_ok:
            self._states_ok = ok
            self.say("up", "service states: written to Redis again" if ok else
                     f"service states: cannot write to Redis ({self._states.error}); will retry")
        return ok

    async def _publish_loop(self) -> None:
        # Ends on `_stopping`, not only on cancellation: before Python 3.12, a wait_for whose
        # awaitable completes as the task is cancelled returns instead of raising (its event
        # set by the last state change, say), and this loop would go on, with `stop` waiting.
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), self.publish_every_s)
            self._dirty.clear()
            if not self._stopping:
                await self._publish()

    # -- one run of a process ----------------------------------------------------------
    async def _spawn(self, p: Proc) -> None:
        env = dict(os.environ)
        env.update(p.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        p.output = deque(maxlen=100)
        p.ready_now = False
        try:
            p.process = await asyncio.create_subprocess_exec(
                *p.argv, env=env, cwd=p.cwd, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True, limit=1 << 20,
            )
        except OSError as exc:
            p.process = None
            raise ProcessFailed(f"{p.name} could not be launched: {exc}") from exc
        p.spawned_at = time.monotonic()
        p.pipe = asyncio.create_task(self._pipe(p, p.process, p.output))
        self._pipes.add(p.pipe)
        p.pipe.add_done_callback(self._pipes.discard)
        if p.state == "crash-loop":
            self._touch(p)  # stays a crash loop until it stays up
        else:
            self._set(p, self._alive_state(p))

    async def _pipe(self, p: Proc, process: asyncio.subprocess.Process, output: deque[str]) -> None:
        assert process.stdout is not None
        while True:
            try:
                raw = await process.stdout.readline()
            except ValueError:  # a line longer than the pipe's limit: dropped, not fatal
                continue
            if not raw:
                return
            line = raw.decode(errors="replace").rstrip()
            output.append(line)
            self.say(p.name, line, p.color)

    async def _port_was_taken(self, p: Proc) -> bool:
        """`p` exited, and its last words say it could not listen."""
        if p.process is None or p.process.returncode is None:
            return False
        if p.pipe is not None:  # read what it printed to the end
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(p.pipe), 2.0)
        return is_bind_failure("\n".join(p.output))

    def _rebind(self, p: Proc) -> None:
        assert p.rebind is not None
        old = p.port
        p.rebind(p)
        self.say("up", f"{p.name} could not listen on port {old} (taken since it was picked); "
                       f"relaunching it on port {p.port}")
        self._touch(p)

    async def _await_ready(self, p: Proc) -> None:
        """Poll `p.ready` until it answers (ProcessFailed if `p` exits or the time is up)."""
        if p.ready is None:
            return
        deadline = time.monotonic() + p.ready_timeout_s
        while time.monotonic() < deadline:
            assert p.process is not None
            if p.process.returncode is not None:
                raise ProcessFailed(
                    f"{p.name} exited with {exit_status(p.process.returncode)} before it was ready")
            if await p.ready():
                p.ready_now = p.ever_ready = True
                if p.state != "crash-loop":
                    self._set(p, "ready")
                    self.say("up", f"{p.name} ready")
                return
            await asyncio.sleep(0.25)
        raise ProcessFailed(f"{p.name} not ready after {p.ready_timeout_s:.0f}s")

    async def _launch(self, p: Proc) -> None:
        """Spawn `p` and wait until it is ready; after a bind failure, again on new ports."""
        for attempt in range(1, self.bind_attempts + 1):
            await self._spawn(p)
            try:
                await self._await_ready(p)
                return
            except ProcessFailed:
                if not await self._port_was_taken(p):
                    raise
                if p.rebind is None:
                    raise ProcessFailed(f"{p.name} could not listen on port {p.port}: it is taken") from None
                if attempt == self.bind_attempts:
                    raise ProcessFailed(f"{p.name} found its port taken {attempt} times in a row") from None
                self._rebind(p)

    # -- the life of a process -------------------------------------------------------------
    async def start(self, p: Proc) -> bool:
        """Launch `p`, wait until it is ready, and keep it running from then on.

        Returns whether it became ready. A serving-path process that cannot raises
        ProcessFailed; any other is reported and left to the restart loop.
        """
        return (await self.start_together([p]))[0]

    async def start_together(self, procs: Sequence[Proc]) -> list[bool]:
        """`start` each of `procs` at once (none of them may need another's readiness), and
        return once all are ready or given to the restart loop. When a serving-path one
        fails, the others' starts are abandoned (their processes stay in `procs`, for
        `stop`) and its ProcessFailed is raised."""
        group = list(procs)
        self._groups.append(group)
        tasks = [asyncio.create_task(self._start(p), name=f"start-{p.name}") for p in group]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _start(self, p: Proc) -> bool:
        p.color = COLORS[len(self.procs) % len(COLORS)]
        self._width = max(self._width, len(p.name))
        self.procs.append(p)
        ok = True
        try:
            await self._launch(p)
        except ProcessFailed as exc:
            self._set(p, p.state, str(exc))
            if p.serving_path:
                raise
            self.say("up", f"{p.name} failed to start: {exc}. It is restarted with backoff; "
                           "the rest starts anyway", LOUD)
            ok = False
        self._watchers.append(asyncio.create_task(self._watch(p), name=f"watch-{p.name}"))
        return ok

    async def _watch(self, p: Proc) -> None:
        """Wait for `p` to exit, restart it after a backoff; forever, until `stop`."""
        while not self._stopping:
            if p.process is not None:
                returncode = await self._until_exit(p, p.process)
                p.last_exit = exit_status(returncode)
                reason = f"exited with {p.last_exit}"
            else:
                reason = p.error or "could not be launched"
            if not p.restart:
                self._set(p, "stopped", reason)
                self.say("up", f"{p.name} {reason}; not restarted")
                return
            p.failures += 1
            delay = p.backoff_s = self.backoff.delay(p.failures)
            self._report_exit(p, reason, delay)
            moved = p.rebind is not None and not p.ever_ready and await self._port_was_taken(p)
            await asyncio.sleep(delay)
            if moved:
                self._rebind(p)
            p.restarts += 1
            try:
                await self._spawn(p)
            except ProcessFailed as exc:
                self._set(p, p.state, str(exc))

    async def _until_exit(self, p: Proc, proc: asyncio.subprocess.Process) -> int:
        """Wait for `proc` to exit; meanwhile see it ready, and forgive its past failures
        once it stayed up `stable_s`."""
        exited = asyncio.ensure_future(exit_of(proc))
        try:
            while p.ready is not None and not p.ready_now and proc.returncode is None:
                try:
                    await self._await_ready(p)
                except ProcessFailed as exc:
                    if proc.returncode is None and p.error != str(exc):  # slow: say it once
                        self._set(p, p.state, str(exc))
                        self.say("up", f"{exc}; still waiting for it", LOUD)
            await asyncio.wait({exited}, timeout=max(0.0, p.spawned_at + self.stable_s - time.monotonic()))
            if not exited.done():
                self._stable(p)
            return await exited
        finally:
            exited.cancel()

    def _stable(self, p: Proc) -> None:
        p.failures, p.backoff_s = 0, None
        if p.ready is None:
            p.ever_ready = True
        if p.state == "crash-loop":
            self._set(p, self._alive_state(p))
            self.say("up", f"{p.name} recovered: up for {self.stable_s:.0f}s after {p.restarts} restart(s)")
        else:
            self._touch(p)

    def _report_exit(self, p: Proc, reason: str, delay: float) -> None:
        if p.failures < self.crash_loop_after:
            self._set(p, "restarting", reason)
            self.say("up", f"{p.name} {reason}; restarting in {delay:.1f}s")
            return
        looping = p.state == "crash-loop"
        self._set(p, "crash-loop", f"{reason}; {p.failures} exits in a row")
        if not looping:
            impact = "THE SERVING PATH IS AFFECTED" if p.serving_path else "the serving path is unaffected"
            self.say("up", f"CRASH LOOP: {p.name} {reason}, {p.failures} times in a row; restarting it "
                           f"with backoff up to {self.backoff.cap_s:g}s ({impact})", LOUD)

    async def _terminate(self, p: Proc, grace_s: float) -> None:
        """SIGTERM `p`, wait up to `grace_s` for it to exit, else SIGKILL its process group."""
        proc = p.process
        if proc is not None and proc.returncode is None:
            self.say("up", f"stopping {p.name}")
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(exit_of(proc), grace_s)
            except TimeoutError:
                self.say("up", f"{p.name} did not stop in {grace_s:.0f}s; killing it")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await exit_of(proc)
        if proc is not None and proc.returncode is not None:
            p.last_exit = exit_status(proc.returncode)

    async def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM everything in reverse start order, then SIGKILL what is left; every record
        ends `stopped` (written while Redis still answers)."""
        self._stopping = True
        # Cancelled, and waited for only so long: a task that missed its cancellation (see
        # `_publish_loop`) ends by itself once `_stopping` is seen or its process exits below.
        background = [*self._watchers, *([self._publisher] if self._publisher is not None else [])]
        for task in background:
            task.cancel()
        if background:
            await asyncio.wait(background, timeout=self.cancel_wait_s)
        publish = self._states is not None
        for group in reversed(self._groups):
            if publish and any(p.state_store for p in group):  # its last word before it goes; then none
                for p in group:
                    self._set(p, "stopped")
                await self._publish()
                publish = False
            await asyncio.gather(*(self._terminate(p, grace_s) for p in group))
            for p in group:
                self._set(p, "stopped")
            if publish:
                publish = await self._publish()
        if self._states is not None:
            await self._states.aclose()
