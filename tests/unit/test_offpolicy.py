"""The off-policy correction's pure parts (services/trainer/offpolicy.py) and the mismatch
alarm's window (services/trainer/mismatch.py)."""

from __future__ import annotations

import math

import pytest
import torch

from services.ctl.status import mismatch_snapshot, render_mismatch
from services.trainer import offpolicy
from services.trainer.mismatch import MismatchWatch


def test_log_ratio_is_zero_without_behaviour_and_clamped() -> None:
    trainer = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    behaviour = torch.tensor([[-1.5, -60.0], [0.0, 0.0]])
    lr = offpolicy.log_ratio(trainer, behaviour, torch.tensor([True, False]))
    assert lr.tolist() == [[0.5, 20.0], [0.0, 0.0]]


def test_truncated_weights_cap_and_sample_kl_is_k3() -> None:
    log_rho = torch.tensor([[0.0, math.log(3.0), math.log(0.5)]])
    assert offpolicy.truncated_weights(log_rho, 2.0)[0].tolist() == pytest.approx([1.0, 2.0, 0.5])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    k3 = (3.0 - 1.0) - math.log(3.0)
    assert offpolicy.sample_kl(log_rho, mask).item() == pytest.approx(k3 / 2)
    has = torch.tensor([True])
    assert offpolicy.divergent(log_rho, mask, has, 0.2).tolist() == [True]
    assert offpolicy.divergent(log_rho, mask, has, 1.0).tolist() == [False]
    assert offpolicy.divergent(log_rho, mask, has, None).tolist() == [False]
    assert offpolicy.divergent(log_rho, mask, torch.tensor([False]), 0.2).tolist() == [False]


def test_mismatch_sums_count_only_the_trainers_own_samples_and_add_up() -> None:
    log_rho = torch.tensor([[0.1, -0.3, 0.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    sums = offpolicy.mismatch_sums(log_rho, mask, torch.tensor([True, False]), 0.2, 0.28)
    assert sums["mismatch_tokens"] == 2
    assert sums["mismatch_abs_sum"] == pytest.approx(0.4)
    assert sums["mismatch_outside_sum"] == 1  # exp(-0.3) = 0.74 < 0.8
    assert offpolicy.mismatch_sums(log_rho, mask, torch.tensor([False, False]), 0.2, 0.28) == {}
    total: dict[str, float] = {}
    offpolicy.merge_sums(total, sums)
    offpolicy.merge_sums(total, sums | {"mismatch_log_ratio_min": -1.0, "mismatch_log_ratio_max": 0.05})
    m = offpolicy.mismatch_metrics(total)
    assert m["mismatch_tokens"] == 4 and m["mismatch_abs_log_ratio"] == pytest.approx(0.2)
    assert m["mismatch_outside_frac"] == pytest.approx(0.5)
    assert m["mismatch_ratio_min"] == pytest.approx(math.exp(-1.0))
    assert m["mismatch_ratio_max"] == pytest.approx(math.exp(0.1))


def test_the_alarm_needs_enough_tokens_goes_off_past_the_threshold_and_clears() -> None:
    w = MismatchWatch(threshold=0.05, window=3, min_tokens=100)
    assert w.observe({"loss": 1.0}) is None  # no sample of the trainer's own version
    s = w.observe({"mismatch_tokens": 50, "mismatch_abs_log_ratio": 0.3, "mismatch_outside_frac": 0.2})
    assert s is not None and not s.alarm  # 50 tokens say nothing yet
    s = w.observe({"mismatch_tokens": 50, "mismatch_abs_log_ratio": 0.3, "mismatch_outside_frac": 0.2})
    assert s is not None and s.alarm and s.since is not None
    for _ in range(3):  # the window forgets the bad steps
        s = w.observe({"mismatch_tokens": 100, "mismatch_abs_log_ratio": 0.01, "mismatch_outside_frac": 0.0})
    assert s is not None and not s.alarm and s.since is None
    fields = s.fields(0.05, 3)
    snap = mismatch_snapshot(fields)
    assert snap is not None and snap["tokens"] == 300 and not snap["alarm"]
    assert len(render_mismatch({"mismatch": snap})) == 1
    alarmed = mismatch_snapshot(fields | {"alarm": "1", "abs_log_ratio": "0.3"})
    lines = render_mismatch({"mismatch": alarmed})
    assert "MISMATCH ALARM" in lines[1] and "troubleshooting.md#the-trainer-and-the-engine-disagree" in lines[1]
    assert mismatch_snapshot({}) is None
