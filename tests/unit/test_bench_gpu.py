"""bench/gpu.py's core, `bench_shape`, on the tiny shape for one step on the CPU: every
figure it reports is there and in range (the benchmark itself runs on a GPU)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_shape_one_step_reports_every_figure() -> None:
    gpu = load_bench()
    r = gpu.bench_shape("tiny", torch.device("cpu"), torch.float32, batch=2, seq=64, steps=1)
    assert r["params"] > 0 and r["steps_timed"] == 1
    assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["model_flops_per_s"] > 0
    assert r["utilisation"] is None  # no device peak on a CPU
    assert r["peak_bytes"] > 0 and r["plan_bytes"] > 0
    for key in ("changed_stepped", "changed_weights_matrices", "changed_weights_vectors"):
        assert 0.0 <= r[key] <= 1.0, key
    assert r["changed_stepped"] > 0.99  # fp32: every element with a gradient moves at lr 1e-6
    # the step-0 ratio: the fp32 trainer against the bf16 "engine", over every response token
    assert r["mismatch_tokens"] == 2 * 32
    assert 0.0 < r["mismatch_abs_log_ratio"] < 1.0
    assert 0.0 < r["mismatch_ratio_min"] <= r["mismatch_ratio_max"] < math.inf
    assert 0.0 <= r["mismatch_outside_frac"] <= 1.0
    assert r["version_format"] == "full" and r["version_bytes"] > 0 and r["version_s"] > 0
    assert r["kl_step_s"] > 0 and r["kl_vs_beta0"] > 0 and r["kl_peak_bytes"] > 0


def test_device_peaks() -> None:
    gpu = load_bench()
    assert gpu.device_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu.device_peak("NVIDIA H100 PCIe") == 756e12
    assert gpu.device_peak("NVIDIA H200") == 989e12
    assert gpu.device_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert gpu.device_peak("NVIDIA GeForce RTX 4090") is None
