"""The process supervisor behind `nextstate up`: ready waits, prefixed logs, restarts, stop."""

from __future__ import annotations

import asyncio
import io
import sys
from pathlib import Path

import pytest

from services.ctl.supervisor import Proc, ProcessFailed, Supervisor
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

SLEEPER = "import sys, time; print('hello from', sys.argv[1], flush=True); time.sleep(60)"


def crasher(counter: Path) -> str:
    # Exits 3 on its first two runs, then stays up.
    return (
        "import pathlib, sys, time\n"
        f"p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) if p.exists() else 0\n"
        "p.write_text(str(n + 1)); print('run', n + 1, flush=True)\n"
        "sys.exit(3) if n < 2 else time.sleep(60)\n"
    )


async def test_start_in_order_prefix_logs_restart_crashed_and_stop(tmp_path: Path) -> None:
    out = io.StringIO()
    sup = Supervisor(out=out)

    async def a_ready() -> bool:
        return "hello from a" in out.getvalue()

    await sup.start(Proc("a", [sys.executable, "-c", SLEEPER, "a"], ready=a_ready))
    counter = tmp_path / "runs"
    await sup.start(Proc("crashy", [sys.executable, "-c", crasher(counter)]))
    await eventually(lambda: counter.exists() and counter.read_text() == "3", 20, "two restarts")
    await eventually(lambda: "run 3" in out.getvalue(), 5)
    crashy = sup.procs[1]
    assert crashy.restarts == 2 and crashy.process is not None and crashy.process.returncode is None
    assert not sup.failed.is_set()
    lines = out.getvalue().splitlines()
    assert any(line.startswith("a") and "| hello from a" in line for line in lines)
    assert any("crashy exited with 3; restarting" in line for line in lines)

    await sup.stop(grace_s=5)
    assert all(p.process is not None and p.process.returncode is not None for p in sup.procs)
    stopping = [line for line in out.getvalue().splitlines() if "stopping" in line]
    assert [s.split()[-1] for s in stopping] == ["crashy", "a"]  # reverse start order


async def test_gives_up_on_a_crash_loop_and_reports_it() -> None:
    out = io.StringIO()
    sup = Supervisor(out=out, max_restarts=1)
    await sup.start(Proc("doomed", [sys.executable, "-c", "import sys; sys.exit(7)"]))
    await asyncio.wait_for(sup.failed.wait(), 20)
    assert "doomed exited with 7; giving up after 1 restart(s)" in out.getvalue()
    await sup.stop()


async def test_exit_before_ready_is_an_error() -> None:
    sup = Supervisor(out=io.StringIO())

    async def never() -> bool:
        return False

    with pytest.raises(ProcessFailed, match="exited with 2 before it was ready"):
        await sup.start(Proc("bad", [sys.executable, "-c", "import sys; sys.exit(2)"], ready=never))
    await sup.stop()
