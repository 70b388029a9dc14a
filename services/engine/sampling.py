"""Token sampling and the log-probs we report: small pure functions over one logits row.

The contract the trainer relies on:

    logprob(token) = log_softmax(logits / T)[token]     over the full vocabulary

where T is the request's temperature, and T == 0 (greedy) reports T = 1. Top-k and
top-p only restrict *which* tokens may be sampled (the kept tokens are renormalised for
sampling); they never change the reported log-prob, so the trainer can recompute it
exactly from the logits and T alone. The same function scores given sequences, so a
sampled token's log-prob and its teacher-forced score agree.

Sampling is an inverse-CDF draw with one uniform from a per-request CPU generator: a
seeded request samples the same tokens whatever else the engine is doing.

Constrained decoding (a grammar, services/engine/grammar.py) passes `allowed`, the
tokens the grammar lets through at this step: the sample is drawn from the tempered
distribution restricted to them (renormalised; top-k/top-p measured within them, as
SGLang and vLLM apply the grammar mask before top-k/top-p). The reported log-prob stays
the unmasked full-vocabulary value above, so that the trainer's recomputation agrees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-6  # SGLang's threshold: temperatures below this mean greedy


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: the whole vocabulary

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def logprob_temperature(self) -> float:
        """The T of the reported log-probs: the request's, or 1 when it is greedy."""
        return 1.0 if self.temperature < GREEDY_EPS else self.temperature


def scaled_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) in float32 along the last axis; T < 1e-6 means T = 1.  (…, V)"""
    t = 1.0 if temperature < GREEDY_EPS else temperature
    x = logits.float()
    if t != 1.0:
        x = x / t
    return torch.log_softmax(x, dim=-1)


def keep_mask(logprobs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Which tokens top-k then top-p let through (at least the most likely one).  (V,) bool

    Top-p keeps the smallest set of most likely tokens whose probability reaches
    `top_p`, measured after top-k has removed the rest (as SGLang and vLLM do).
    """
    vocab = logprobs.shape[-1]
    keep = torch.ones(vocab, dtype=torch.bool, device=logprobs.device)
    if 0 < top_k < vocab:
        kth = torch.topk(logprobs, top_k).values[-1]
        keep &= logprobs >= kth
        # Ties at the k-th value: keep the lowest ids so exactly k survive.
        if int(keep.sum()) > top_k:
            idx = torch.nonzero(keep).squeeze(-1)
            order = torch.argsort(logprobs[idx], descending=True, stable=True)
            keep = torch.zeros_like(keep)
            keep[idx[order[:top_k]]] = True
    if top_p < 1.0:
        masked = torch.where(keep, logprobs, torch.full_like(logprobs, -math.inf))
        probs = torch.softmax(masked.double(), dim=-1)
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        drop_sorted = before >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(keep)
        drop[order] = drop_sorted
        keep &= ~drop
    return keep


class NoAllowedToken(ValueError):
    """A constrained step whose grammar lets no token through (a bug, never a user error)."""


def sample_token(
    logits: torch.Tensor,
    cfg: SamplingConfig,
    generator: torch.Generator | None,
    allowed: torch.Tensor | None = None,
) -> tuple[int, float]:
    """Choose the next token from one logits row; return (token id, reported log-prob).

    `allowed` (V,) bool restricts the choice to a grammar's tokens; the reported log-prob
    is the full-vocabulary one either way.
    """
    logprobs = scaled_logprobs(logits, cfg.temperature)
    base = logprobs
    if allowed is not None:
        if not bool(allowed.any()):
            raise NoAllowedToken("the grammar allows no token at this step")
        base = torch.where(allowed, logprobs, torch.full_like(logprobs, -math.inf))
    if cfg.greedy:
        token = int(torch.argmax(base))  # the first of equal maxima, deterministically
        return token, float(logprobs[token])
    keep = keep_mask(base, cfg.top_k, cfg.top_p)
    if allowed is not None:
        keep &= allowed  # top-k may reach past the allowed tokens when fewer than k remain
    probs = torch.where(keep, base, torch.full_like(base, -math.inf)).double().exp()
    cdf = torch.cumsum(probs.cpu(), dim=-1)
    total = float(cdf[-1])
    u = float(torch.rand((), generator=generator, dtype=torch.float64)) * total
    token = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)[0])
    if token >= cdf.shape[0] or not bool(keep[token]):  # u rounded up to the very top
        token = int(torch.nonzero(keep)[-1])
    return token, float(logprobs[token])


def top_logprobs(logprobs: torch.Tensor, n: int) -> list[tuple[float, int]]:
    """The n most likely tokens of one row as (log-prob, id), most likely first."""
    if n <= 0:
        return []
    values, ids = torch.topk(logprobs, min(n, logprobs.shape[-1]))
    return [(float(v), int(i)) for v, i in zip(values.tolist(), ids.tolist(), strict=True)]


def new_generator(seed: int | None) -> torch.Generator:
    """A CPU generator: `seed` makes the request reproducible; None draws a fresh seed."""
    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen
