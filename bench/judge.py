"""Judge throughput: turns scored per second with 1 and 4 judge processes, m = 3 votes each.

Real redis-server on a free port, the stand-in judge (tests/support/judge_standin.py,
raw asyncio + httptools) as its own process answering every call after --latency
(100 ms), the real `python -m services.judge` processes. The turns are published
first, then the workers are started and the clock runs from their start until the
last ScoredTurn is in `scored`; each process's CPU seconds are read from /proc, so the
output says where the machine's cores went. `--profile` also runs one worker under
cProfile and prints the top functions.

Usage: python bench/judge.py [--turns 3000] [--latency 0.1] [--concurrency 200] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx
import redis

from shared.keys import Keys
from shared.schemas import Turn
from tests.support.servers import RedisServer, free_port, wait_until

CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (and its reaped children) from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / CLK


def make_turns(n: int, session: str) -> list[str]:
    body = "Here is the plan: read the config, fix the parser, run the tests again. " * 6
    return [
        Turn(
            session_id=f"{session}-{i % 50}", turn_index=i,
            messages=[{"role": "system", "content": "You are a coding agent."},
                      {"role": "user", "content": f"Fix the failing test number {i}, please. " * 4}],
            response={"role": "assistant", "content": body},
            prompt_ids=list(range(200)), response_ids=list(range(120)),
            response_logprobs=[-0.5] * 120,
            next_state=[{"role": "user", "content": f"Thanks, that works. Now look at issue {i}."}],
        ).to_json()
        for i in range(n)
    ]  # fmt: skip


def healthy(url: str) -> Callable[[], bool]:
    return lambda: httpx.get(url, timeout=1).status_code == 200


def start_standin(port: int, latency: float) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.judge_standin", "--port", str(port), "--latency", str(latency)],
        cwd=REPO,
    )  # fmt: skip
    try:
        wait_until(healthy(f"http://127.0.0.1:{port}/health"), 30, "stand-in")
    except Exception:
        proc.kill()
        proc.wait(5)
        raise
    return proc


def start_worker(env: dict[str, str], name: str, profile: Path | None) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    full = {**os.environ, **env, "NEXTSTATE_JUDGE__PORT": str(port), "NEXTSTATE_JUDGE__CONSUMER_NAME": name}
    cmd = [sys.executable, *(["-m", "cProfile", "-o", str(profile)] if profile else []), "-m", "services.judge"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=full, stderr=subprocess.DEVNULL)
    return proc, port


def run(args: argparse.Namespace, redis_url: str, standin_url: str, workers: int,
        profile: Path | None = None) -> dict[str, float]:  # fmt: skip
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    keys = Keys(prefix)
    env = {
        "NEXTSTATE_ENV": "test", "NEXTSTATE_REDIS__URL": redis_url, "NEXTSTATE_REDIS__PREFIX": prefix,
        "NEXTSTATE_JUDGE__URL": standin_url, "NEXTSTATE_JUDGE__VOTES": "3",
        "NEXTSTATE_JUDGE__CONCURRENCY": str(args.concurrency), "NEXTSTATE_JUDGE__TIMEOUT_S": "30",
        "NEXTSTATE_LOG__LEVEL": "WARNING", "NEXTSTATE_STREAMS__READ_COUNT": "256",
    }  # fmt: skip
    r = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=30)
    turns = make_turns(args.turns, prefix)
    pipe = r.pipeline(transaction=False)
    for data in turns:
        pipe.xadd(keys.turns, {"data": data})
    pipe.execute()
    procs = [start_worker(env, f"w{i}", profile) for i in range(workers)]
    try:
        for _, port in procs:
            wait_until(healthy(f"http://127.0.0.1:{port}/healthz"), 60, "judge worker")
        # Imports done, ready: from here on the workers only judge.
        cpu0 = [cpu_seconds(p.pid) for p, _ in procs]
        t0 = time.perf_counter()
        wait_until(lambda: r.xlen(keys.scored) >= args.turns, 600, "every turn scored", interval=0.02)
        elapsed = time.perf_counter() - t0
        cpu = [cpu_seconds(p.pid) - c for (p, _), c in zip(procs, cpu0, strict=True)]
    finally:
        for p, _ in procs:
            p.send_signal(signal.SIGTERM)
        for p, _ in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
    with contextlib.suppress(Exception):
        r.delete(keys.turns, keys.scored)
    r.close()
    return {"elapsed": elapsed, "rate": args.turns / elapsed, "judge_cpu": sum(cpu)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=3000)
    p.add_argument("--latency", type=float, default=0.1)
    p.add_argument("--concurrency", type=int, default=200, help="turns in flight per worker (x3 calls)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    p.add_argument("--profile", action="store_true", help="also profile one worker with cProfile")
    args = p.parse_args()

    server = RedisServer().start()
    standin: subprocess.Popen[bytes] | None = None
    try:
        sport = free_port()
        standin = start_standin(sport, args.latency)
        bench(args, server, standin, f"http://127.0.0.1:{sport}")
    finally:
        if standin is not None:
            standin.send_signal(signal.SIGTERM)
            standin.wait(10)
        server.close()


def bench(args: argparse.Namespace, server: RedisServer, standin: subprocess.Popen[bytes], standin_url: str) -> None:
    print(f"judge bench: {args.turns} turns, m=3, stand-in latency {args.latency * 1000:.0f} ms, "
          f"{args.concurrency} turns ({args.concurrency * 3} calls) in flight per worker, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    redis_pid = server.proc.pid if server.proc else 0
    results = {}
    for n in args.workers:
        cpu_s0, cpu_r0 = cpu_seconds(standin.pid), cpu_seconds(redis_pid)
        res = run(args, server.url, standin_url, n)
        cpu_s = cpu_seconds(standin.pid) - cpu_s0
        cpu_r = cpu_seconds(redis_pid) - cpu_r0
        results[n] = res
        per_k = 1000 / args.turns
        print(f"  {n} worker(s): {res['rate']:7.1f} turns/s ({res['rate'] * 3:6.0f} calls/s) in {res['elapsed']:.2f}s; "
              f"CPU s per 1000 turns: judges {res['judge_cpu'] * per_k:.2f}, stand-in {cpu_s * per_k:.2f}, "
              f"redis {cpu_r * per_k:.2f}")  # fmt: skip
    if 1 in results and 4 in results:
        print(f"  scaling 4 vs 1: {results[4]['rate'] / results[1]['rate']:.2f}x (target >= 3.5x; "
              f"per-process target >= 200 turns/s)")  # fmt: skip
    if args.profile:
        out = Path(tempfile.mkdtemp(prefix="judge-prof-")) / "judge.prof"
        res = run(args, server.url, standin_url, 1, profile=out)
        print(f"  profiled worker: {res['rate']:.1f} turns/s (cProfile overhead included); top by own time:")
        buf = io.StringIO()
        pstats.Stats(str(out), stream=buf).sort_stats("tottime").print_stats(25)
        print("\n".join("    " + line for line in buf.getvalue().splitlines() if line.strip()))

if __name__ == "__main__":
    main()
