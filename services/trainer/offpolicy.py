"""Off-policy correction: the trainer's log-probs against the engine's (docs/methods.md#the-traininference-mismatch).

Before a step updates anything, the trainer's log-prob of each sampled token at its
current weights (π_old) is compared with the log-prob the engine reported when it sampled
it (π_b, the behaviour policy): log ρ = log π_old − log π_b.

- **Mismatch**: for samples the engine drew from the very version the trainer holds, ρ
  should be 1; what it is not is the train/inference mismatch (bf16 kernels, another
  attention implementation, another dtype). `mismatch_sums` gives its statistics.
- **Truncated importance sampling** (IS_CORRECTION=tis): each token's policy-gradient term
  is weighted by min(ρ, C) and the PPO ratio is taken against π_old instead of π_b, so that
  the clip acts on the policy's own change while the mismatch and the staleness of the
  sample are corrected by a bounded weight — the decoupled objective of the TIS and MIS
  fixes. Stale samples train under the same weight instead of being dropped.
- **Divergence bound** (MAX_SAMPLE_KL): a sample whose behaviour policy is too far from
  π_old for any weight to be trusted — the mean over its tokens of the k3 estimate of
  KL(π_b ‖ π_old), (ρ − 1) − log ρ — is masked out of the loss and counted.

All functions are pure: tensors in, tensors out. Shapes: B samples, W window positions.
"""

from __future__ import annotations

import torch

from services.trainer.losses import LOG_RATIO_CLAMP


def log_ratio(trainer: torch.Tensor, behaviour: torch.Tensor, has_behaviour: torch.Tensor) -> torch.Tensor:
    """log π_old − log π_b per token, 0 for samples without behaviour log-probs.

    trainer (B, W) detached; behaviour (B, W); has_behaviour (B,) bool -> (B, W)
    """
    d = (trainer.detach() - behaviour).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(has_behaviour[:, None], d, torch.zeros_like(d))


def sample_kl(log_rho: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per sample, the token-mean of the k3 estimate of KL(π_b ‖ π_old): (ρ−1) − log ρ ≥ 0.

    log_rho, mask (B, W) -> (B,)
    """
    k3 = torch.expm1(log_rho) - log_rho
    tokens = mask.sum(-1).clamp(min=1.0)
    return (k3 * mask).sum(-1) / tokens


def divergent(log_rho: torch.Tensor, mask: torch.Tensor, has_behaviour: torch.Tensor,
              bound: float | None) -> torch.Tensor:
    """Samples beyond the divergence bound (never those without behaviour log-probs).  (B,) bool"""
    if bound is None:
        return torch.zeros_like(has_behaviour, dtype=torch.bool)
    return has_behaviour & (sample_kl(log_rho, mask) > bound)


def truncated_weights(log_rho: torch.Tensor, cap: float) -> torch.Tensor:
    """min(ρ, C) per token (1 where log ρ is 0: no behaviour log-probs).  (B, W)"""
    return torch.exp(log_rho).clamp(max=cap)


def mismatch_sums(
    log_rho: torch.Tensor, mask: torch.Tensor, same_version: torch.Tensor,
    eps_clip: float, eps_clip_high: float,
) -> dict[str, float]:
    """Sums over the trained tokens of samples drawn from the weights the trainer holds
    (`same_version` (B,) bool, which implies behaviour log-probs): how many, Σ|log ρ|, how
    many outside [1−ε, 1+ε_high], and the extremes of log ρ. Sums, so that micro-batches and
    ranks add up; `mismatch_metrics` turns them into the reported figures."""
    m = mask * same_version[:, None].to(mask.dtype)
    n = float(m.sum())
    if n == 0:
        return {}
    rho = torch.exp(log_rho)
    outside = ((rho < 1.0 - eps_clip) | (rho > 1.0 + eps_clip_high)).to(m.dtype)
    sel = log_rho[m.bool()]
    return {
        "mismatch_tokens": n,
        "mismatch_abs_sum": float((log_rho.abs() * m).sum()),
        "mismatch_outside_sum": float((outside * m).sum()),
        "mismatch_log_ratio_min": float(sel.min()),
        "mismatch_log_ratio_max": float(sel.max()),
    }


SUM_KEYS = ("mismatch_tokens", "mismatch_abs_sum", "mismatch_outside_sum",
            "mismatch_log_ratio_min", "mismatch_log_ratio_max")
# What one micro-batch counts besides the loss's metrics (Trainer.corrected); all additive.
COUNT_KEYS = ("divergent_samples", "offpolicy_samples", "truncated_samples", "is_weight_mean",
              "is_truncated_frac")


def merge_sums(into: dict[str, float], more: dict[str, float]) -> None:
    """Add one micro-batch's `mismatch_sums` into the step's (extremes by min/max)."""
    for k, v in more.items():
        if k not in into:
            into[k] = v
        elif k.endswith("_min"):
            into[k] = min(into[k], v)
        elif k.endswith("_max"):
            into[k] = max(into[k], v)
        else:
            into[k] += v


def mismatch_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The step's mismatch figures from its sums: mean |log ρ|, the fraction of tokens
    outside the clip range, ρ's extremes, the tokens they are over. Empty without any."""
    n = sums.get("mismatch_tokens", 0.0)
    if n <= 0:
        return {}
    out = {
        "mismatch_tokens": n,
        "mismatch_abs_log_ratio": sums["mismatch_abs_sum"] / n,
        "mismatch_outside_frac": sums["mismatch_outside_sum"] / n,
    }
    if "mismatch_log_ratio_min" in sums:
        out["mismatch_ratio_min"] = float(torch.tensor(sums["mismatch_log_ratio_min"]).exp())
        out["mismatch_ratio_max"] = float(torch.tensor(sums["mismatch_log_ratio_max"]).exp())
    return out
