"""Judge throughput: turns scored per second with 1 and 4 judge processes, m = 3 votes each.

Real redis-server on a free port, the stand-in judge (tests/support/judge_standin.py,
raw asyncio + httptools) as its own process answering every call after --latency
(100 ms), the real `python -m services.judge` processes. The workers are started
and ready first; the clock runs from the first publish of the turns until the last
ScoredTurn is in `scored` ("steady" counts from 10 % to 90 % scored, without warm-up); each process's CPU seconds are read from /proc, so the
output says where the machine's cores went. `--profile` also runs one worker under
cProfile and prints the top functions.

Usage: python bench/judge.py [--turns 3000] [--latency 0.1] [--concurrency 200] [--profile]
       python bench/judge.py --collapse-window 3   # the reward-collapse window's CPU, off vs on
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pstats
import signal
import statistics
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


def scrape(url: str, name: str) -> float:
    """Sum of a Prometheus counter's samples (all labels) on a /metrics page."""
    text = httpx.get(url, timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))  # fmt: skip


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
        profile: Path | None = None, extra: dict[str, str] | None = None) -> dict[str, float]:  # fmt: skip
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    keys = Keys(prefix)
    env = {
        "NEXTSTATE_ENV": "test", "NEXTSTATE_REDIS__URL": redis_url, "NEXTSTATE_REDIS__PREFIX": prefix,
        "NEXTSTATE_JUDGE__URL": standin_url, "NEXTSTATE_JUDGE__VOTES": "3",
        "NEXTSTATE_JUDGE__CONCURRENCY": str(args.concurrency), "NEXTSTATE_JUDGE__TIMEOUT_S": "30",
        "NEXTSTATE_LOG__LEVEL": "WARNING", "NEXTSTATE_STREAMS__READ_COUNT": "256", **(extra or {}),
    }  # fmt: skip
    r = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=30)
    turns = make_turns(args.turns, prefix)
    procs = [start_worker(env, f"w{i}", profile) for i in range(workers)]
    try:
        for _, port in procs:
            wait_until(healthy(f"http://127.0.0.1:{port}/healthz"), 60, "judge worker")
        # Every worker is up and blocked on the empty stream: the clock starts with the publish.
        cpu0 = [cpu_seconds(p.pid) for p, _ in procs]
        t0 = time.perf_counter()
        for i in range(0, len(turns), 500):
            pipe = r.pipeline(transaction=False)
            for data in turns[i : i + 500]:
                pipe.xadd(keys.turns, {"data": data})
            pipe.execute()
        marks: dict[float, float] = {}  # fraction scored -> seconds since t0
        deadline = t0 + 600
        while (done := int(r.xlen(keys.scored))) < args.turns:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"only {done} of {args.turns} turns scored in 600 s")
            for frac in (0.1, 0.9):
                if done >= frac * args.turns and frac not in marks:
                    marks[frac] = time.perf_counter() - t0
            time.sleep(0.02)
        elapsed = time.perf_counter() - t0
        cpu = [cpu_seconds(p.pid) - c for (p, _), c in zip(procs, cpu0, strict=True)]
        steady = 0.8 * args.turns / max(marks.get(0.9, elapsed) - marks.get(0.1, 0.0), 1e-9)
        retries = sum(scrape(f"http://127.0.0.1:{port}/metrics", "nextstate_judge_call_retries_total")
                      for _, port in procs)  # fmt: skip
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
        r.delete(keys.turns, keys.scored, keys.reward_window, keys.reward_window_turns, keys.reward_alarm)
    r.close()
    return {"elapsed": elapsed, "rate": args.turns / elapsed, "steady": steady, "judge_cpu": sum(cpu),
            "t10": marks.get(0.1, 0.0), "t90": marks.get(0.9, elapsed), "retries": retries}


PACKAGES = {
    "http client (httpx, httpcore, h11, anyio, sniffio)": ("/httpx/", "/httpcore/", "/h11/", "/anyio/", "/sniffio/"),
    "redis-py": ("/redis/",),
    "pydantic": ("/pydantic",),
    "asyncio": ("/asyncio/",),
    "services/judge": ("/services/judge/",),
    "shared": ("/shared/",),
    "prometheus": ("/prometheus_client/",),
}


def by_package(stats: pstats.Stats) -> list[tuple[str, float]]:
    """Share of own (exclusive) time per package; builtins count as "builtins / C"."""
    totals: dict[str, float] = {}
    entries = stats.stats  # type: ignore[attr-defined]
    for (filename, _, _), (_, _, own, _, _) in entries.items():
        group = next((g for g, marks in PACKAGES.items() if any(m in filename for m in marks)),
                     "builtins / C" if filename == "~" else "other")  # fmt: skip
        totals[group] = totals.get(group, 0.0) + own
    whole = sum(totals.values()) or 1.0
    return sorted(((g, 100 * t / whole) for g, t in totals.items()), key=lambda kv: -kv[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=3000)
    p.add_argument("--latency", type=float, default=0.1)
    p.add_argument("--concurrency", type=int, default=200, help="turns in flight per worker (x3 calls)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    p.add_argument("--profile", action="store_true", help="also profile one worker with cProfile")
    p.add_argument("--collapse-window", type=int, default=0, metavar="ROUNDS",
                   help="instead: 1 worker with the reward-collapse window off and on, ROUNDS rounds "
                        "interleaved; judge and Redis CPU per turn, on as a ratio of off")
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


def window_cost(args: argparse.Namespace, server: RedisServer, standin_url: str) -> None:
    """The reward-collapse window's price: one script per published turn (services/judge/collapse.py)."""
    redis_pid = server.proc.pid if server.proc else 0
    per: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    for i in range(args.collapse_window):
        for arm in (("off", "on") if i % 2 == 0 else ("on", "off")):
            r0 = cpu_seconds(redis_pid)
            res = run(args, server.url, standin_url, 1,
                      extra={"NEXTSTATE_JUDGE__COLLAPSE_WINDOW": "0"} if arm == "off" else None)
            per[arm].append((1000 * res["judge_cpu"] / args.turns, 1000 * (cpu_seconds(redis_pid) - r0) / args.turns))
    med = {arm: (statistics.median(j for j, _ in v), statistics.median(r for _, r in v)) for arm, v in per.items()}
    print(f"  collapse window, 1 worker, {args.collapse_window} rounds (median CPU ms per turn): off: judge "
          f"{med['off'][0]:.2f}, redis {med['off'][1]:.2f}; on: judge {med['on'][0]:.2f}, redis "
          f"{med['on'][1]:.2f}; judge on/off {med['on'][0] / med['off'][0]:.3f}x, judge+redis "
          f"{sum(med['on']) / sum(med['off']):.3f}x; load avg {os.getloadavg()[0]:.1f}")
    print(f"  python bench/judge.py --collapse-window {args.collapse_window} --turns {args.turns} "
          f"--latency {args.latency} --concurrency {args.concurrency}")


def bench(args: argparse.Namespace, server: RedisServer, standin: subprocess.Popen[bytes], standin_url: str) -> None:
    if args.collapse_window:
        window_cost(args, server, standin_url)
        return
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
        cpu_ms = res["judge_cpu"] * per_k
        print(f"  {n} worker(s): {res['rate']:6.1f} turns/s overall, {res['steady']:6.1f} steady (10-90 %), "
              f"{res['steady'] * 3:5.0f} calls/s; {res['elapsed']:.1f} s; CPU ms per turn: judge {cpu_ms:.2f} "
              f"(= {1000 / cpu_ms:.0f} turns/s per busy core), stand-in {cpu_s * per_k:.2f}, "
              f"redis {cpu_r * per_k:.2f}; 10 % at {res['t10']:.1f} s, 90 % at {res['t90']:.1f} s; "
              f"{res['retries']:.0f} call retries; load avg {os.getloadavg()[0]:.1f}")  # fmt: skip
    if 1 in results and 4 in results:
        print(f"  scaling 4 vs 1: {results[4]['steady'] / results[1]['steady']:.2f}x steady (target >= 3.5x; "
              f"per-process target >= 200 turns/s)")  # fmt: skip
    if args.profile:
        out = Path(tempfile.mkdtemp(prefix="judge-prof-")) / "judge.prof"
        res = run(args, server.url, standin_url, 1, profile=out)
        print(f"  profiled worker: {res['steady']:.1f} turns/s (cProfile overhead included); top by own time:")
        stats = pstats.Stats(str(out), stream=io.StringIO())
        print("    own CPU time by package: " + ", ".join(f"{k} {v:.0f} %" for k, v in by_package(stats)))
        buf = io.StringIO()
        stats.stream = buf  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(12)
        print("\n".join("    " + line for line in buf.getvalue().splitlines()[-14:] if line.strip()))

if __name__ == "__main__":
    main()
