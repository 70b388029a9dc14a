"""The policy and reference models: loading, optional LoRA, log-probs, and export as an HF folder.

The policy is a transformers causal LM (bf16 on GPU, fp32 on CPU unless told), trained
in full or through LoRA adapters (peft). What leaves the trainer is either a plain HF
folder the engine loads (`save_hf_folder`, in the dtype the engine serves; with LoRA and
merged publishing the deltas are merged into the exported weights without touching the
live model: W + ΔW computed per layer), or with LoRA the adapter itself, a PEFT folder
(`save_adapter_folder`) the engine loads by name beside its base weights.

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
from shared.dtypes import folder_dtype
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


def publish_dtype(name: str, base_model: str | Path | None = None) -> torch.dtype | None:
    """The published weights' dtype for NEXTSTATE_TRAINER__PUBLISH_DTYPE: as named, or for
    auto the dtype served — `base_model`'s folder's, which the engine serves as v0
    (shared/dtypes.py), so v0 and every version have one dtype. None (the trainer's own)
    when the folder names none the trainer can write."""
    served = folder_dtype(Path(base_model)) if base_model is not None else None
    if name != "auto":
        chosen = resolve_dtype(name, torch.device("cpu"))
        if served is not None and name != served:
            log.warning("publishing %s while the engine serves %s's %s as v0: the watcher refuses these "
                        "versions unless NEXTSTATE_WATCHER__SERVED_DTYPE=%s (an engine that casts what it "
                        "loads)", name, base_model, served, name)
        return chosen
    if served is None or served not in ("float32", "bfloat16", "float16"):
        if base_model is not None:
            log.warning("%s does not say its weights' dtype in one the trainer writes (%s): versions are "
                        "published in the trainer's own", base_model, served)
        return None
    return resolve_dtype(served, torch.device("cpu"))


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


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """`state` with its floating tensors in `dtype` (None: as they are); tensors that shared
    storage (tied embeddings) still share it, so they are saved once."""
    if dtype is None:
        return dict(state)
    done: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}

    def cast(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype == dtype:
            return t
        key = (t.data_ptr(), tuple(t.shape))
        if key not in done:
            done[key] = t.to(dtype)
        return done[key]

    return {k: cast(v) for k, v in state.items()}


def save_hf_folder(
    model: Any, state_dict: dict[str, torch.Tensor], dest: Path, static_dir: Path | None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write `state_dict` (in `dtype`, if given) as an HF folder (safetensors + config +
    generation config) into `dest`, plus every file of `static_dir` (the tokenizer).
    `model` gives the structure; the config records the dtype the weights are in."""
    dest.mkdir(parents=True, exist_ok=True)
    plain = model.get_base_model() if is_lora(model) else model
    before = plain.config.dtype
    if dtype is not None:
        plain.config.dtype = dtype
    try:
        plain.save_pretrained(str(dest), state_dict=cast_state(state_dict, dtype), max_shard_size="2GB")
    finally:
        plain.config.dtype = before
    if static_dir is not None:
        for f in static_dir.iterdir():
            if f.is_file() and not (dest / f.name).exists():
                shutil.copy2(f, dest / f.name)


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_targets(state: dict[str, torch.Tensor]) -> list[str]:
    """The module names (q_proj, down_proj, ...) an adapter state dict holds LoRA weights for."""
    return sorted({k.split(".lora_A.")[0].rsplit(".", 1)[-1] for k in state if ".lora_A." in k})


def save_adapter_folder(
    model: Any, state: dict[str, torch.Tensor], dest: Path, base_model: str, dtype: torch.dtype | None = None
) -> None:
    """Write a PEFT adapter folder into `dest`: `adapter_config.json` (the live adapter's
    LoRA config, naming `base_model`) and `adapter_model.safetensors` (`state`, from
    `adapter_state`, in `dtype` if given) — what PEFT, SGLang and vLLM load."""
    import copy as _copy

    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    config = _copy.deepcopy(model.peft_config[ADAPTER])
    config.base_model_name_or_path = base_model
    config.inference_mode = True
    config.save_pretrained(str(dest))
    tensors = {k: v.contiguous() for k, v in cast_state(state, dtype).items()}
    save_file(tensors, str(dest / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def read_adapter_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The adapter state dict of a PEFT adapter folder (`set_peft_model_state_dict` takes it)."""
    from safetensors.torch import load_file

    path = folder / ADAPTER_WEIGHTS
    try:
        return load_file(str(path))
    except Exception as exc:
        raise ModelError(f"cannot read the LoRA adapter {str(path)!r}: {exc}") from exc


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
