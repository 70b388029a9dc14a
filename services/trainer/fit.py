"""Fitting the trainer to its device: the memory plan at start, and the switches it turns.

Before any weight is loaded, `layout` reads the model's config.json, works out the memory
plan (services/trainer/memory.py) and decides

    activation checkpointing   NEXTSTATE_TRAINER__GRADIENT_CHECKPOINTING=auto|true|false;
                               auto: on above CHECKPOINTING_ABOVE parameters, or when the
                               plan without it does not fit the device's free memory
    the KL reference           NEXTSTATE_TRAINER__REFERENCE_OFFLOAD=auto|true|false (full
                               fine-tuning with KL_BETA > 0); auto: resident on the device
                               when the plan with it fits, else streamed from the CPU
                               (services/trainer/reference.py)

then logs the plan ("memory plan: ...") and, on CUDA, refuses to start with a `DoesNotFit`
that names the settings that would fit (a smaller micro-batch, checkpointing, the reference
offloaded, LoRA) when the plan exceeds the free memory.

CHECKPOINTING_ABOVE = 3e9: recomputing each layer in the backward costs about a third
more compute (one more forward of the layers), which buys nothing where the activations
fit anyway. By the plan, at the default 8,192-token micro-batch Qwen3-1.7B's full
fine-tuning without checkpointing peaks at 62 GiB (fits an 80 GB card) and Qwen3-4B's at
128 GiB (fits no single card), 48 GiB of it activations: above 3B parameters the
activations of a default micro-batch outgrow any one card's room beside the optimizer
state, so checkpointing is on whatever the device says; below, the free-memory rule
turns it on only where it is needed (a 24 GB card, a long micro-batch).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.trainer.memory import DoesNotFit, GiB, Lora, Plan, Shape, advice, needs, plan
from services.trainer.settings import TrainerConfig

log = logging.getLogger(__name__)

CHECKPOINTING_ABOVE = 3_000_000_000  # parameters (see the module docstring)
LEAST_MICRO_BATCH = 256  # the smallest micro-batch the advice proposes
ADVICE_LORA_RANK = 16


@dataclass(frozen=True)
class Layout:
    plan: Plan | None  # None: an architecture the plan does not know
    checkpointing: bool
    reference: str  # none | device | streamed


def model_shape(path: str | Path) -> Shape | None:
    """The shape of the model in HF folder `path`, from its config.json alone; None when
    it is not a decoder the plan knows (or not readable: loading the model says why)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
        return Shape.from_config(config.get("text_config") or config)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def free_memory(device: torch.device) -> int | None:
    """Bytes free on a CUDA device now; None elsewhere (the host's memory is not planned)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def _fits(p: Plan, free: int | None) -> bool:
    return free is None or needs(p.peak) <= free


def layout(
    cfg: TrainerConfig, shape: Shape, dtype: torch.dtype, free: int | None, separate_reference: bool
) -> Layout:
    """The plan and the switches for `cfg` on a device with `free` bytes (None: not planned);
    `separate_reference`: the KL reference is a frozen copy of the base (full fine-tuning
    with KL_BETA > 0). Raises DoesNotFit when nothing configured fits."""
    e = torch.empty((), dtype=dtype).element_size()
    lora = Lora.of(cfg.lora_rank, cfg.lora_targets) if cfg.lora else None
    master = {"true": True, "false": False}.get(cfg.master_weights, e < 4)  # precision.py's rule

    def plan_of(checkpointing: bool, reference: str, tokens: int = cfg.micro_batch_tokens,
                lora: Lora | None = lora) -> Plan:  # fmt: skip
        return plan(shape, e=e, tokens=tokens, lora=lora, master_weights=master,
                    checkpointing=checkpointing, reference=reference if separate_reference else "none")

    leanest = "streamed" if cfg.reference_offload != "false" else "device"
    if cfg.gradient_checkpointing == "auto":
        checkpointing = shape.params() > CHECKPOINTING_ABOVE or not _fits(plan_of(False, leanest), free)
    else:
        checkpointing = cfg.gradient_checkpointing == "true"
    if not separate_reference:
        reference = "none"
    elif cfg.reference_offload == "auto":
        reference = "device" if _fits(plan_of(checkpointing, "device"), free) else "streamed"
    else:
        reference = "streamed" if cfg.reference_offload == "true" else "device"
    chosen = plan_of(checkpointing, reference)
    if free is not None and not _fits(chosen, free):
        raise DoesNotFit(advice(chosen, free, alternatives(cfg, plan_of, free, checkpointing, reference)))
    return Layout(chosen, checkpointing, reference)


def alternatives(cfg: TrainerConfig, plan_of: Any, free: int, checkpointing: bool, reference: str) -> dict[str, Plan]:
    """Settings that change the plan, each with its plan: the advice keeps those that fit."""
    var = "NEXTSTATE_TRAINER__"
    out: dict[str, Plan] = {}
    switches = []
    if not checkpointing:
        switches.append(f"{var}GRADIENT_CHECKPOINTING=true")
        out[switches[-1]] = plan_of(True, reference)
    if reference == "device":
        switches.append(f"{var}REFERENCE_OFFLOAD=true")
        out[switches[-1]] = plan_of(checkpointing, "streamed")
    lean = (True, "streamed" if reference != "none" else "none")  # both switches on
    if len(switches) > 1:
        out[" ".join(switches)] = plan_of(*lean)
    tokens = cfg.micro_batch_tokens // 2
    while tokens >= LEAST_MICRO_BATCH and not _fits(plan_of(*lean), free):  # then a shorter micro-batch
        smaller: Plan = plan_of(*lean, tokens=tokens)
        if _fits(smaller, free):
            out[" ".join([f"{var}MICRO_BATCH_TOKENS={tokens}", *switches])] = smaller
            break
        tokens //= 2
    if not cfg.lora:
        out[f"{var}LORA=true (rank {ADVICE_LORA_RANK})"] = plan_of(True, "none", lora=Lora(ADVICE_LORA_RANK))
    return out


def plan_start(cfg: TrainerConfig, device: torch.device, dtype: torch.dtype, separate_reference: bool) -> Layout:
    """The layout for this trainer, logged; raises DoesNotFit on a device it cannot fit."""
    free, shape = free_memory(device), model_shape(cfg.model)
    if shape is None:
        log.warning("no memory plan: %s is not a decoder whose config the plan reads", cfg.model)
        reference = "none" if not separate_reference else "streamed" if cfg.reference_offload == "true" else "device"
        return Layout(None, cfg.gradient_checkpointing == "true", reference)
    chosen = layout(cfg, shape, dtype, free, separate_reference)
    planned = chosen.plan
    if planned is not None:
        log.info("memory plan: %s", planned.describe(), extra={
            "peak_gib": round(planned.peak / GiB, 2), "checkpointing": chosen.checkpointing,
            "reference": chosen.reference, "free_gib": None if free is None else round(free / GiB, 2)})
    return chosen


def enable_activation_checkpointing(model: Any) -> None:
    """Recompute each decoder layer in the backward instead of keeping its activations.

    transformers checkpoints a layer only in training mode; the trainer keeps its model in
    eval mode (no dropout, so that its log-probs are the engine's), so only the layers
    themselves are marked training: the modules inside them (dropout, attention) stay in
    eval. Non-reentrant checkpointing needs no input that requires grad, so LoRA (frozen
    embeddings) works as is; transformers still adds the hook that would make it."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    enable = getattr(base, "activation_checkpointing_enable", None)
    if enable is not None:  # transformers >= 5
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in base.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module.training = True
