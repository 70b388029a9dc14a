"""The policy-gradient math (docs/design.md#rewards-and-advantages): small pure functions.

Tensors in, tensors (or `(loss, metrics)`) out; no model, no config object. Shapes:
B samples, T token positions, V vocabulary. Every per-token quantity comes with a
0/1 `mask` (B, T) of the tokens that train; means over tokens divide by `num_tokens`,
which defaults to the mask's sum (clamped to 1) and is passed explicitly when a batch
is split into micro-batches, so that the accumulated gradient is the gradient of the
whole batch's token-mean. Metrics are detached tensors normalised the same way, so
they too add up across micro-batches.

    log-probs    log_softmax(logits / T)[token], T the sample's temperature (0 -> 1),
                 exactly what the engine reports
    advantages   rl: A = r on every token; opd: A = teacher - old; combine: the weighted sum
    top-K OPD    reverse KL(student || teacher) over the teacher's top-K tokens + a tail bin
    pg loss      -min(ρA, clip(ρ, 1-ε, 1+ε_high)A), ρ = exp(logp - old)
    KL           k3 estimator to the frozen reference: exp(ref - logp) - (ref - logp) - 1
    loss         token-mean of pg + β·KL over the loss mask; no entropy term
"""

from __future__ import annotations

import torch

from services.trainer.logprobs import chunked_token_logprobs

Metrics = dict[str, torch.Tensor]

GREEDY_EPS = 1e-6  # temperatures below this are greedy decoding: log-probs at T = 1
LOG_RATIO_CLAMP = 20.0  # exp() of more would overflow float32 and turn gradients into NaN


def logprob_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """The T log-probs are computed at: the sampling temperature, or 1 when greedy.  (B,)"""
    return torch.where(temperature < GREEDY_EPS, torch.ones_like(temperature), temperature)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor
) -> torch.Tensor:
    """log_softmax(logits / T) gathered at `targets`, in float32, a chunk of positions at a
    time: no fp32 copy of the whole logits, forward or backward (services/trainer/logprobs.py).

    logits (B, T, V) any float dtype; targets (B, T) long; temperature (B,) -> (B, T)
    """
    return chunked_token_logprobs(logits, targets, logprob_temperature(temperature.float()))


def token_count(mask: torch.Tensor) -> torch.Tensor:
    """How many tokens train, at least 1 (the denominator of every token-mean).  () float"""
    return mask.float().sum().clamp(min=1.0)


def masked_mean(
    values: torch.Tensor, mask: torch.Tensor, num_tokens: torch.Tensor | float | None = None
) -> torch.Tensor:
    """sum(values · mask) / num_tokens; masked entries contribute nothing (not even NaN).

    values (B, T); mask (B, T) 0/1 -> ()
    """
    denom = token_count(mask) if num_tokens is None else num_tokens
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return kept.sum() / denom


# -- advantages ----------------------------------------------------------------------------------
def rl_advantages(rewards: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """RL, a group of one: A_t = r (in [-1, 1]) on every response token, no normalisation.

    rewards (B,); like (B, T) gives the shape -> (B, T)
    """
    return rewards.to(like.dtype)[:, None].expand_as(like)


def opd_advantages(teacher_logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """On-policy distillation: A_t = teacher_lp_t - old_lp_t (no gradient).  (B, T) -> (B, T)"""
    return (teacher_logprobs - old_logprobs).detach()


def combined_advantages(
    teacher_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    w_opd: float,
    w_rl: float,
    has_teacher: torch.Tensor | None = None,
) -> torch.Tensor:
    """A_t = w_opd·(teacher_lp_t - old_lp_t) + w_rl·r; samples without teacher log-probs
    (`has_teacher` False) get the RL term only.

    teacher_logprobs, old_logprobs (B, T); rewards (B,); has_teacher (B,) bool -> (B, T)
    """
    opd = opd_advantages(teacher_logprobs, old_logprobs)
    if has_teacher is not None:
        opd = torch.where(has_teacher[:, None], opd, torch.zeros_like(opd))
    return w_opd * opd + w_rl * rl_advantages(rewards, old_logprobs)


# -- top-K distillation -----------------------------------------------------------------------------
TAIL_FLOOR = 1e-8  # the least tail mass a log is taken of (the teacher's K may hold it all)


def topk_reverse_kl(
    student_logprobs: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor
) -> torch.Tensor:
    """Reverse KL(student || teacher) over the teacher's top-K tokens plus one tail bin.

    With s the student's distribution and t the teacher's, over the bins {k_1..k_K, tail}:
    Σ_k s_k (log s_k - log t_k) + s_tail (log s_tail - log t_tail), where the tail holds
    the mass outside the K tokens (1 - Σ_k, at least TAIL_FLOOR before its log). Entries
    whose teacher log-prob is -inf are padding: not in the set (their mass is tail).
    With K = V the tails are empty and this is the full reverse KL. The teacher is a
    constant: gradients flow only through the student.

    student_logprobs (B, W, V) log-softmax, with gradient; topk_ids (B, W, K) long;
    topk_logprobs (B, W, K) -> (B, W)
    """
    t = topk_logprobs.detach().to(student_logprobs.dtype)
    valid = torch.isfinite(t)  # (B, W, K)
    s = student_logprobs.gather(-1, topk_ids)  # (B, W, K)
    s_p = torch.where(valid, s.exp(), torch.zeros_like(s))
    t_safe = torch.where(valid, t, torch.zeros_like(t))
    in_set = (s_p * (s - t_safe)).sum(-1)  # (B, W)
    s_tail = (1.0 - s_p.sum(-1)).clamp(min=0.0)
    t_tail = (1.0 - torch.where(valid, t.exp(), torch.zeros_like(t)).sum(-1)).clamp(min=0.0)
    tail = s_tail * (s_tail.clamp(min=TAIL_FLOOR).log() - t_tail.clamp(min=TAIL_FLOOR).log())
    return in_set + tail


# -- loss terms -----------------------------------------------------------------------------------
def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(π || π_ref) per token: exp(d) - d - 1 with d = ref - logp; >= 0.

    logprobs (B, T) with gradient; ref_logprobs (B, T) -> (B, T)
    """
    d = (ref_logprobs.detach() - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0


def clipped_pg_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    num_tokens: torch.Tensor | float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate with asymmetric bounds [1 - eps_clip, 1 + eps_clip_high].

    logprobs (B, T) with gradient; old_logprobs (the ratio's denominator), advantages,
    mask (B, T). A token is clipped when the clipped branch wins the min strictly: then it
    passes no gradient (ratio above 1+ε_high with A > 0, or below 1-ε with A < 0).
    `weights` (B, T), detached: per-token importance weights multiplying each token's term
    (truncated IS against the behaviour policy, `is_weights`); None: 1.
    """
    log_ratio = (logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # (B, T)
    adv = advantages.detach()
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)  # (B, T)
    if weights is not None:
        per_token = per_token * weights.detach()
    loss = masked_mean(per_token, mask, num_tokens)
    metrics = {
        "pg_loss": loss.detach(),
        "clip_frac": masked_mean((clipped < unclipped).float(), mask, num_tokens).detach(),
        "ratio_mean": masked_mean(ratio.detach(), mask, num_tokens),
        "adv_mean": masked_mean(adv, mask, num_tokens),
    }
    return loss, metrics


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float,
    kl_beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    num_tokens: torch.Tensor | float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Token-mean of the (importance-weighted) clipped surrogate plus β·k3 KL to the
    reference; no entropy term.

    All (B, T). `ref_logprobs` is required when `kl_beta` > 0 and ignored otherwise;
    `weights` weigh the surrogate only (the KL is to the reference, not a policy-gradient).
    """
    pg, metrics = clipped_pg_loss(
        logprobs, old_logprobs, advantages, mask, eps_clip, eps_clip_high, num_tokens, weights
    )
    loss = pg
    if kl_beta > 0:
        if ref_logprobs is None:
            raise ValueError("kl_beta > 0 needs the reference model's log-probs")
        kl = masked_mean(k3_kl(logprobs, ref_logprobs), mask, num_tokens)
        loss = pg + kl_beta * kl
        metrics["kl"] = kl.detach()
    metrics["loss"] = loss.detach()
    return loss, metrics
