"""LoRA adapters served beside the base weights, loaded and unloaded by name, per request.

An adapter is a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`), as
the trainer publishes each version with LoRA on. `read_adapter` loads and checks one
against the served model (every module it names is a linear layer of that model, every
A is (r, in) and B (out, r), the rank within `max_rank`, nothing but plain LoRA: no DoRA,
no per-module ranks, no extra trained modules) — or raises `AdapterError` saying why.

Serving: the first adapter that targets a linear layer replaces it by a `LoraLinear`,
which holds the same parameters under the same names (state dict and full-weight loads
see no difference) and adds, for each row of the batch, the update of the adapter that
row's request uses:

    y = W x + b + B (A x) · alpha / r          (PEFT's own order of operations)

The rows' adapters are the `LoraContext` the model thread sets around each forward (a
prefill: the request's; a decode step: one per member of the batch). A request holds its
`Adapter` object from admission to its end, so unloading an adapter only stops new
requests from taking it: those running finish on it, and its tensors are freed with the
last of them. Without adapters every `LoraLinear` is a plain linear layer.

Why not peft in the engine: the per-row selection over a shared decode batch, and the
engine's image without peft. The arithmetic is PEFT's, so the trainer recomputes the
engine's log-probs of a base + adapter exactly as for full weights.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.errors import ModelLoadError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


class AdapterError(ModelLoadError):
    """An adapter folder that cannot be served on this model (the message says why)."""


@dataclass(frozen=True, eq=False)
class Adapter:
    """One loaded adapter: per target module, its A (r, in) and B (out, r)."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def modules(self) -> list[str]:
        return sorted(self.weights)


@dataclass
class LoraContext:
    """Which adapter each row of the forward being run uses (set by the model thread)."""

    rows: Sequence[Adapter | None] = ()


class LoraLinear(nn.Linear):
    """A served linear layer (same weight and bias objects) plus per-row LoRA updates."""

    def __init__(self, base: nn.Linear, name: str, ctx: LoraContext) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.lora_name = name
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        rows = self.ctx.rows
        if not rows or all(a is None for a in rows):
            return out
        first = rows[0]
        if all(a is first for a in rows):
            assert first is not None
            return out + self._update(first, x) if self.lora_name in first.weights else out
        if len(rows) != x.shape[0]:
            raise RuntimeError(f"{len(rows)} row adapters for a batch of {x.shape[0]}")
        groups: dict[int, tuple[Adapter, list[int]]] = {}
        for i, a in enumerate(rows):
            if a is not None and self.lora_name in a.weights:
                groups.setdefault(id(a), (a, []))[1].append(i)
        for adapter, idx in groups.values():
            index = torch.tensor(idx, dtype=torch.long, device=x.device)
            out = out.index_add(0, index, self._update(adapter, x.index_select(0, index)))
        return out

    def _update(self, adapter: Adapter, x: torch.Tensor) -> torch.Tensor:
        a, b = adapter.weights[self.lora_name]
        return F.linear(F.linear(x, a), b) * adapter.scaling


def attach(model: nn.Module, modules: Iterable[str], ctx: LoraContext) -> None:
    """Make each named linear layer of `model` a `LoraLinear` (once; the rest as they are)."""
    for name in modules:
        module = model.get_submodule(name)
        if isinstance(module, LoraLinear) or not isinstance(module, nn.Linear):
            continue  # read_adapter admits linear layers only
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoraLinear(module, name, ctx))


def _config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / CONFIG).read_text())
    except FileNotFoundError:
        raise AdapterError(f"{str(folder)!r} has no {CONFIG}: not a PEFT adapter folder") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{folder / CONFIG} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{folder / CONFIG} is not a JSON object")
    unsupported = [
        what for what, bad in (
            (f"peft_type {config.get('peft_type')!r}", config.get("peft_type", "LORA") != "LORA"),
            ("use_dora", bool(config.get("use_dora"))),
            (f"bias {config.get('bias')!r}", config.get("bias", "none") != "none"),
            ("modules_to_save", bool(config.get("modules_to_save"))),
            ("rank_pattern", bool(config.get("rank_pattern"))),
            ("alpha_pattern", bool(config.get("alpha_pattern"))),
            ("trainable_token_indices", bool(config.get("trainable_token_indices"))),
            ("fan_in_fan_out", bool(config.get("fan_in_fan_out"))),
        ) if bad
    ]  # fmt: skip
    if unsupported:
        raise AdapterError(f"{folder.name}: this engine serves plain LoRA adapters only, not "
                           f"{', '.join(unsupported)}")
    return config


def read_adapter(name: str, path: str, model: nn.Module, *, max_rank: int) -> Adapter:
    """Load the adapter folder `path` for `model` (its dtype and device), or raise `AdapterError`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"adapter folder {path!r} does not exist")
    config = _config(folder)
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        raise AdapterError(f"{folder.name}: {CONFIG} names no r and lora_alpha") from None
    if not 1 <= rank <= max_rank:
        raise AdapterError(f"{folder.name}: rank {rank} is above this engine's maximum {max_rank} "
                           "(NEXTSTATE_ENGINE__MAX_LORA_RANK)")
    if not (folder / WEIGHTS).is_file():
        raise AdapterError(f"{str(folder)!r} has no {WEIGHTS}")
    try:
        tensors = load_file(str(folder / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(f"{folder.name}/{WEIGHTS} cannot be read: {exc}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}.weight"
            if key.startswith(PREFIX) and key.endswith(marker):
                pairs.setdefault(key[len(PREFIX):-len(marker)], {})[part] = tensor
                break
        else:
            raise AdapterError(f"{folder.name}: unexpected tensor {key!r} (only LoRA A and B matrices are served)")
    if not pairs:
        raise AdapterError(f"{folder.name}/{WEIGHTS} holds no LoRA weights")
    reference = next(iter(model.parameters()))
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module_name, ab in sorted(pairs.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{folder.name}: {module_name} has only {', '.join(sorted(ab))}")
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            raise AdapterError(f"{folder.name}: the served model has no module {module_name!r}") from None
        if not isinstance(module, nn.Linear):
            raise AdapterError(f"{folder.name}: {module_name} is a {type(module).__name__}, not a linear layer")
        a, b = ab["lora_A"], ab["lora_B"]
        want_a, want_b = (rank, module.in_features), (module.out_features, rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterError(f"{folder.name}: {module_name} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                               f"this model needs {want_a} and {want_b}")
        weights[module_name] = (a.to(reference.device, reference.dtype).contiguous(),
                                b.to(reference.device, reference.dtype).contiguous())
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return Adapter(name=name, path=str(folder), rank=rank, scaling=scaling, weights=weights)
