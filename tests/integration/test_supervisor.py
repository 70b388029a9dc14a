"""The process supervisor behind `nextstate up`: ready waits, prefixed logs, restarts, stop.

Degrade, never fall: a crash-looping training-side process is restarted forever with a
growing delay and never stops the supervisor nor the serving path; a serving-path
process that cannot start is an error; a port taken before the process could listen
moves it to a new one. The state records land in a real Redis.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from services.ctl.infra import free_port
from services.ctl.supervisor import Backoff, Proc, ProcessFailed, Ready, Supervisor
from shared.keys import Keys
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

SLEEPER = "import sys, time; print('hello from', sys.argv[1], flush=True); time.sleep(60)"
# Appends the time of each run to a file, then exits 7.
DOOMED = "import sys, time; open(sys.argv[1], 'a').write(f'{time.time()}\\n'); sys.exit(7)"
# Listens on the port it is given (fails like any server when the port is taken).
LISTENER = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen()\n"
    "print('listening on', sys.argv[1], flush=True); time.sleep(60)\n"
)
# A dependent: connects to the port it was given.
CLIENT = (
    "import socket, sys, time\n"
    "socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=5).close()\n"
    "print('connected to', sys.argv[1], flush=True); time.sleep(60)\n"
)
FAST = Backoff(base_s=0.1, cap_s=0.8, jitter=0.0)


def crasher(counter: Path) -> str:
    # Exits 3 on its first two runs, then stays up.
    return (
        "import pathlib, sys, time\n"
        f"p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) if p.exists() else 0\n"
        "p.write_text(str(n + 1)); print('run', n + 1, flush=True)\n"
        "sys.exit(3) if n < 2 else time.sleep(60)\n"
    )


def said(out: io.StringIO, text: str) -> Ready:
    async def check() -> bool:
        return text in out.getvalue()

    return check


def tcp_ready(port: int) -> Ready:
    async def check() -> bool:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return False
        writer.close()
        return True

    return check


def listener(port: int) -> Proc:
    return Proc("api", [sys.executable, "-c", LISTENER, str(port)], ready=tcp_ready(port),
                ready_timeout_s=20, serving_path=True, port=port)


async def test_start_in_order_prefix_logs_restart_crashed_and_stop(tmp_path: Path) -> None:
    out = io.StringIO()
    sup = Supervisor(out=out, backoff=Backoff(base_s=0.2))

    await sup.start(Proc("a", [sys.executable, "-c", SLEEPER, "a"], ready=said(out, "hello from a")))
    counter = tmp_path / "runs"
    await sup.start(Proc("crashy", [sys.executable, "-c", crasher(counter)]))
    await eventually(lambda: counter.exists() and counter.read_text() == "3", 20, "two restarts")
    await eventually(lambda: "run 3" in out.getvalue(), 5)
    a, crashy = sup.procs
    assert crashy.restarts == 2 and crashy.process is not None and crashy.process.returncode is None
    assert (a.state, crashy.state, crashy.last_exit) == ("ready", "running", 3)
    lines = out.getvalue().splitlines()
    assert any(line.startswith("a") and "| hello from a" in line for line in lines)
    assert any("crashy exited with 3; restarting" in line for line in lines)
    assert "CRASH LOOP" not in out.getvalue()  # two exits are not a loop

    await sup.stop(grace_s=5)
    assert all(p.process is not None and p.process.returncode is not None for p in sup.procs)
    assert {p.state for p in sup.procs} == {"stopped"}
    stopping = [line for line in out.getvalue().splitlines() if "stopping" in line]
    assert [s.split()[-1] for s in stopping] == ["crashy", "a"]  # reverse start order


def waiting_for(mine: Path, other: Path) -> str:
    """Says it started (writes `mine`), and is ready only once `other` exists."""
    return (
        "import pathlib, sys, time\n"
        f"pathlib.Path({str(mine)!r}).write_text('up')\n"
        f"while not pathlib.Path({str(other)!r}).exists(): time.sleep(0.05)\n"
        f"print('ready:', {mine.name!r}, flush=True); time.sleep(60)\n"
    )


async def test_a_group_starts_at_once_and_stops_before_what_it_depends_on(tmp_path: Path) -> None:
    """Each of b and c is ready only once the other was launched: one after the other, the
    first would never be ready; together both are. Stopping goes group by group in reverse."""
    out = io.StringIO()
    sup = Supervisor(out=out)
    await sup.start(Proc("a", [sys.executable, "-c", SLEEPER, "a"], ready=said(out, "hello from a")))
    b, c = tmp_path / "b", tmp_path / "c"
    try:
        ok = await sup.start_together([
            Proc("b", [sys.executable, "-c", waiting_for(b, c)], ready=said(out, "ready: b"), ready_timeout_s=20),
            Proc("c", [sys.executable, "-c", waiting_for(c, b)], ready=said(out, "ready: c"), ready_timeout_s=20),
        ])  # fmt: skip
        assert ok == [True, True] and [p.state for p in sup.procs] == ["ready", "ready", "ready"]
    finally:
        await sup.stop(grace_s=5)
    stopping = [line.split()[-1] for line in out.getvalue().splitlines() if "| stopping" in line]
    assert sorted(stopping[:2]) == ["b", "c"] and stopping[2:] == ["a"]
    assert {p.state for p in sup.procs} == {"stopped"}


async def test_a_serving_path_failure_in_a_group_abandons_the_rest(tmp_path: Path) -> None:
    """The engine of a group fails: start_together raises at once, without waiting for a slow
    member to be ready, and that member's process is still stopped with the rest."""
    out = io.StringIO()
    sup = Supervisor(out=out)
    never = tmp_path / "never"
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        with pytest.raises(ProcessFailed, match="engine exited with 2 before it was ready"):
            await sup.start_together([
                Proc("slow", [sys.executable, "-c", waiting_for(tmp_path / "slow", never)],
                     ready=said(out, "ready: slow"), ready_timeout_s=60),
                Proc("engine", [sys.executable, "-c", "import sys; sys.exit(2)"], ready=said(out, "never"),
                     serving_path=True),
            ])  # fmt: skip
        assert loop.time() - started < 30  # not the slow one's 60 s
        slow = sup.procs[0]
        assert slow.process is not None and slow.process.returncode is None
    finally:
        await sup.stop(grace_s=5)
    assert slow.process.returncode is not None and {p.state for p in sup.procs} == {"stopped"}


async def test_a_crash_loop_is_restarted_forever_and_never_stops_the_serving_path(
    tmp_path: Path, redis_url: str, unique: str
) -> None:
    out = io.StringIO()
    sup = Supervisor(out=out, backoff=FAST, crash_loop_after=3, stable_s=30, publish_every_s=0.2)
    key = Keys(f"t-{unique}").services
    sup.report_states(redis_url, key)
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)

    async def records() -> dict[str, dict[str, Any]]:
        return {str(k): json.loads(v) for k, v in (await client.hgetall(key)).items()}

    async def crash_loop_recorded() -> dict[str, dict[str, Any]] | None:
        got = await records()
        return got if {"engine", "trainer"} <= set(got) and got["trainer"]["state"] == "crash-loop" else None

    await sup.start(Proc("engine", [sys.executable, "-c", SLEEPER, "engine"],
                         ready=said(out, "hello from engine"), serving_path=True))
    engine = sup.procs[0]
    assert engine.process is not None
    engine_pid = engine.process.pid
    runs = tmp_path / "runs"
    assert await sup.start(Proc("trainer", [sys.executable, "-c", DOOMED, str(runs)]))
    trainer = sup.procs[1]

    await eventually(lambda: runs.exists() and len(runs.read_text().split()) >= 6, 30, "six runs")
    times = [float(t) for t in runs.read_text().split()]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Backoff 0.1, 0.2, 0.4, 0.8 (cap), 0.8 s, plus a Python start each time.
    assert gaps[3] > gaps[0] + 0.4 and gaps[2] > gaps[0], gaps
    assert trainer.state == "crash-loop" and trainer.restarts >= 5 and trainer.last_exit == 7
    assert trainer.backoff_s == pytest.approx(0.8)
    assert out.getvalue().count("CRASH LOOP: trainer") == 1  # said once, not at every restart
    assert "the serving path is unaffected" in out.getvalue()
    # The serving path never noticed.
    assert engine.state == "ready" and engine.pid == engine_pid and engine.restarts == 0

    got = await eventually(crash_loop_recorded, 10, "the crash loop recorded in Redis")
    assert got["trainer"]["serving_path"] is False
    assert got["trainer"]["last_exit"] == 7 and got["trainer"]["restarts"] >= 5
    assert "exits in a row" in str(got["trainer"]["error"])
    assert got["engine"]["state"] == "ready" and got["engine"]["pid"] == engine_pid
    assert got["engine"]["serving_path"] is True

    await sup.stop(grace_s=5)
    final = await records()
    assert {r["state"] for r in final.values()} == {"stopped"}
    assert all(r["pid"] is None for r in final.values())
    await client.aclose()


async def test_a_training_side_process_that_cannot_start_does_not_stop_the_start(tmp_path: Path) -> None:
    out = io.StringIO()
    sup = Supervisor(out=out, backoff=FAST)

    async def never() -> bool:
        return False

    runs = tmp_path / "runs"
    ok = await sup.start(Proc("judge-0", [sys.executable, "-c", DOOMED, str(runs)], ready=never))
    assert ok is False
    assert "judge-0 failed to start: judge-0 exited with 7 before it was ready" in out.getvalue()
    # The next one starts all the same, and the failed one is restarted meanwhile.
    assert await sup.start(Proc("buffer", [sys.executable, "-c", SLEEPER, "buffer"],
                                ready=said(out, "hello from buffer")))
    await eventually(lambda: len(runs.read_text().split()) >= 3, 20, "restarts of judge-0")
    assert sup.procs[0].restarts >= 2 and sup.procs[1].state == "ready"
    await sup.stop(grace_s=5)


async def test_a_serving_path_process_that_cannot_start_is_an_error() -> None:
    sup = Supervisor(out=io.StringIO())

    async def never() -> bool:
        return False

    with pytest.raises(ProcessFailed, match="exited with 2 before it was ready"):
        await sup.start(Proc("bad", [sys.executable, "-c", "import sys; sys.exit(2)"], ready=never,
                             serving_path=True))
    await sup.stop()


async def test_a_port_taken_before_listening_moves_the_process_and_its_dependents_follow() -> None:
    out = io.StringIO()
    sup = Supervisor(out=out, backoff=FAST)
    squatter = socket.socket()  # took the port between picking and binding it
    squatter.bind(("127.0.0.1", 0))
    taken = squatter.getsockname()[1]
    try:
        api = listener(taken)

        def rebind(p: Proc) -> None:
            moved = listener(free_port())
            p.argv, p.ready, p.port = moved.argv, moved.ready, moved.port

        api.rebind = rebind
        assert await sup.start(api)
        assert api.port != taken and api.state == "ready" and api.restarts == 0
        assert f"api could not listen on port {taken}" in out.getvalue()
        assert "Address already in use" in out.getvalue()

        # Started later, a dependent is built from the final port.
        port = api.port
        assert port is not None
        await sup.start(Proc("client", [sys.executable, "-c", CLIENT, str(port)],
                             ready=said(out, f"connected to {port}")))

        # Once it was ready, a restart keeps its port: dependents know it.
        first = api.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await eventually(lambda: api.state == "ready" and api.pid not in (None, first), 20, "api back")
        assert api.port == port and api.restarts == 1 and api.last_exit == "SIGKILL"
    finally:
        squatter.close()
        await sup.stop(grace_s=5)


async def test_a_fixed_port_that_is_taken_is_an_error() -> None:
    sup = Supervisor(out=io.StringIO())
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    taken = squatter.getsockname()[1]
    try:
        with pytest.raises(ProcessFailed, match=f"api could not listen on port {taken}: it is taken"):
            await sup.start(listener(taken))  # no rebind: the user asked for this port
    finally:
        squatter.close()
        await sup.stop()


async def test_redis_away_does_not_disturb_the_supervisor() -> None:
    out = io.StringIO()
    sup = Supervisor(out=out, publish_every_s=0.1)
    sup.report_states(f"redis://127.0.0.1:{free_port()}/0", "nothing-listens-here:services")
    await sup.start(Proc("a", [sys.executable, "-c", SLEEPER, "a"], ready=said(out, "hello from a")))
    await eventually(lambda: "service states: cannot write to Redis" in out.getvalue(), 10)
    assert sup.procs[0].state == "ready"
    await asyncio.wait_for(sup.stop(grace_s=5), 10)
    assert out.getvalue().count("cannot write to Redis") == 1  # said once


class MissesOneCancel(Supervisor):
    """Its state writes go on through one cancellation, as an `asyncio.wait_for` may before
    Python 3.12 when what it waits for completes as it is cancelled."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.writing = asyncio.Event()

    async def _publish(self) -> bool:
        ok = await super()._publish()
        self.writing.set()
        try:
            await asyncio.sleep(0.3)
        except asyncio.CancelledError:
            pass  # missed
        self.writing.clear()
        return ok


async def test_stop_ends_even_when_the_state_writer_misses_its_cancellation(
    redis_url: str, unique: str
) -> None:  # fmt: skip
    out = io.StringIO()
    sup = MissesOneCancel(out=out, publish_every_s=0.01)
    sup.report_states(redis_url, Keys(f"t-{unique}").services)
    await sup.start(Proc("a", [sys.executable, "-c", SLEEPER, "a"], ready=said(out, "hello from a")))
    await asyncio.wait_for(sup.writing.wait(), 10)  # stop cancels it mid-write
    await asyncio.wait_for(sup.stop(grace_s=5), 20)
    assert sup.procs[0].state == "stopped" and sup.procs[0].process is not None
    assert sup.procs[0].process.returncode is not None
    r = aioredis.Redis.from_url(redis_url)
    try:
        states = await r.hget(Keys(f"t-{unique}").services, "a")
    finally:
        await r.aclose()
    assert states is not None and json.loads(states)["state"] == "stopped"


async def test_a_process_killed_while_its_child_holds_the_pipe_is_restarted(tmp_path: Path) -> None:
    """vLLM's API server killed, its engine core still alive and holding the output pipe: the
    supervisor sees the exit all the same, kills what was left in the process group, and
    restarts it (waiting on the pipe, it saw nothing and restarted nothing)."""
    pids = tmp_path / "pids"
    parent = ("import os, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
              f"open({str(pids)!r}, 'a').write(f'{{os.getpid()}} {{child.pid}}\\n')\n"
              "print('up', flush=True); time.sleep(300)\n")  # fmt: skip
    out = io.StringIO()
    sup = Supervisor(out=out, backoff=FAST)
    await sup.start(Proc("engine", [sys.executable, "-c", parent], ready=said(out, "up")))
    try:
        first = await eventually(lambda: pids.exists() and pids.read_text().split(), 10, "the first run")
        os.kill(int(first[0]), signal.SIGKILL)  # the leader only: its child keeps the pipe open
        await eventually(lambda: len(pids.read_text().splitlines()) == 2, 30, "a restart")

        def gone(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"

        await eventually(lambda: gone(int(first[1])), 10, "the orphaned child killed")
        assert sup.procs[0].restarts == 1 and sup.procs[0].last_exit == "SIGKILL"
    finally:
        await sup.stop()
