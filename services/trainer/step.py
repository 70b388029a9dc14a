"""One optimizer step on a `TrainBatch`: micro-batches, loss, accumulation, clipping, AdamW.

The batch's loss is the token-mean over every loss-masked token of every sample. It is
split into micro-batches of at most `micro_batch_tokens` padded tokens; each
micro-batch's loss is divided by the *whole batch's* token count, so the accumulated
gradient equals the gradient of one forward over the whole batch.

The loss is the configured one (services/trainer/loss_plugins.py: a built-in or a plugin),
called once per micro-batch with its `LossInputs`. Behaviour log-probs are the engine's (`rollout_logprobs`); a sample without them is
on-policy: its current log-probs, detached, stand in (ratio 1). The reference forward
runs only when β > 0.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.trainer import losses, offpolicy
from services.trainer.batching import MicroBatch, collate, pack, trainable_tokens, trains
from services.trainer.loss_plugins import LossConfig as LossConfig  # re-exported
from services.trainer.loss_plugins import (
    LossInputs,
    Metrics,
    mode_advantages,
    resolve_loss,
)
from services.trainer.model import (
    adapters_off,
    is_lora,
    trainable_parameters,
    window_logits,
    window_logprobs,
)
from services.trainer.precision import (
    MixedPrecisionAdamW,
    collect_grads,
    grad_params,
    needs_masters,
)
from shared.errors import MalformedMessage, NextstateError
from shared.schemas import Mode, TrainSample

log = logging.getLogger(__name__)


class TrainerBroken(NextstateError):
    """The trainer itself cannot train any more (its data-parallel group broke): the service
    stops and the batch is replayed after a restart, rather than failed and retried."""


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0


def make_optimizer(model: Any, cfg: OptimConfig, master_weights: str = "auto") -> Any:
    """AdamW over the trainable parameters; over fp32 masters of them when they are in a
    lower precision (services/trainer/precision.py; MASTER_WEIGHTS=auto|true|false)."""
    params = trainable_parameters(model)
    kwargs = dict(lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    if needs_masters(params, master_weights):
        return MixedPrecisionAdamW(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)  # type: ignore[arg-type]


def batch_tokens(samples: Sequence[TrainSample], mode: Mode) -> float:
    """The batch's token-mean denominator: its trainable tokens, at least 1."""
    return float(max(1, sum(trainable_tokens(s, mode) for s in samples)))


def advantages(mb: MicroBatch, old: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Per-token advantages for the configured mode.  (B, W)"""
    return mode_advantages(
        cfg.mode, mb.rewards, mb.teacher_logprobs, mb.has_teacher, old, cfg.w_rl, cfg.w_opd
    )


class LossPluginError(NextstateError):
    """The configured loss returned something other than (scalar tensor, dict of tensors)."""


def checked(name: str, out: Any) -> tuple[torch.Tensor, Metrics]:
    """What a loss returned, validated: a scalar tensor and a dict of scalar metrics."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor)
            and isinstance(out[1], dict)):  # fmt: skip
        raise LossPluginError(f"loss {name!r} returned {type(out).__name__}: expected (loss, metrics)")
    loss, metrics = out
    if loss.dim() != 0:
        raise LossPluginError(f"loss {name!r} returned a loss of shape {tuple(loss.shape)}, not a scalar")
    return loss, metrics


class Trainer:
    """The policy, its frozen reference (when β > 0) and optimizer; `step` trains one batch."""

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        loss: LossConfig,
        optim: OptimConfig,
        *,
        reference: Any | None = None,
        micro_batch_tokens: int = 8192,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.optim = optim
        self.reference = reference
        self.micro_batch_tokens = micro_batch_tokens
        self.device = torch.device(device)
        self.params = grad_params(optimizer, trainable_parameters(model))  # what is clipped and stepped
        self.loss_fn = resolve_loss(loss.loss_name)  # SettingsError for a bad plugin path
        if loss.kl_beta > 0 and reference is None and not is_lora(model):
            raise ValueError("kl_beta > 0 needs a reference model (or LoRA, whose base is one)")

    def reference_logprobs(self, mb: MicroBatch) -> torch.Tensor | None:
        if self.loss.kl_beta <= 0:
            return None
        with torch.no_grad():
            if self.reference is not None:
                return window_logprobs(self.reference, mb)
            with adapters_off(self.model) as base:
                return window_logprobs(base, mb)

    def accumulate(
        self, samples: Sequence[TrainSample], num_tokens: float | None = None, version: int | None = None
    ) -> dict[str, float]:
        """Forward + backward over micro-batches, leaving the batch's gradient in `.grad`
        (in the fp32 masters' under mixed precision).

        `num_tokens` is the token-mean's denominator: by default these samples' trainable
        tokens; a data-parallel rank passes the whole batch's, so that the ranks' gradients
        (and metrics) add up to the single-process ones (services/trainer/ray_step.py).
        `version` is the version the weights are (for the mismatch figures: samples drawn
        from it; None: no figures).
        """
        mode = self.loss.mode
        if num_tokens is None:
            num_tokens = batch_tokens(samples, mode)
        totals: dict[str, float] = {}
        mismatch: dict[str, float] = {}
        tokens = 0
        for group in pack([len(s.tokens) for s in samples], self.micro_batch_tokens):
            mb = collate([samples[i] for i in group], mode, self.device)
            if mb is None:
                continue
            tokens += mb.real_tokens
            ref = self.reference_logprobs(mb)  # first: its activations are gone before ours exist
            logits = window_logits(self.model, mb)  # (B, W, V)
            logp = losses.token_logprobs(logits, mb.targets, mb.temperature)  # (B, W)
            behaviour = torch.where(mb.has_old[:, None], mb.old_logprobs, logp.detach())
            inputs, counts = self.corrected(mb, logits, logp, behaviour, ref, num_tokens, version, mismatch)
            loss, metrics = checked(self.loss.loss_name, self.loss_fn(inputs, self.loss))
            loss.backward()  # type: ignore[no-untyped-call]
            collect_grads(self.optimizer)
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v)
            for k, c in counts.items():
                totals[k] = totals.get(k, 0.0) + c
        totals.update(mismatch)
        totals["tokens"] = float(tokens)
        totals["train_tokens"] = num_tokens
        return totals

    def corrected(
        self, mb: MicroBatch, logits: torch.Tensor, logp: torch.Tensor, behaviour: torch.Tensor,
        ref: torch.Tensor | None, num_tokens: float, version: int | None, mismatch: dict[str, float],
    ) -> tuple[LossInputs, dict[str, float]]:
        """The loss's inputs with the off-policy correction (services/trainer/offpolicy.py)
        applied, and the micro-batch's counts: samples off the trainer's version, samples
        with a truncated weight, samples masked out as too divergent."""
        cfg = self.loss
        log_rho = offpolicy.log_ratio(logp, behaviour, mb.has_old)  # (B, W)
        if version is not None and mb.policy_version is not None:
            same = mb.has_old & (mb.policy_version == version)
            offpolicy.merge_sums(mismatch, offpolicy.mismatch_sums(
                log_rho, mb.mask, same, cfg.eps_clip, cfg.eps_clip_high))
        if bool(mb.has_old.any()):  # the step's most divergent sample: what MAX_SAMPLE_KL is set against
            kl = float(offpolicy.sample_kl(log_rho, mb.mask)[mb.has_old].max())
            offpolicy.merge_sums(mismatch, {"sample_kl_max": kl})
        drop = offpolicy.divergent(log_rho, mb.mask, mb.has_old, cfg.max_sample_kl)
        mask = mb.mask * (~drop)[:, None].to(mb.mask.dtype)
        counts = {"divergent_samples": float(drop.sum())}
        if version is not None and mb.policy_version is not None:
            counts["offpolicy_samples"] = float((mb.has_old & (mb.policy_version != version)).sum())
        weights = None
        old = behaviour
        if cfg.is_correction == "tis":
            weights = offpolicy.truncated_weights(log_rho, cfg.is_cap)
            old = logp.detach()
            truncated = (torch.exp(log_rho) > cfg.is_cap) & mask.bool()
            counts["truncated_samples"] = float(truncated.any(-1).sum())
            counts["is_weight_mean"] = float(losses.masked_mean(weights, mask, num_tokens))
            counts["is_truncated_frac"] = float(losses.masked_mean(truncated.float(), mask, num_tokens))
        inputs = LossInputs(
            tokens=mb.input_ids, targets=mb.targets, mask=mask, logits=logits,
            temperature=mb.temperature, logprobs=logp, old_logprobs=old, ref_logprobs=ref,
            teacher_logprobs=mb.teacher_logprobs, has_teacher=mb.has_teacher,
            rewards=mb.rewards, advantages=advantages(mb, behaviour, cfg).detach(),
            num_tokens=num_tokens, teacher_topk_ids=mb.teacher_topk_ids,
            teacher_topk_logprobs=mb.teacher_topk_logprobs, has_topk=mb.has_topk,
            is_weights=weights, behaviour_logprobs=behaviour,
        )  # fmt: skip
        return inputs, counts

    def step(self, samples: Sequence[TrainSample], version: int = 0) -> dict[str, float]:
        """Train on one batch; return its metrics (`version`: the trainer's, for staleness)."""
        started = time.perf_counter()
        self.check_vocab(samples)
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.accumulate(samples, version=version)
        sums = {k: metrics.pop(k) for k in list(metrics) if k in offpolicy.SUM_KEYS}
        metrics.update(offpolicy.mismatch_metrics(sums))
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.optim.grad_clip))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:  # one bad batch must not poison the weights
            log.warning("non-finite gradient norm, step skipped", extra={"grad_norm": grad_norm})
        self.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - started
        metrics.update(
            grad_norm=grad_norm,
            step_seconds=seconds,
            tokens_per_s=metrics["tokens"] / seconds if seconds > 0 else 0.0,
            reward_mean=sum(s.reward for s in samples) / len(samples),
            staleness=sum(version - s.policy_version for s in samples) / len(samples),
            staleness_max=float(max(version - s.policy_version for s in samples)),
            samples=float(len(samples)),
            skipped_samples=float(sum(not trains(s, self.loss.mode) for s in samples)),
            skipped_step=0.0 if math.isfinite(grad_norm) else 1.0,
        )
        return metrics

    def check_vocab(self, samples: Sequence[TrainSample]) -> None:
        """Refuse token ids outside the model's vocabulary before touching any weight."""
        vocab = int(self.model.get_input_embeddings().weight.shape[0])
        for s in samples:
            bad = [t for t in s.tokens if not 0 <= t < vocab]
            if bad:
                raise MalformedMessage(
                    f"sample {s.id} has token ids outside the vocabulary (size {vocab}): {bad[:5]}"
                )
