"""Assemble the trainer from its configuration and a resume point (models, optimizer, RNG).

Full fine-tuning resumes from the committed version's weights; LoRA resumes from the
base model plus the version's adapter (its own when published as one, else the one its
record keeps: merged weights cannot give it back). The optimizer and RNG come from the
newest resume state of the version's lineage when there is one (services/trainer/resume.py),
loaded after the weights; one that does not fit the model (LoRA switched on or off, another
base) stops the start with an error saying so rather than training from a mismatch.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from services.trainer.fit import enable_activation_checkpointing, plan_start
from services.trainer.model import (
    LoraSpec,
    ModelError,
    add_lora,
    load_causal_lm,
    resolve_device,
    resolve_dtype,
)
from services.trainer.reference import load_reference
from services.trainer.resume import ResumePoint, published_adapter
from services.trainer.settings import TrainerConfig
from services.trainer.step import LossConfig, OptimConfig, Trainer, make_optimizer
from services.trainer.trainer_state import restore_rng

log = logging.getLogger(__name__)


def loss_config(cfg: TrainerConfig) -> LossConfig:
    return LossConfig(
        mode=cfg.loss_mode, w_rl=cfg.w_rl, w_opd=cfg.w_opd, eps_clip=cfg.eps_clip,
        eps_clip_high=cfg.eps_clip_high, kl_beta=cfg.kl_beta, loss=cfg.loss,
        options=dict(cfg.loss_options), is_correction=cfg.is_correction, is_cap=cfg.is_cap,
        max_sample_kl=cfg.max_sample_kl,
    )  # fmt: skip


def optim_config(cfg: TrainerConfig) -> OptimConfig:
    return OptimConfig(
        lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas, eps=cfg.adam_eps,
        grad_clip=cfg.grad_clip,
    )  # fmt: skip


def lora_spec(cfg: TrainerConfig) -> LoraSpec:
    return LoraSpec(rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                    targets=cfg.lora_targets)


def build_trainer(cfg: TrainerConfig, resume: ResumePoint) -> Trainer:
    """Load the policy (and reference), build AdamW, restore the trainer state if any."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    tensors = resume.tensors or {}
    adapter = tensors.get("adapter") or published_adapter(resume)
    if not cfg.lora and resume.manifest is not None and resume.manifest.format == "adapter":
        raise ModelError(f"v{resume.version} is a LoRA adapter but LoRA is off: set "
                         "NEXTSTATE_TRAINER__LORA=true, or start a new run")
    separate_reference = cfg.kl_beta > 0 and not (cfg.lora and (adapter is not None or resume.model_dir is None))
    fitted = plan_start(cfg, device, dtype, separate_reference)  # logged; DoesNotFit before any load
    if cfg.lora and adapter is not None:
        policy: Any = add_lora(load_causal_lm(cfg.model, device, dtype), lora_spec(cfg), adapter)
        base_is_reference = True
    else:
        if adapter is not None:
            raise ModelError("the trainer state holds a LoRA adapter but LoRA is off: set "
                             "NEXTSTATE_TRAINER__LORA=true, or start a new run")
        policy = load_causal_lm(resume.model_dir or cfg.model, device, dtype)
        base_is_reference = resume.model_dir is None
        if cfg.lora:
            policy = add_lora(policy, lora_spec(cfg))
    if fitted.checkpointing:
        enable_activation_checkpointing(policy)
    reference = None
    if cfg.kl_beta > 0 and not (cfg.lora and base_is_reference):
        reference = load_reference(cfg.model, device, dtype, streamed=fitted.reference == "streamed")
    optimizer = make_optimizer(policy, optim_config(cfg), cfg.master_weights)
    if "optimizer" in tensors:
        try:
            optimizer.load_state_dict(tensors["optimizer"])
        except (ValueError, KeyError) as exc:
            raise ModelError(f"the saved optimizer state does not fit this model ({exc}); "
                             "was the run started with other LoRA settings?") from exc
        for group in optimizer.param_groups:  # the configuration wins over the saved values
            group.update(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas, eps=cfg.adam_eps)
        restore_rng(tensors["rng"])
    log.info("trainer ready", extra={
        "version": resume.version, "step": resume.step, "device": str(device), "dtype": str(dtype),
        "lora": cfg.lora, "reference": "separate" if reference is not None else (
            "adapters off" if cfg.kl_beta > 0 else "none"),
        "trainable_params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
        "optimizer": "restored" if "optimizer" in tensors else "fresh",
        "master_weights": type(optimizer).__name__ == "MixedPrecisionAdamW"})
    return Trainer(
        policy, optimizer, loss_config(cfg), optim_config(cfg), reference=reference,
        micro_batch_tokens=cfg.micro_batch_tokens, device=device,
    )  # fmt: skip
