"""The policy and reference models: loading, optional LoRA, log-probs, and export as an HF folder.

The policy is a transformers causal LM (bf16 on GPU, fp32 on CPU unless told), trained
in full or through LoRA adapters (peft). Whatever the mode, what leaves the trainer is a
plain HF folder the engine loads: LoRA deltas are merged into the exported weights
without touching the live model (W + ΔW computed per layer), so training goes on
exactly where it was.

The reference for the KL term is the frozen base model: in LoRA mode the policy itself
with its adapters switched off (no second copy), otherwise a separate frozen copy.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.trainer.batching import MicroBatch
from services.trainer.losses import token_logprobs
from shared.errors import NextstateError

log = logging.getLogger(__name__)

ADAPTER = "default"


class ModelError(NextstateError):
    """A model folder cannot be trained from: missing, unreadable, or incomplete."""


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: int
    dropout: float = 0.0
    targets: list[str] | str = "all-linear"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on GPU, fp32 on CPU (CPU bf16 is slow and its log-probs drift from the engine's)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_causal_lm(path: str | Path, device: torch.device, dtype: torch.dtype) -> Any:
    """An HF causal LM from a local folder; refuses folders that would load partly random."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ModelError(f"{str(folder)!r} is not an HF model folder (no config.json)")
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype, local_files_only=True, output_loading_info=True
        )
    except Exception as exc:
        raise ModelError(f"cannot load {str(folder)!r}: {type(exc).__name__}: {exc}") from exc
    model, info = loaded
    missing = sorted(map(str, info.get("missing_keys") or []))
    if missing or info.get("mismatched_keys"):
        raise ModelError(f"{str(folder)!r} is incomplete (missing {missing[:5]})")
    model.to(device)
    model.eval()  # no dropout: log-probs must match the engine's
    return model


def add_lora(model: Any, spec: LoraSpec, adapter_state: dict[str, torch.Tensor] | None = None) -> Any:
    """Wrap `model` with fresh LoRA adapters (or restore saved ones); only they train."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
        target_modules=spec.targets, bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    with warnings.catch_warnings():
        # peft probes a transformers attribute that transformers 5 deprecates.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(model, config)
    if adapter_state is not None:
        result = set_peft_model_state_dict(peft_model, adapter_state)
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise ModelError(f"saved LoRA adapter does not fit this model: {sorted(unexpected)[:5]}")
    peft_model.eval()
    return peft_model


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    state: dict[str, torch.Tensor] = get_peft_model_state_dict(model)
    return state


def is_lora(model: Any) -> bool:
    return hasattr(model, "peft_config")


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def freeze(model: Any) -> Any:
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return model


@contextlib.contextmanager
def adapters_off(model: Any) -> Iterator[Any]:
    """The LoRA model as its base (the reference), for the duration of the block."""
    with model.disable_adapter():
        yield model


def window_logits(model: Any, mb: MicroBatch) -> torch.Tensor:
    """The model's raw logits at the kept positions.  (B, W, V)"""
    logits: torch.Tensor = model(input_ids=mb.input_ids, use_cache=False, logits_to_keep=mb.keep).logits
    return logits


def window_logprobs(model: Any, mb: MicroBatch) -> torch.Tensor:
    """The model's log-probs of `mb.targets` at the kept positions, at each sample's T.  (B, W)"""
    return token_logprobs(window_logits(model, mb), mb.targets, mb.temperature)


# -- export ----------------------------------------------------------------------------------------
def _lora_layers(model: Any) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    return {name: mod for name, mod in base.named_modules() if isinstance(mod, LoraLayer)}


def export_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """A CPU copy of the weights as a plain model names them, LoRA deltas merged.

    Tensors that share storage (tied embeddings) are copied once and stay shared.
    """
    copies: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}

    def cpu_copy(t: torch.Tensor) -> torch.Tensor:
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key not in copies:
            copies[key] = t.detach().to("cpu", copy=True)
        return copies[key]

    with torch.no_grad():
        if not is_lora(model):
            return {k: cpu_copy(v) for k, v in model.state_dict().items()}
        layers = _lora_layers(model)
        out: dict[str, torch.Tensor] = {}
        for key, value in model.get_base_model().state_dict().items():
            if ".lora_" in key:
                continue
            if ".base_layer." not in key:
                out[key] = cpu_copy(value)
                continue
            owner, param = key.split(".base_layer.", 1)
            name = f"{owner}.{param}"
            if param == "weight" and ADAPTER in getattr(layers[owner], "lora_A", {}):
                delta = layers[owner].get_delta_weight(ADAPTER)
                out[name] = (value + delta.to(value.dtype)).detach().to("cpu", copy=True)
            else:
                out[name] = cpu_copy(value)
        return out


def save_hf_folder(
    model: Any, state_dict: dict[str, torch.Tensor], dest: Path, static_dir: Path | None
) -> None:
    """Write `state_dict` as an HF folder (safetensors + config + generation config) into
    `dest`, plus every file of `static_dir` (the tokenizer). `model` gives the structure."""
    dest.mkdir(parents=True, exist_ok=True)
    plain = model.get_base_model() if is_lora(model) else model
    plain.save_pretrained(str(dest), state_dict=dict(state_dict), max_shard_size="2GB")
    if static_dir is not None:
        for f in static_dir.iterdir():
            if f.is_file() and not (dest / f.name).exists():
                shutil.copy2(f, dest / f.name)


def write_tokenizer(source: str | Path, dest: Path) -> Path:
    """Save the tokenizer of `source` (files the engine needs beside the weights) into `dest`."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    except Exception as exc:
        raise ModelError(f"cannot load a tokenizer from {str(source)!r}: {exc}") from exc
    dest.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(dest))
    return dest
