"""Chunked token log-probs (services/trainer/logprobs.py): the plain form's values and gradients,
with no fp32 copy of the whole logits kept for the backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.trainer.logprobs import chunk_rows, chunked_token_logprobs, plain_token_logprobs
from services.trainer.losses import logprob_temperature, token_logprobs

B, W, V = 3, 7, 101


def case(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, W, V, generator=gen) * 5).to(dtype)
    targets = torch.randint(0, V, (B, W), generator=gen)
    temps = torch.tensor([1.0, 0.6, 0.0])  # the last is greedy: T = 1
    weights = torch.randn(B, W, generator=gen)  # d loss / d logp
    return logits, targets, temps, weights


def values_and_grad(fn: Any, logits: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor,
                    weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    x = logits.detach().clone().requires_grad_()
    out = fn(x, targets, logprob_temperature(temps))
    (out * weights).sum().backward()
    assert x.grad is not None and x.grad.dtype == logits.dtype
    return out.detach(), x.grad


@pytest.mark.parametrize("rows", [1, 2, 5, B * W, 1000])
def test_fp32_values_and_gradients_are_the_plain_forms_exactly(rows: int) -> None:
    logits, targets, temps, weights = case(torch.float32)

    def chunked(x: torch.Tensor, t: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        return chunked_token_logprobs(x, t, T, rows)

    got, got_grad = values_and_grad(chunked, logits, targets, temps, weights)
    want, want_grad = values_and_grad(plain_token_logprobs, logits, targets, temps, weights)
    assert got.dtype == torch.float32 and got.shape == (B, W)
    assert torch.equal(got, want)
    assert torch.equal(got_grad, want_grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_agree_and_keep_their_dtype(dtype: torch.dtype) -> None:
    logits, targets, temps, weights = case(dtype, seed=1)

    def chunked(x: torch.Tensor, t: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
        return chunked_token_logprobs(x, t, T, 4)

    got, got_grad = values_and_grad(chunked, logits, targets, temps, weights)
    want, want_grad = values_and_grad(plain_token_logprobs, logits, targets, temps, weights)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=1e-2, atol=1e-3)


def test_the_losses_entry_point_is_chunked_and_resolves_greedy_temperatures() -> None:
    logits, targets, temps, _ = case(torch.float32)
    want = plain_token_logprobs(logits, targets, logprob_temperature(temps))
    assert torch.equal(token_logprobs(logits, targets, temps), want)
    with torch.no_grad():  # the reference's forward: no graph, same values
        assert torch.equal(token_logprobs(logits, targets, temps), want)


def test_gradients_add_up_with_another_use_of_the_logits() -> None:
    """A loss that also reads the logits (opd_topk's log-softmax) gets both gradients."""
    logits, targets, temps, weights = case(torch.float32)

    def both(fn: Any) -> torch.Tensor:
        x = logits.detach().clone().requires_grad_()
        lp = fn(x, targets, logprob_temperature(temps))
        other = torch.log_softmax(x.float(), dim=-1)[..., :3].exp().sum()
        ((lp * weights).sum() + other).backward()
        assert x.grad is not None
        return x.grad

    torch.testing.assert_close(both(chunked_token_logprobs), both(plain_token_logprobs), rtol=0, atol=1e-7)


def saved_bytes(fn: Any, logits: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward beyond the logits themselves."""
    seen: dict[int, int] = {}
    own = logits.untyped_storage().data_ptr()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() != own:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits, targets, temps)
    return sum(seen.values())


def test_the_backward_keeps_no_fp32_copy_of_the_logits() -> None:
    """The plain form keeps the scaled fp32 logits (4·N·V bytes); the chunked one keeps the
    logits it was given and O(N) more: the logsumexps, targets and temperatures."""
    n, v = 64, 5000
    logits = torch.randn(1, n, v, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, v, (1, n))
    temps = torch.ones(1)
    assert saved_bytes(plain_token_logprobs, logits, targets, temps) >= 4 * n * v
    assert saved_bytes(chunked_token_logprobs, logits, targets, temps) <= 32 * n


def test_chunk_rows_follow_the_byte_budget() -> None:
    assert chunk_rows(151_936) == 32 * 2**20 // (4 * 151_936) == 55
    assert chunk_rows(10**9) == 1
    assert chunk_rows(100, budget=4000) == 10
