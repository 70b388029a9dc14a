"""The CPU budget: affinity mask and cgroup quota, and the default torch thread share."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.cpus import available_cpus, default_threads


def test_a_cgroup_quota_caps_the_affinity_mask(tmp_path: Path) -> None:
    mask = len(os.sched_getaffinity(0))
    quota = tmp_path / "cpu.max"
    quota.write_text("max 100000\n")
    assert available_cpus(quota) == mask  # unlimited: the mask decides
    quota.write_text("150000 100000\n")  # docker --cpus 1.5
    assert available_cpus(quota) == min(mask, 1)
    quota.write_text("50000 100000\n")  # half a CPU still leaves one thread
    assert available_cpus(quota) == 1
    assert available_cpus(tmp_path / "absent") == mask


@pytest.mark.parametrize(("cpus", "threads"), [(1, 1), (2, 1), (3, 1), (4, 2), (16, 8)])
def test_default_threads_leave_room_for_the_other_services(cpus: int, threads: int) -> None:
    assert default_threads(cpus=cpus) == threads
