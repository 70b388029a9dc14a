"""What the sandbox adds to a tool call: a confined command against a bare subprocess.

For `true` and `python3 -c "print(1)"`, --repeat times each, wall-clock p50 and p90 and
the CPU time per call of every process involved (the worker and its reaped descendants:
robust to other load on the machine) of:

- bare:           subprocess.run(argv, capture_output=True) with the sandbox's PATH and cwd
- layers:         subprocess.run with confine.preexec of one more protection each
                  (rlimits + no_new_privs, + uid, + network namespace, + mount
                  namespace with the read-only shared dirs, + pid namespace and its init)
- Sandbox.run:    everything this machine allows, with the pipe reading and limits
- Sandbox.arun:   the same from the event loop (an asyncio.run each)

Target: Sandbox.run adds <= 20 ms p50 over bare for a `python3 -c "print(1)"` call.

Usage: python bench/sandbox.py [--repeat 40]   (as root, for every layer)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.envs import confine
from services.envs.sandbox import PATH, Sandbox, SandboxConfig, SandboxLimits, rlimits_for

COMMANDS = {"true": ["true"], "python3 -c print(1)": ["python3", "-c", "print(1)"]}


def cpu_s() -> float:
    """CPU seconds of this process and its reaped descendants."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, float, float]:
    """p50 and p90 wall ms of a call, and its mean CPU ms (all processes: robust to load)."""
    fn()  # warm
    ms = []
    cpu = cpu_s()
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t) * 1000)
    cpu_ms = (cpu_s() - cpu) * 1000 / repeat
    return statistics.median(ms), statistics.quantiles(ms, n=10)[8], cpu_ms


def confined(argv: list[str], plan: confine.Plan, cwd: str, env: dict[str, str]) -> None:
    subprocess.run(argv, capture_output=True, check=True, cwd=cwd, env=env, preexec_fn=confine.preexec(plan))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=40)
    args = ap.parse_args()
    caps = confine.probe()
    print("protections:", {k: v for k, v in caps.as_dict().items() if v}, "missing:", caps.missing)
    root = Path(tempfile.mkdtemp(prefix="nextstate-bench-"))
    os.chmod(root, 0o711)
    try:
        with Sandbox(SandboxConfig(root=root / "sb", uid_lock_dir=root / "uids")) as sb:
            limits = SandboxLimits()
            rl = rlimits_for(limits, nproc=sb.uid != os.geteuid())
            uid = sb.uid if sb.uid != os.geteuid() else None
            ro = confine.shared_writable_dirs()
            w = str(sb.path)
            env = {"PATH": PATH}
            layers = {
                "+ rlimits": confine.Plan(w, rlimits=rl),
                "+ uid": confine.Plan(w, rlimits=rl, uid=uid),
                "+ net ns": confine.Plan(w, rlimits=rl, uid=uid, network=caps.network_isolated),
                "+ mount ns": confine.Plan(w, rlimits=rl, uid=uid, network=caps.network_isolated,
                                           mounts=caps.mounts_isolated, readonly_dirs=ro),
                "+ pid ns": confine.Plan(w, rlimits=rl, uid=uid, network=caps.network_isolated,
                                         mounts=caps.mounts_isolated, readonly_dirs=ro, pids=caps.pids_isolated),
            }
            for name, argv in COMMANDS.items():
                print(f"\n{name}  (ms: wall p50 / p90, cpu per call; + is over bare)")
                rows: dict[str, Callable[[], object]] = {
                    "bare subprocess.run": partial(subprocess.run, argv, capture_output=True, check=True,
                                                   cwd=w, env=env),
                }
                rows.update({layer: partial(confined, argv, plan, w, env) for layer, plan in layers.items()})
                rows["Sandbox.run"] = partial(sb.run, argv)
                rows["Sandbox.arun"] = partial(lambda a: asyncio.run(sb.arun(a)), argv)
                base = base_cpu = 0.0
                for row, fn in rows.items():
                    p50, p90, cpu = timed(fn, args.repeat)
                    if not base:
                        base, base_cpu = p50, cpu
                    print(f"  {row:<20} {p50:6.1f} / {p90:5.1f}  +{p50 - base:5.1f}   "
                          f"cpu {cpu:5.1f}  +{cpu - base_cpu:5.1f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
