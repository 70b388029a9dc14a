"""Loading an HF causal LM for serving, checking a new checkpoint fits, and one forward step.

`load_model` refuses anything that would serve silently wrong weights: a missing
folder, a checkpoint that fails to deserialize (truncated safetensors), or one that
leaves parameters missing or mis-shaped (transformers would initialise those randomly
and only warn). `incompatible` says why a new checkpoint cannot replace the served one
(another architecture, vocabulary or shape): the tokenizer and every client's token ids
stay valid only if those agree.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.engine.errors import ModelLoadError
from services.engine.lora import LoraContext

log = logging.getLogger(__name__)

# Config fields that must agree for a checkpoint to replace the served one.
_SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
    "tie_word_embeddings",
)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype | str:
    if name == "auto":
        # float32 on CPU: exact log-probs matter more here than speed.
        return torch.float32 if device.type == "cpu" else "auto"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


@dataclass
class LoadedModel:
    """One set of weights ready to serve, and how to call its forward (with the LoRA
    adapter of each row, when adapters are loaded: services/engine/lora.py)."""

    model: Any
    path: str
    device: torch.device
    cache_arg: str  # "cache" (transformers >= 5.x) or "past_key_values"
    logits_to_keep: bool
    lora: LoraContext = field(default_factory=LoraContext)  # the rows' adapters of the forward being run

    @contextlib.contextmanager
    def adapters(self, rows: Sequence[Any]) -> Iterator[None]:
        """Run the forwards in the block with `rows[i]` (an Adapter or None) for row i."""
        self.lora.rows = rows
        try:
            yield
        finally:
            self.lora.rows = ()

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def context_length(self) -> int:
        cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        return int(getattr(cfg, "max_position_embeddings", 0) or 4096)

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.config)
        except TypeError:  # older transformers
            return DynamicCache()

    def forward(self, ids: list[int], cache: Any, keep: int, adapter: Any = None) -> torch.Tensor:
        """Run `ids` after what `cache` holds (with `adapter`, a LoRA Adapter or None);
        return the last `keep` logits rows.  (keep, V) f32 cpu"""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {self.cache_arg: cache, "use_cache": True}
        if self.logits_to_keep:
            kwargs["logits_to_keep"] = keep
        with torch.inference_mode(), self.adapters((adapter,) if adapter is not None else ()):
            out = self.model(input_ids=x, **kwargs)
            logits: torch.Tensor = out.logits[0, -keep:, :]
            return logits.float().cpu()


def load_model(path: str, device: torch.device, dtype: str) -> LoadedModel:
    """Load an HF folder for inference, or raise `ModelLoadError` saying what is wrong."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelLoadError(f"model folder {path!r} does not exist")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{path!r} has no config.json: not an HF model folder")
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            str(folder),
            dtype=resolve_dtype(dtype, device),
            output_loading_info=True,
            local_files_only=True,
        )
    except Exception as exc:
        raise ModelLoadError(f"cannot load {path!r}: {type(exc).__name__}: {exc}") from exc
    model, info = loaded
    problems = []
    for key in ("missing_keys", "mismatched_keys", "error_msgs"):
        found = info.get(key) or []
        if found:
            problems.append(f"{key.replace('_', ' ')}: {', '.join(sorted(map(str, found))[:5])}")
    if problems:
        raise ModelLoadError(f"checkpoint {path!r} is incomplete ({'; '.join(problems)})")
    model.to(device)
    model.eval()
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    return LoadedModel(model, str(folder), device, cache_arg, "logits_to_keep" in params)


def incompatible(current: LoadedModel, new: LoadedModel) -> str | None:
    """Why `new` cannot replace `current` (None: it can)."""
    a, b = type(current.model).__name__, type(new.model).__name__
    if a != b:
        return f"architecture differs: serving {a}, checkpoint is {b}"
    for name in _SHAPE_FIELDS:
        x, y = getattr(current.config, name, None), getattr(new.config, name, None)
        if x != y:
            return f"{name} differs: serving {x}, checkpoint has {y}"
    if current.vocab_size != new.vocab_size:
        return f"vocabulary differs: serving {current.vocab_size}, checkpoint has {new.vocab_size}"
    old_shapes = {k: tuple(v.shape) for k, v in current.model.state_dict().items()}
    new_shapes = {k: tuple(v.shape) for k, v in new.model.state_dict().items()}
    if old_shapes != new_shapes:
        diff = sorted(set(old_shapes.items()) ^ set(new_shapes.items()))[:3]
        return f"parameter shapes differ: {diff}"
    return None


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {exc}") from exc
