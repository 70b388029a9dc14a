"""Run a set of processes as one: dependency order, readiness waits, prefixed logs, restarts.

`nextstate up` describes each service as a `Proc` (argv, environment, how to tell it is
ready); `Supervisor.start` launches them one by one, each only once the previous answers
ready; a process that exits on its own is restarted with backoff (and reported if it
keeps crashing); `stop` sends SIGTERM in reverse order, waits, then SIGKILLs stragglers.
Every line a child prints is echoed with its name as a coloured prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TextIO

import httpx

Ready = Callable[[], Awaitable[bool]]

COLORS = ["36", "32", "33", "35", "34", "91", "92", "93", "94", "95", "96"]


def http_ready(url: str) -> Ready:
    async def check() -> bool:
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                return (await client.get(url)).status_code == 200
        except httpx.HTTPError:
            return False

    return check


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready: Ready | None = None
    ready_timeout_s: float = 180.0
    restart: bool = True
    cwd: str | None = None
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    color: str = "37"


class ProcessFailed(RuntimeError):
    pass


class Supervisor:
    def __init__(self, *, out: TextIO | None = None, max_restarts: int = 5, window_s: float = 300.0) -> None:
        self.procs: list[Proc] = []
        self.out = out or sys.stdout
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._stopping = False
        self._watchers: list[asyncio.Task[None]] = []
        self._pipes: set[asyncio.Task[None]] = set()
        self._width = 10
        self.failed = asyncio.Event()

    def say(self, name: str, line: str, color: str = "1") -> None:
        tty = getattr(self.out, "isatty", lambda: False)()
        prefix = f"{name:<{self._width}}|"
        if tty:
            prefix = f"\x1b[{color}m{prefix}\x1b[0m"
        print(f"{prefix} {line}", file=self.out, flush=True)

    async def _spawn(self, p: Proc) -> None:
        env = dict(os.environ)
        env.update(p.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        p.process = await asyncio.create_subprocess_exec(
            *p.argv, env=env, cwd=p.cwd, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )
        task = asyncio.create_task(self._pipe(p, p.process))
        self._pipes.add(task)
        task.add_done_callback(self._pipes.discard)

    async def _pipe(self, p: Proc, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        async for raw in process.stdout:
            self.say(p.name, raw.decode(errors="replace").rstrip(), p.color)

    async def start(self, p: Proc) -> None:
        """Launch `p` and wait until it is ready (or raise ProcessFailed)."""
        p.color = COLORS[len(self.procs) % len(COLORS)]
        self._width = max(self._width, len(p.name))
        self.procs.append(p)
        await self._spawn(p)
        await self._await_ready(p)
        self._watchers.append(asyncio.create_task(self._watch(p)))

    async def _await_ready(self, p: Proc) -> None:
        if p.ready is None:
            return
        deadline = time.monotonic() + p.ready_timeout_s
        while time.monotonic() < deadline:
            assert p.process is not None
            if p.process.returncode is not None:
                raise ProcessFailed(f"{p.name} exited with {p.process.returncode} before it was ready")
            if await p.ready():
                self.say("up", f"{p.name} ready")
                return
            await asyncio.sleep(0.25)
        raise ProcessFailed(f"{p.name} not ready after {p.ready_timeout_s:.0f}s")

    async def _watch(self, p: Proc) -> None:
        history: list[float] = []
        while not self._stopping:
            assert p.process is not None
            rc = await p.process.wait()
            if self._stopping:
                return
            now = time.monotonic()
            history = [t for t in history if now - t < self.window_s] + [now]
            if not p.restart or len(history) > self.max_restarts:
                self.say("up", f"{p.name} exited with {rc}; giving up after {len(history) - 1} restart(s)")
                self.failed.set()
                return
            delay = min(2 ** (len(history) - 1), 30)
            self.say("up", f"{p.name} exited with {rc}; restarting in {delay}s")
            await asyncio.sleep(delay)
            if self._stopping:
                return
            p.restarts += 1
            await self._spawn(p)
            with contextlib.suppress(ProcessFailed):
                await self._await_ready(p)

    async def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM everything in reverse start order, then SIGKILL what is left."""
        self._stopping = True
        for w in self._watchers:
            w.cancel()
        for p in reversed(self.procs):
            proc = p.process
            if proc is None or proc.returncode is not None:
                continue
            self.say("up", f"stopping {p.name}")
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except asyncio.TimeoutError:
                self.say("up", f"{p.name} did not stop in {grace_s:.0f}s; killing it")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
