"""Mixed precision that learns (services/trainer/precision.py): a model trained in bf16 —
its forward and backward really in bf16 — steps fp32 masters, so an update far below
bf16's spacing is kept, agrees with the fp32 step, and improves the policy as fp32 does.
The same model stepped in bf16 without masters loses almost every update (the bug)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from services.trainer.batching import collate
from services.trainer.model import load_causal_lm, window_logprobs
from services.trainer.precision import MixedPrecisionAdamW
from services.trainer.step import LossConfig, OptimConfig, Trainer, make_optimizer
from shared.schemas import TrainSample

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/unit/conftest.py


def batch(seed: int = 0, n: int = 6) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, r = rng.randint(2, 20), rng.randint(4, 12)
        out.append(TrainSample(
            session_id="s", tokens=[rng.randrange(500) for _ in range(p + r)], response_length=r,
            loss_mask=[1] * r, reward=rng.choice([1.0, -1.0]), temperature=1.0,
        ))  # fmt: skip
    return out


def trainer(model_dir: Path, dtype: torch.dtype, masters: str, lr: float) -> Trainer:
    torch.manual_seed(0)
    model = load_causal_lm(model_dir, CPU, dtype)
    optim = OptimConfig(lr=lr)
    return Trainer(model, make_optimizer(model, optim, masters), LossConfig(kl_beta=0.0), optim)


def one_step(model_dir: Path, dtype: torch.dtype, masters: str) -> tuple[Trainer, torch.Tensor]:
    """A step at the default lr 1e-6: the change of what the optimizer steps, flattened."""
    t = trainer(model_dir, dtype, masters, 1e-6)
    before = [p.detach().float().clone() for p in t.params]
    t.step(batch())
    return t, torch.cat([(p.detach().float() - b).flatten() for p, b in zip(t.params, before, strict=True)])


def test_bf16_compute_steps_fp32_masters_and_keeps_every_update(tiny_model: Path) -> None:
    seen: list[torch.dtype] = []
    t = trainer(tiny_model, torch.bfloat16, "auto", 1e-6)
    assert isinstance(t.optimizer, MixedPrecisionAdamW)
    assert {p.dtype for p in t.model.parameters()} == {torch.bfloat16}  # the model stays bf16
    assert {p.dtype for p in t.params} == {torch.float32}  # what is stepped: the masters
    hook = t.model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    t.step(batch())
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}  # the forward ran in bf16, not silently fp32

    _, d32 = one_step(tiny_model, torch.float32, "auto")
    _, dbf = one_step(tiny_model, torch.bfloat16, "auto")
    _, naive = one_step(tiny_model, torch.bfloat16, "false")
    moved = d32 != 0  # elements with a gradient (AdamW's first step moves each by about lr)
    assert moved.float().mean() > 0.99
    assert (dbf[moved] != 0).float().mean() >= 0.99
    cos = torch.nn.functional.cosine_similarity(dbf, d32, dim=0)
    assert cos > 0.98, f"the bf16 step points elsewhere than the fp32 one (cosine {cos:.3f})"
    assert (dbf - d32).norm() / d32.norm() < 0.2
    # Without masters the same step rounds away: what the trainer did on a GPU before.
    assert (naive[moved] != 0).float().mean() < 0.1


def objective(model: Any, samples: list[TrainSample]) -> float:
    """Mean over samples of reward × the response's mean log-prob: what the policy gradient raises."""
    mb = collate(samples, "rl")
    assert mb is not None
    with torch.no_grad():
        lp = window_logprobs(model, mb).float()
    per = (lp * mb.mask).sum(1) / mb.mask.sum(1)
    return float((per * mb.rewards).mean())


def gain(model_dir: Path, dtype: torch.dtype, masters: str) -> float:
    t = trainer(model_dir, dtype, masters, 1e-5)
    fixed = batch(3, n=8)
    start = objective(t.model, fixed)
    for _ in range(20):
        t.step(fixed)
    return objective(t.model, fixed) - start


def test_a_bf16_run_improves_the_policy_as_the_fp32_run_does(tiny_model: Path) -> None:
    fp32 = gain(tiny_model, torch.float32, "auto")
    mixed = gain(tiny_model, torch.bfloat16, "auto")
    naive = gain(tiny_model, torch.bfloat16, "false")
    assert fp32 > 0.01
    assert mixed > 0.7 * fp32, f"bf16 with masters gained {mixed:.4f}, fp32 {fp32:.4f}"
    assert naive < 0.5 * fp32  # the bug this fixes: most small updates lost


def test_masters_travel_with_the_optimizer_state_and_stale_ones_are_dropped(tiny_model: Path) -> None:
    t, _ = one_step(tiny_model, torch.bfloat16, "auto")
    state = t.optimizer.state_dict()
    masters = [m for m in state["master"] if m is not None]
    assert masters and all(m.dtype == torch.float32 for m in masters)

    same = trainer(tiny_model, torch.bfloat16, "auto", 1e-6)
    with torch.no_grad():  # the resumed model holds the stepped weights (the version's)
        for p, q in zip(same.model.parameters(), t.model.parameters(), strict=True):
            p.copy_(q)
    same.optimizer.load_state_dict(state)
    assert same.optimizer.adopted == len(masters)
    for m, saved in zip(same.params, state["master"], strict=True):
        if saved is not None:
            assert torch.equal(m.detach(), saved)  # below bf16's precision too

    # The weights before the step (as after a resume from an older version): only masters
    # that still round to them are taken (the norm weights, whose step stayed below bf16's spacing).
    other = trainer(tiny_model, torch.bfloat16, "auto", 1e-6)
    fits = sum(torch.equal(s.to(torch.bfloat16), p.detach())
               for s, p in zip(state["master"], other.optimizer.weights.params, strict=True) if s is not None)
    assert 0 < fits < len(masters)
    other.optimizer.load_state_dict(state)
    assert other.optimizer.adopted == fits
    for p, m in zip(other.optimizer.weights.params, other.params, strict=True):
        assert torch.equal(m.detach().to(p.dtype), p.detach())  # fresh copies of the weights
