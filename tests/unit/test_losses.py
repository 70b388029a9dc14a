"""The trainer's loss math against closed forms on tiny hand-built tensors, and gradient flow."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.losses import (
    clipped_pg_loss,
    combined_advantages,
    k3_kl,
    masked_mean,
    opd_advantages,
    policy_loss,
    rl_advantages,
    token_logprobs,
)

EPS, EPS_HIGH = 0.2, 0.28


def lp(values: list[list[float]], grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=grad)


def test_ratio_one_gives_minus_mean_advantage() -> None:
    logp = lp([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.5]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.ones(2, 3)
    loss, m = clipped_pg_loss(logp, logp.clone(), adv, mask, EPS, EPS_HIGH)
    assert loss.item() == pytest.approx(-adv.mean().item())
    assert m["clip_frac"].item() == 0.0
    assert m["ratio_mean"].item() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("log_ratio", "adv", "expected_ratio_term", "clipped"),
    [
        (math.log(1.5), 1.0, 1 + EPS_HIGH, True),  # A > 0, ratio above 1+ε_high: capped
        (math.log(1.2), 1.0, 1.2, False),  # A > 0 inside the high bound (0.2 < 0.28)
        (math.log(0.5), 1.0, 0.5, False),  # A > 0, ratio low: the min keeps the ratio
        (math.log(0.5), -1.0, 1 - EPS, True),  # A < 0, ratio below 1-ε: capped
        (math.log(0.9), -1.0, 0.9, False),  # A < 0 inside the low bound
        (math.log(1.5), -1.0, 1.5, False),  # A < 0, ratio high: pessimistic, unclipped
    ],
)
def test_asymmetric_clipping(log_ratio: float, adv: float, expected_ratio_term: float, clipped: bool) -> None:
    old = lp([[-1.0]])
    logp = lp([[-1.0 + log_ratio]], grad=True)
    loss, m = clipped_pg_loss(logp, old, torch.tensor([[adv]]), torch.ones(1, 1), EPS, EPS_HIGH)
    assert loss.item() == pytest.approx(-expected_ratio_term * adv, rel=1e-5)
    assert m["clip_frac"].item() == (1.0 if clipped else 0.0)
    loss.backward()  # type: ignore[no-untyped-call]
    assert logp.grad is not None
    if clipped:
        assert logp.grad.item() == 0.0
    else:  # d(-ρA)/dlogp = -ρA
        assert logp.grad.item() == pytest.approx(-math.exp(log_ratio) * adv, rel=1e-5)


def test_symmetric_bounds_would_clip_what_asymmetric_keeps() -> None:
    old = lp([[0.0]])
    logp = lp([[math.log(1.25)]])
    _, sym = clipped_pg_loss(logp, old, torch.ones(1, 1), torch.ones(1, 1), EPS, EPS)
    _, asym = clipped_pg_loss(logp, old, torch.ones(1, 1), torch.ones(1, 1), EPS, EPS_HIGH)
    assert sym["clip_frac"].item() == 1.0 and asym["clip_frac"].item() == 0.0


def test_k3_kl_closed_form_nonnegative_and_zero_when_equal() -> None:
    logp = lp([[-1.0, -2.0, -0.3, -4.0]])
    ref = lp([[-1.5, -1.0, -0.3, -0.1]])
    d = ref - logp
    expected = torch.exp(d) - d - 1
    got = k3_kl(logp, ref)
    assert torch.allclose(got, expected)
    assert (got >= 0).all()
    assert got[0, 2].item() == 0.0
    assert torch.equal(k3_kl(logp, logp.clone()), torch.zeros_like(logp))


def test_k3_kl_gradient_points_back_to_the_reference() -> None:
    logp = lp([[-2.0, -0.5]], grad=True)
    ref = lp([[-1.0, -1.0]])
    k3_kl(logp, ref).sum().backward()  # type: ignore[no-untyped-call]
    assert logp.grad is not None
    # d/dlogp [exp(ref-logp) - (ref-logp) - 1] = 1 - exp(ref-logp)
    assert torch.allclose(logp.grad, 1 - torch.exp(ref - logp.detach()))
    assert logp.grad[0, 0] < 0 and logp.grad[0, 1] > 0  # descent moves logp toward ref


def test_masked_mean_ignores_masked_tokens_even_nan() -> None:
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert masked_mean(values, mask).item() == pytest.approx((1 + 2 + 4 + 6) / 4)
    assert masked_mean(values, torch.zeros(2, 3)).item() == 0.0  # clamp(min=1): no division by 0
    assert masked_mean(values, mask, num_tokens=8.0).item() == pytest.approx(13 / 8)


def test_pg_loss_token_mean_over_mask() -> None:
    logp = lp([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    adv = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = clipped_pg_loss(logp, logp.clone(), adv, mask, EPS, EPS_HIGH)
    assert loss.item() == pytest.approx(-(1 + 2 + 3) / 3)


def test_advantages() -> None:
    like = torch.zeros(2, 3)
    rl = rl_advantages(torch.tensor([1.0, -1.0]), like)
    assert torch.equal(rl, torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]))
    teacher = lp([[-0.5, -1.0, -2.0], [-1.0, -1.0, -1.0]])
    old = lp([[-1.0, -1.0, -1.0], [-2.0, -0.5, -1.0]])
    assert torch.allclose(opd_advantages(teacher, old), teacher - old)
    rewards = torch.tensor([1.0, -1.0])
    comb = combined_advantages(teacher, old, rewards, w_opd=0.7, w_rl=0.3)
    assert torch.allclose(comb, 0.7 * (teacher - old) + 0.3 * rewards[:, None])
    # a sample without teacher log-probs keeps only the RL term
    partial = combined_advantages(teacher, old, rewards, 0.7, 0.3, torch.tensor([True, False]))
    assert torch.allclose(partial[0], comb[0])
    assert torch.allclose(partial[1], torch.full((3,), -0.3))


def test_opd_advantage_carries_no_gradient() -> None:
    old = lp([[-1.0, -2.0]], grad=True)
    assert not opd_advantages(lp([[-0.5, -0.5]]), old).requires_grad


def test_policy_loss_adds_beta_kl_and_skips_reference_at_beta_zero() -> None:
    logp = lp([[-1.0, -2.0]])
    old = lp([[-1.1, -1.9]])
    ref = lp([[-1.5, -1.0]])
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    pg, _ = clipped_pg_loss(logp, old, adv, mask, EPS, EPS_HIGH)
    kl = masked_mean(k3_kl(logp, ref), mask)
    loss, m = policy_loss(logp, old, adv, mask, eps_clip=EPS, eps_clip_high=EPS_HIGH,
                          kl_beta=0.02, ref_logprobs=ref)
    assert loss.item() == pytest.approx(pg.item() + 0.02 * kl.item())
    assert m["kl"].item() == pytest.approx(kl.item())
    no_kl, m0 = policy_loss(logp, old, adv, mask, eps_clip=EPS, eps_clip_high=EPS_HIGH, kl_beta=0.0)
    assert no_kl.item() == pytest.approx(pg.item()) and "kl" not in m0
    with pytest.raises(ValueError, match="reference"):
        policy_loss(logp, old, adv, mask, eps_clip=EPS, eps_clip_high=EPS_HIGH, kl_beta=0.1)


def test_gradients_only_where_unclipped_and_unmasked() -> None:
    old = lp([[-1.0, -1.0, -1.0, -1.0, -1.0]])
    # ratios: 1.0 (free), 1.5 (clipped, A>0), 0.5 (clipped, A<0), 1.1 (masked), 0.95 (free)
    ratios = [1.0, 1.5, 0.5, 1.1, 0.95]
    logp = lp([[-1.0 + math.log(r) for r in ratios]], grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0]])
    loss, m = policy_loss(logp, old, adv, mask, eps_clip=EPS, eps_clip_high=EPS_HIGH,
                          kl_beta=0.0, num_tokens=4.0)
    loss.backward()  # type: ignore[no-untyped-call]
    assert logp.grad is not None
    nonzero = (logp.grad[0] != 0).tolist()
    assert nonzero == [True, False, False, False, True]
    assert logp.grad[0, 0].item() == pytest.approx(-1.0 / 4)
    assert logp.grad[0, 4].item() == pytest.approx(0.95 / 4, rel=1e-5)
    assert m["clip_frac"].item() == pytest.approx(2 / 4)


def test_extreme_log_ratio_gives_finite_gradients() -> None:
    old = lp([[-100.0, -1.0]])
    logp = lp([[-0.01, -1.0]], grad=True)
    loss, _ = clipped_pg_loss(logp, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), EPS, EPS_HIGH)
    loss.backward()  # type: ignore[no-untyped-call]
    assert torch.isfinite(loss) and logp.grad is not None and torch.isfinite(logp.grad).all()


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, 1.7])
def test_token_logprobs_are_log_softmax_of_logits_over_temperature(temperature: float) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 11, generator=g) * 4
    targets = torch.randint(0, 11, (2, 4), generator=g)
    t = 1.0 if temperature == 0 else temperature
    expected = torch.log_softmax(logits.double() / t, dim=-1).gather(-1, targets[..., None])[..., 0]
    got = token_logprobs(logits, targets, torch.full((2,), temperature))
    assert torch.allclose(got.double(), expected, atol=1e-5)
    # per-sample temperatures
    mixed = token_logprobs(logits, targets, torch.tensor([temperature, 1.0]))
    assert torch.allclose(mixed[0].double(), expected[0], atol=1e-5)
