"""Token log-probs a chunk of positions at a time: no fp32 copy of the whole logits.

`log_softmax(logits / T)[target]` needs each position's logsumexp over the vocabulary.
Written plainly (`logits.float() / T`, then `logsumexp`) it makes two fp32 copies of the
whole (B, W, V) logits, and autograd keeps the scaled one until the backward: at 8,192
tokens × Qwen3's 151,936-token vocabulary that is 5 GB each, beside 2.5 GB of bf16
logits. Here the N = B·W positions go `rows` at a time:

    forward    per chunk: fp32 copy, / T, logsumexp, gather; keeps only the (N,) logsumexps
    backward   per chunk: the softmax recomputed from the logits (which the caller holds
               anyway), g·(onehot - softmax) / T written into one gradient in the
               logits' own dtype

so the extra memory is a few fp32 chunks (`CHUNK_BYTES` each), whatever N. The gradient
is the expression autograd derives for the plain form, evaluated in the same order, so
both agree to the bit in fp32 (tests/unit/test_logprobs_chunked.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

# fp32 bytes of one chunk: 55 positions of a 151,936 vocabulary. Smaller chunks mean more
# kernel launches on a GPU (a few thousand per 8,192-token micro-batch here: milliseconds);
# on a CPU they run faster, staying in cache (bench/memory.py).
CHUNK_BYTES = 32 * 2**20


def chunk_rows(vocab: int, budget: int = CHUNK_BYTES) -> int:
    """Positions per chunk: as many fp32 rows of `vocab` as fit `budget`, at least one."""
    return max(1, budget // (4 * max(1, vocab)))


def _scaled(logits: torch.Tensor, temps: torch.Tensor, s: int, e: int) -> torch.Tensor:
    """Rows s..e of the logits in fp32, divided by their temperature.  (e - s, V)"""
    return logits[s:e].float() / temps[s:e, None]


class _ChunkedLogprobs(torch.autograd.Function):
    """(N, V) logits, (N,) targets, (N,) temperatures -> (N,) fp32 log-probs."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor, rows: int
    ) -> torch.Tensor:
        n = logits.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        for s in range(0, n, rows):
            e = min(n, s + rows)
            scaled = _scaled(logits, temps, s, e)  # (rows, V) fp32: the only copy alive
            lse[s:e] = torch.logsumexp(scaled, dim=-1)
            out[s:e] = scaled.gather(-1, targets[s:e, None]).squeeze(-1) - lse[s:e]
        ctx.save_for_backward(logits, targets, temps, lse)
        ctx.rows = rows
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        logits, targets, temps, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        grad = torch.empty_like(logits)  # (N, V) in the logits' dtype, as autograd's would be
        n, rows = logits.shape[0], ctx.rows
        g = grad_out.float()
        for s in range(0, n, rows):
            e = min(n, s + rows)
            # d(picked - lse)/d scaled = onehot(target) - exp(scaled - lse), times g
            part = torch.exp(_scaled(logits, temps, s, e) - lse[s:e, None]) * -g[s:e, None]
            part.scatter_add_(-1, targets[s:e, None], g[s:e, None])
            grad[s:e] = part / temps[s:e, None]
        return grad, None, None, None


def chunked_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor, rows: int | None = None
) -> torch.Tensor:
    """log_softmax(logits / T)[targets] in float32, `rows` positions at a time.

    logits (B, W, V) any float dtype; targets (B, W) long; temps (B,) the temperatures
    to divide by (already resolved: no zeros); rows: default `chunk_rows(V)` -> (B, W)
    """
    b, w, v = logits.shape
    per_row = temps.float().to(logits.device)[:, None].expand(b, w).reshape(-1)  # (N,)
    flat = _ChunkedLogprobs.apply(  # type: ignore[no-untyped-call]
        logits.reshape(b * w, v), targets.reshape(-1), per_row, rows or chunk_rows(v)
    )
    out: torch.Tensor = flat.view(b, w)
    return out


def plain_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """The same log-probs in one piece (two fp32 copies of the logits): the reference the
    chunked form is tested and benchmarked against.  (B, W, V), (B, W), (B,) -> (B, W)"""
    scaled = logits.float() / temps.float().to(logits.device)[:, None, None]  # (B, W, V)
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, W)
    return picked - torch.logsumexp(scaled, dim=-1)
