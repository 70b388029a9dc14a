"""Environment episodes per second with 1 and 4 envs worker processes, and the sandbox's cost.

Real Redis, real workers (`python -m services.envs`, as `nextstate up --envs P` starts
them), a stand-in policy of fixed latency (tests/support/standin_policy.py: a real HTTP
server, `--latency` per call). Each episode of `bench.envs:SandboxEchoEnv`: the model
calls `echo` once (run in the episode's sandbox: a confined `echo` child process), then
answers; the worker closes the session with one more request: 3 policy calls per episode.

For each worker count W: W warm-up episodes, then `--per-worker` x W episodes enqueued
at once; episodes/s = episodes / (first enqueue -> last outcome). Prints the ratio 4/1
and the cores this process may use (os.sched_getaffinity): the ideal is W x, as long as
the policy's latency (not the workers' CPU) is what an episode waits on.

Then the sandbox's added latency per tool call: bench/sandbox.py (its p50 of a confined
call over a bare subprocess), run as is.

Usage: python bench/envs.py [--latency 0.2] [--per-worker 6] [--workers 1 4] [--no-sandbox-bench]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis

from services.envs.base import Environment, Message, Split, Task, Verdict, function_tool, pick
from services.envs.sandbox import Sandbox
from shared.envjobs import enqueue_run
from shared.keys import Keys
from shared.rqjobs import rq_connection
from tests.support.servers import RedisServer, ServiceProcess, free_port
from tests.support.standin_policy import StandinPolicy

TASKS = [Task(id=f"echo-{w}", env="sandbox-echo", prompt=f"Echo the word '{w}'.", data={"word": w})
         for w in ("ping", "pong", "kite", "lark")]


class SandboxEchoEnv(Environment):
    """Echo a word; the tool runs `echo` in the episode's sandbox (one confined child)."""

    name = "sandbox-echo"

    def __init__(self) -> None:
        self.word, self.heard, self.sandbox = "", [""], None

    @classmethod
    def tasks(cls, split: Split, n: int | None = None, seed: int = 0) -> list[Task]:
        return pick(TASKS, n, seed) if split == "train" else []

    def tools(self) -> list[Message]:
        return [function_tool("echo", "Say a word back.", {"text": ("string", "the word")})]

    async def reset(self, task: Task, sandbox: Sandbox) -> list[Message]:
        self.word, self.heard, self.sandbox = task.data["word"], [], sandbox
        return [{"role": "user", "content": task.prompt}]

    async def tool_echo(self, text: str) -> str:
        assert self.sandbox is not None
        out = (await self.sandbox.arun(["echo", text])).observation().strip()
        self.heard.append(out)
        return out

    async def verify(self, messages: Sequence[Message] | None = None) -> Verdict:
        return Verdict.of(any(self.word in h for h in self.heard))


def measure(url: str, policy: StandinPolicy, workers: int, per_worker: int) -> tuple[int, float, float]:
    """(episodes, seconds, passed share) for `workers` worker processes on a fresh prefix."""
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    keys = Keys(prefix)
    env = {"NEXTSTATE_ENV": "test", "NEXTSTATE_RUN": "bench", "NEXTSTATE_REDIS__URL": url,
           "NEXTSTATE_REDIS__PREFIX": prefix, "NEXTSTATE_ENVS__URL": policy.url, "NEXTSTATE_LOG__LEVEL": "WARNING",
           "PYTHONPATH": str(ROOT)}
    procs = []
    for _ in range(workers):
        port = free_port()
        procs.append(ServiceProcess("envs", {**env, "NEXTSTATE_ENVS__PORT": str(port)}).start())
        procs[-1].wait_http(f"http://127.0.0.1:{port}/readyz", timeout=120)
    conn = rq_connection(url)
    text = redis.Redis.from_url(url, decode_responses=True)
    spec = "bench.envs:SandboxEchoEnv"
    try:
        def run(n: int) -> float:
            before = text.xlen(keys.outcomes)
            t0 = time.perf_counter()
            enqueue_run(conn, keys, "bench", spec, n, 1, timeout_s=120, retries=0)
            while text.xlen(keys.outcomes) < before + n:
                time.sleep(0.005)
            return time.perf_counter() - t0

        run(workers)  # warm-up: each worker's imports, clients, first sandbox
        n = per_worker * workers
        seconds = run(n)
        passed = sum('"passed":true' in f["data"] for _, f in text.xrange(keys.outcomes)) / text.xlen(keys.outcomes)
        return n, seconds, passed
    finally:
        for p in procs:
            p.stop()
        conn.close()
        text.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--latency", type=float, default=0.2, help="the stand-in policy's seconds per call")
    p.add_argument("--per-worker", type=int, default=6, help="episodes per worker in the timed run")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    p.add_argument("--no-sandbox-bench", action="store_true", help="skip bench/sandbox.py")
    a = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"cores available: {cores} (os.sched_getaffinity); stand-in policy {a.latency * 1000:.0f} ms per call, "
          "3 calls per episode (tool call, answer, closing request), 1 sandboxed tool call")
    server = RedisServer().start()
    rates: dict[int, float] = {}
    try:
        with StandinPolicy(latency_s=a.latency, tool_turns=1) as policy:
            for w in a.workers:
                n, seconds, passed = measure(server.url, policy, w, a.per_worker)
                rates[w] = n / seconds
                print(f"{w} worker(s): {n} episodes in {seconds:.2f}s = {rates[w]:.2f} episodes/s "
                      f"({seconds / n * w * 1000:.0f} ms per episode per worker; passed {passed:.0%})")
    finally:
        server.close()
    if 1 in rates and 4 in rates:
        print(f"ratio 4/1: {rates[4] / rates[1]:.2f}x (target >= 3.2x where 4 cores are free; {cores} here)")
    if not a.no_sandbox_bench:
        print("\nsandbox, added latency per tool call (bench/sandbox.py):", flush=True)
        subprocess.run([sys.executable, str(ROOT / "bench" / "sandbox.py"), "--repeat", "30"], check=False)


if __name__ == "__main__":
    main()
