"""The loss interface: what a loss sees, the registry of losses, and plugins by module path.

`NEXTSTATE_TRAINER__LOSS` names the loss the trainer minimises: a registered name (`rl`,
`opd`, `combine`, `opd_topk`; unset: the one named by `LOSS_MODE`) or a plugin
`package.module:function`. Every loss, built-in or not, has one signature:

    def my_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]

It gets one micro-batch (`LossInputs`, below: tokens, masks, the current log-probs and
logits, behaviour / reference / teacher log-probs, rewards and the mode's advantages)
and the trainer's loss settings (`LossConfig`, with the plugin's own
`NEXTSTATE_TRAINER__LOSS_OPTIONS`), and returns the scalar to backpropagate and its
metrics. Both must be *sums over micro-batches*: divide token sums by
`inputs.num_tokens` (the whole batch's trainable tokens: `losses.masked_mean(...,
inputs.num_tokens)`), never by the micro-batch's own count, so that the accumulated
gradient is that of the batch's token-mean and the metrics add up. Metrics are detached
scalars; each appears on the step's metrics (the service's log, the checkpoint manifest)
under its name. Which samples reach the loss is still `LOSS_MODE`'s rule (opd: only those
with teacher log-probs).

`opd_topk` distils the teacher's top-K distribution (TrainSample.teacher_topk_*): reverse
KL(student || teacher) over those K tokens plus a tail bin; it needs LOSS_MODE=opd. The
built-ins `rl`, `opd` and `combine` share one objective, the clipped surrogate plus
β·k3 KL to the reference (losses.policy_loss) on the advantages of their mode; they are
registered here like any plugin. A plugin path that does not import, or names nothing
callable, is refused when the trainer starts (`SettingsError`, exit code 2).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from services.trainer import losses
from shared.errors import SettingsError
from shared.schemas import Mode

Metrics = dict[str, torch.Tensor]


@dataclass(frozen=True)
class LossConfig:
    mode: Mode = "rl"
    w_rl: float = 1.0
    w_opd: float = 1.0
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    kl_beta: float = 0.02
    # Off-policy correction (services/trainer/offpolicy.py): tis weighs each token's term by
    # min(π_old/π_b, is_cap) and takes the ratio against π_old; off: the ratio against π_b.
    is_correction: str = "tis"
    is_cap: float = 2.0
    max_sample_kl: float | None = None  # samples more divergent than this are not trained (None: all train)
    loss: str | None = None  # a registered name or module:function; None: `mode`'s built-in
    options: Mapping[str, Any] = field(default_factory=dict)  # NEXTSTATE_TRAINER__LOSS_OPTIONS

    @property
    def loss_name(self) -> str:
        return self.loss or self.mode


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch as a loss sees it. B samples, L tokens, W window positions, V the
    vocabulary, K the teacher's top-K. Column w of every (B, W) tensor is the prediction,
    made at position `start + w`, of token `targets[:, w]` (services/trainer/batching.py)."""

    tokens: torch.Tensor  # (B, L) long: prompt + response ids, right-padded
    targets: torch.Tensor  # (B, W) long: the token each window position predicts
    mask: torch.Tensor  # (B, W) float 0/1: the response tokens that train
    logits: torch.Tensor  # (B, W, V) the policy's raw logits (with gradient)
    temperature: torch.Tensor  # (B,) log-probs are at this T (losses.logprob_temperature)
    logprobs: torch.Tensor  # (B, W) log-probs of `targets` at T (with gradient)
    # (B, W) the ratio's denominator: with IS_CORRECTION=tis the trainer's own log-probs before
    # this step (detached), else the behaviour log-probs (the current ones, detached, if none)
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None  # (B, W) the frozen reference's; None when kl_beta = 0
    teacher_logprobs: torch.Tensor  # (B, W) 0 where `has_teacher` is False
    has_teacher: torch.Tensor  # (B,) bool
    rewards: torch.Tensor  # (B,) float in [-1, 1]
    advantages: torch.Tensor  # (B, W) the LOSS_MODE's advantages, detached
    num_tokens: float  # the denominator of every token-mean (the whole batch's)
    teacher_topk_ids: torch.Tensor | None = None  # (B, W, K) long; None: no sample has them
    teacher_topk_logprobs: torch.Tensor | None = None  # (B, W, K)
    has_topk: torch.Tensor | None = None  # (B,) bool
    # (B, W) truncated importance weights min(π_old/π_b, C), detached; None: IS_CORRECTION=off
    is_weights: torch.Tensor | None = None
    behaviour_logprobs: torch.Tensor | None = None  # (B, W) the engine's (= old_logprobs when off)


LossFn = Callable[[LossInputs, LossConfig], tuple[torch.Tensor, Metrics]]


def clipped_with_kl(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """The built-in objective of rl, opd and combine: clipped surrogate + β·k3 KL."""
    return losses.policy_loss(
        inputs.logprobs, inputs.old_logprobs, inputs.advantages, inputs.mask,
        eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, kl_beta=cfg.kl_beta,
        ref_logprobs=inputs.ref_logprobs, num_tokens=inputs.num_tokens, weights=inputs.is_weights,
    )  # fmt: skip


LOSSES: dict[str, LossFn] = {}


def register(name: str, fn: LossFn) -> LossFn:
    """Make `fn` available as NEXTSTATE_TRAINER__LOSS=`name`."""
    if name in LOSSES and LOSSES[name] is not fn:
        raise ValueError(f"a loss named {name!r} is already registered")
    LOSSES[name] = fn
    return fn


for _mode in ("rl", "opd", "combine"):
    register(_mode, clipped_with_kl)


def opd_topk(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
    """Top-K on-policy distillation: token-mean of reverse KL(student || teacher) over the
    teacher's top-K tokens plus a tail bin (losses.topk_reverse_kl), + β·k3 KL to the
    reference. The student's distribution is log_softmax(logits / T) at the sample's T.
    Tokens of samples without a top-K contribute nothing (`topk_tokens` counts the rest)."""
    if inputs.teacher_topk_ids is None or inputs.teacher_topk_logprobs is None or inputs.has_topk is None:
        zero = (inputs.logits.sum() * 0.0)  # no sample has a top-K: no signal, a graph still
        return zero, {"topk_kl": zero.detach(), "topk_tokens": zero.detach(), "loss": zero.detach()}
    t = losses.logprob_temperature(inputs.temperature.float())
    student = torch.log_softmax(inputs.logits.float() / t[:, None, None], dim=-1)  # (B, W, V)
    per_token = losses.topk_reverse_kl(student, inputs.teacher_topk_ids, inputs.teacher_topk_logprobs)
    mask = inputs.mask * inputs.has_topk[:, None].to(inputs.mask.dtype)  # (B, W)
    kl_teacher = losses.masked_mean(per_token, mask, inputs.num_tokens)
    loss = kl_teacher
    metrics = {"topk_kl": kl_teacher.detach(), "topk_tokens": mask.sum().detach()}
    if cfg.kl_beta > 0:
        if inputs.ref_logprobs is None:
            raise ValueError("kl_beta > 0 needs the reference model's log-probs")
        kl = losses.masked_mean(losses.k3_kl(inputs.logprobs, inputs.ref_logprobs), mask, inputs.num_tokens)
        loss = loss + cfg.kl_beta * kl
        metrics["kl"] = kl.detach()
    metrics["loss"] = loss.detach()
    return loss, metrics


register("opd_topk", opd_topk)


def mode_advantages(
    mode: Mode, rewards: torch.Tensor, teacher: torch.Tensor, has_teacher: torch.Tensor,
    old: torch.Tensor, w_rl: float, w_opd: float,
) -> torch.Tensor:
    """The advantages of `mode` (losses.py): rl A = r, opd A = teacher - old, combine both.  (B, W)"""
    if mode == "rl":
        return losses.rl_advantages(rewards, old)
    if mode == "opd":  # samples without teacher log-probs are masked out in collate
        return losses.opd_advantages(teacher, old)
    return losses.combined_advantages(teacher, old, rewards, w_opd, w_rl, has_teacher)


def resolve_loss(spec: str) -> LossFn:
    """The loss named `spec`: a registered name or `module:function` (function may be dotted)."""
    if ":" not in spec:
        if spec not in LOSSES:
            raise SettingsError(
                f"NEXTSTATE_TRAINER__LOSS={spec!r}: not a registered loss ({', '.join(sorted(LOSSES))}) "
                "nor a plugin as module:function"
            )
        return LOSSES[spec]
    module_name, _, attr = spec.partition(":")
    where = f"NEXTSTATE_TRAINER__LOSS={spec!r}"
    if not module_name or not attr:
        raise SettingsError(f"{where}: expected module:function")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise SettingsError(f"{where}: cannot import {module_name!r} ({exc}); is it on PYTHONPATH?") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SettingsError(f"{where}: {module_name!r} has no {attr!r}") from None
    if not callable(obj):
        raise SettingsError(f"{where}: {attr!r} is a {type(obj).__name__}, not a function")
    fn: LossFn = obj
    return fn
