"""How many CPUs this process may use, and how many torch threads a service should take.

Torch's default (one intra-op thread per core) is the wrong choice on a small machine
shared with other services: OpenMP workers spin at barriers, so when a neighbour takes
a core the whole forward pass waits for the slowest thread — measured here
(bench/engine_threads.py) as many times slower than a single thread. The services that
run models (engine, trainer) therefore default to half the CPUs they may use, at least
one, leaving the rest to the other services; `NEXTSTATE_<SERVICE>__THREADS` overrides.

The CPUs a process may use are the fewest of: its affinity mask (taskset, cpusets) and
its cgroup CPU quota (`cpu.max`, as docker `--cpus` and Kubernetes limits set it).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def _quota(path: Path = CGROUP_CPU_MAX) -> float | None:
    """CPUs granted by the cgroup v2 quota (`<quota> <period>`), None when unlimited."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(float(quota) / float(period), 0.0)
    except (ValueError, ZeroDivisionError):
        return None


def available_cpus(cgroup_cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """CPUs this process may run on: affinity mask and cgroup quota, whichever is fewer."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _quota(cgroup_cpu_max)
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return max(1, cpus)


def default_threads(share: float = 0.5, cpus: int | None = None) -> int:
    """Torch threads for a model-holding service: `share` of the available CPUs, at least 1."""
    n = available_cpus() if cpus is None else cpus
    return max(1, math.floor(n * share))


def torch_threads(configured: int | None) -> int:
    """Set torch's intra-op threads to `configured`, or the default share; return the count."""
    import torch

    n = configured if configured else default_threads()
    torch.set_num_threads(n)
    return n
