"""CPU engine speed by torch thread count, on an idle machine and on a busy one.

The real `python -m services.engine` serves a random Llama (hidden 768, 8 layers by
default: big enough that the matmuls dominate) or `--model` any HF folder. For each
thread count — 1, the default (`shared/cpus.py`: half the CPUs, at least 1) and torch's
own default (one per core) — it measures tokens/s of one greedy request of `--tokens`
tokens, first with the machine idle, then with a CPU hog (one busy-looping process per
core, as the trainer and judges are under `nextstate up`). Everything is printed as a
ratio to the baseline of the same run: one thread on the idle machine.

    python bench/engine_threads.py [--tokens 64] [--repeat 3] [--model DIR]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from shared.cpus import available_cpus, default_threads
from tests.support.servers import ServiceProcess, free_port
from tests.support.tiny_model import build_tiny_model


def spin() -> None:
    while True:
        pass


def tokens_per_s(url: str, tokens: int, repeat: int) -> float:
    body = {"input_ids": list(range(5, 69)), "stream": False,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}}
    with httpx.Client(base_url=url, timeout=600) as c:
        c.post("/generate", json=body).raise_for_status()  # warm up
        rates = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            out = c.post("/generate", json=body).json()
            rates.append(len(out["output_ids"]) / (time.perf_counter() - t0))
    return statistics.median(rates)


def measure(model: Path, threads: int | None, tokens: int, repeat: int) -> float:
    port = free_port()
    env = {"NEXTSTATE_ENV": "test", **({"NEXTSTATE_ENGINE__THREADS": str(threads)} if threads else {})}
    if threads is None:  # torch's own default: one thread per core
        env["NEXTSTATE_ENGINE__THREADS"] = str(os.cpu_count() or 1)
    proc = ServiceProcess("engine", env, ["--model", str(model), "--port", str(port)]).start()
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=300)
        return tokens_per_s(f"http://127.0.0.1:{port}", tokens, repeat)
    finally:
        proc.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--model", type=Path)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    model = args.model or build_tiny_model(Path(tempfile.mkdtemp(prefix="ns-bench-threads-")) / "m",
                                           hidden=args.hidden, layers=args.layers)
    cores = os.cpu_count() or 1
    configs = {"1 thread": 1, f"default ({default_threads()})": default_threads(),
               f"torch default ({cores})": None}
    results: dict[tuple[str, str], float] = {}
    for load in ("idle", "busy"):
        hogs = [multiprocessing.Process(target=spin, daemon=True) for _ in range(cores if load == "busy" else 0)]
        for h in hogs:
            h.start()
        try:
            for name, threads in configs.items():
                results[(name, load)] = measure(model, threads, args.tokens, args.repeat)
        finally:
            for h in hogs:
                h.kill()
    base = results[("1 thread", "idle")]
    print(f"{cores} cores ({available_cpus()} available to this process); baseline: 1 thread, "
          f"idle machine = {base:.1f} tokens/s")
    print(f"{'threads':<22} {'idle':>16} {'busy (1 hog/core)':>22}")
    for name in configs:
        idle, busy = results[(name, "idle")], results[(name, "busy")]
        print(f"{name:<22} {idle:8.1f} ({idle / base:4.2f}x) {busy:12.1f} ({busy / base:4.2f}x)")


if __name__ == "__main__":
    main()
