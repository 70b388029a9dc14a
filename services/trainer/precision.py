"""Mixed precision that learns: low-precision compute, fp32 master weights and optimizer state.

A bf16 parameter cannot take a small update: its 8-bit mantissa spaces neighbouring
values 2^-8 of the value apart, so AdamW's step of about `lr` (1e-6 at the default) on a
weight of 0.02 is a hundred times under half a spacing and rounds away — one step at lr
1e-6 on a bf16 Qwen3-4B changed 1.9 % of the matrix elements and none of the norm
weights (docs/methods.md#mixed-precision). The fix is the classic one: the model keeps its
parameters in the compute dtype (the forward and backward really run in bf16), and the
optimizer steps fp32 *master* copies of them; after each step the masters are rounded
into the model. Gradients are added into the masters' fp32 `.grad` after every
micro-batch (`MasterWeights.collect`), so accumulation over micro-batches does not round
either.

Bytes per trainable parameter: 2 (bf16 weight) + 2 (bf16 gradient, freed after each
micro-batch) + 4 (fp32 master) + 4 (its fp32 gradient) + 8 (AdamW's fp32 m and v) —
about 18 at the peak of a step, 16 between micro-batches. Parameters already in fp32
(LoRA adapters, which peft keeps in fp32; everything in an fp32 run) are their own
masters: no copy, no cost.

The masters travel with the optimizer's state (`state_dict()["master"]`), so a resume
state restores them exactly; masters that no longer round to the model's weights (the
weights came from a later version than the resume state) are dropped for fresh copies of
the weights (`load_state_dict`), which loses only what was below the compute precision.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch


class MasterWeights:
    """fp32 masters of `params` (a parameter already in fp32 is its own master)."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self.masters = [self._master_of(p) for p in self.params]

    @staticmethod
    def _master_of(p: torch.nn.Parameter) -> torch.nn.Parameter:
        if p.dtype == torch.float32:
            return p
        return torch.nn.Parameter(p.detach().to(torch.float32), requires_grad=True)

    @property
    def copies(self) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
        """(model parameter, its fp32 master) for the parameters that have a separate master."""
        return [(p, m) for p, m in zip(self.params, self.masters, strict=True) if m is not p]

    def collect(self) -> None:
        """Add the model's low-precision gradients into the masters' fp32 ones and free them."""
        for p, m in self.copies:
            if p.grad is None:
                continue
            g = p.grad.detach().to(torch.float32)
            if m.grad is None:
                m.grad = g
            else:
                m.grad.add_(g)
            p.grad = None

    @torch.no_grad()
    def publish(self) -> None:
        """Round the masters into the model's parameters (after an optimizer step)."""
        for p, m in self.copies:
            p.copy_(m)

    @torch.no_grad()
    def adopt(self, saved: Sequence[torch.Tensor | None]) -> int:
        """Take saved masters where they still round to the model's weights; every other
        master becomes a fresh copy of its weight (after a rebase the old masters belong to
        the abandoned lineage). Returns how many were taken."""
        taken = 0
        for i, (p, m) in enumerate(zip(self.params, self.masters, strict=True)):
            if m is p:
                continue
            s = saved[i] if i < len(saved) else None
            if s is not None and s.shape == p.shape and torch.equal(s.to(device=p.device, dtype=p.dtype), p.detach()):
                m.copy_(s)
                taken += 1
            else:
                m.copy_(p.detach())
        return taken


class MixedPrecisionAdamW:
    """AdamW over fp32 masters of a low-precision model: the `torch.optim.Optimizer` surface
    the trainer uses (`step`, `zero_grad`, `param_groups`, `state_dict`, `load_state_dict`).

    `Trainer` calls `collect()` after each backward; `step()` steps the masters and rounds
    them into the model.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], **adamw: Any) -> None:
        self.weights = MasterWeights(params)
        self.inner = torch.optim.AdamW(self.weights.masters, **adamw)
        self.adopted = 0  # masters taken from a saved state at the last load

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def grad_params(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients are clipped and stepped: the masters."""
        return self.weights.masters

    def collect(self) -> None:
        self.weights.collect()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for p, _ in self.weights.copies:
            p.grad = None

    def step(self) -> None:
        self.inner.step()
        self.weights.publish()

    def state_dict(self) -> dict[str, Any]:
        state = self.inner.state_dict()
        state["master"] = [None if m is p else m.detach()
                           for p, m in zip(self.weights.params, self.weights.masters, strict=True)]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        saved = state.pop("master", None) or []
        self.inner.load_state_dict(state)
        self.adopted = self.weights.adopt(saved)


def grad_params(optimizer: Any, model_params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The parameters a step clips and updates: the masters under mixed precision, else the
    model's own."""
    return optimizer.grad_params if isinstance(optimizer, MixedPrecisionAdamW) else model_params


def collect_grads(optimizer: Any) -> None:
    """After a backward: move low-precision gradients into the fp32 masters (no-op otherwise)."""
    if isinstance(optimizer, MixedPrecisionAdamW):
        optimizer.collect()


def needs_masters(params: Iterable[torch.nn.Parameter], setting: str) -> bool:
    """MASTER_WEIGHTS: auto keeps fp32 masters when any trainable parameter is below fp32."""
    if setting == "true":
        return True
    if setting == "false":
        return False
    return any(p.dtype != torch.float32 for p in params)
