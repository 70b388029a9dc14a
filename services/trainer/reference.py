"""The KL reference of full fine-tuning, off the device: its layers streamed in for each forward.

With LoRA the reference is the policy with its adapters off (no copy at all). Full
fine-tuning needs the frozen base beside the policy: resident on the device that is a
second whole model (Qwen3-4B: 7.5 GiB in bf16; 8B: 15 GiB). Streamed
(`NEXTSTATE_TRAINER__REFERENCE_OFFLOAD`, services/trainer/fit.py decides on auto), the
decoder layers stay in pinned CPU memory and only what lies outside them (embeddings, LM
head, final norm) lives on the device. A forward hook copies each layer's weights onto
the device just before the layer runs and drops them after; meanwhile the next layer is
copied on a side CUDA stream, so at most two layers are on the device at once.

The reference's forward is unchanged (same modules, same kernels, same dtype), so its
log-probs are the resident copy's to the bit (tests/unit/test_trainer_memory.py). The
cost is the copy: the layers' bytes once per micro-batch (Qwen3-4B bf16: 7.3 GB, about
0.15 s at PCIe 5's ~50 GB/s, 0.3 s at PCIe 4's ~25 GB/s), mostly hidden behind the
forward for long micro-batches and beside a step of 1-3 s; and host memory for one copy
of the model (docs/methods.md#memory).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from services.trainer.model import freeze, load_causal_lm


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """The model's stack of decoder layers: its ModuleList holding the most parameters."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no stack of layers to stream")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


class LayerStream:
    """Keeps `layers`' weights on the host and lends them to `device` while each one runs.

    `tensors[i]` are layer i's own parameters and buffers, whose `.data` is swapped between
    `host[i]` (pinned CPU copies) and `loaded[i]` (device copies, for the layers on the
    device now: the running one and the next, prefetched)."""

    def __init__(self, model: Any, layers: torch.nn.ModuleList, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.tensors = [_tensors(layer) for layer in layers]
        for ts in self.tensors:
            for t in ts:
                t.data = t.data.to("cpu").pin_memory() if self.cuda else t.data.to("cpu")
        self.host = [[t.data for t in ts] for ts in self.tensors]
        self.loaded: dict[int, list[torch.Tensor]] = {}
        self.ready: dict[int, Any] = {}
        self.copies = torch.cuda.Stream(device) if self.cuda else None  # type: ignore[no-untyped-call]
        self.peak_loaded = 0  # the most layers ever on the device at once (tests, benchmarks)
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda _m, _a, i=i: self._enter(i))
            layer.register_forward_hook(lambda _m, _a, _o, i=i: self._leave(i), always_call=True)
        model.register_forward_pre_hook(lambda _m, _a: self._load(0))
        model.register_forward_hook(lambda _m, _a, _o: self._drop(), always_call=True)

    def _load(self, i: int) -> None:
        """Start copying layer i onto the device (on the side stream under CUDA)."""
        if i >= len(self.host) or i in self.loaded:
            return
        side = torch.cuda.stream(self.copies) if self.copies is not None else contextlib.nullcontext()
        with side:
            self.loaded[i] = [h.to(self.device, non_blocking=True, copy=True) for h in self.host[i]]
            if self.copies is not None:
                self.ready[i] = torch.cuda.Event()  # type: ignore[no-untyped-call]
                self.ready[i].record(self.copies)
        self.peak_loaded = max(self.peak_loaded, len(self.loaded))

    def _enter(self, i: int) -> None:
        self._load(i)
        if self.cuda:  # the compute stream waits for the copy; the allocator learns who uses it
            current = torch.cuda.current_stream(self.device)
            ready = self.ready.pop(i, None)
            if ready is not None:
                current.wait_event(ready)
            for c in self.loaded[i]:
                c.record_stream(current)
        for t, c in zip(self.tensors[i], self.loaded[i], strict=True):
            t.data = c
        self._load(i + 1)

    def _leave(self, i: int) -> None:
        for t, h in zip(self.tensors[i], self.host[i], strict=True):
            t.data = h
        self.loaded.pop(i, None)
        self.ready.pop(i, None)

    def _drop(self) -> None:
        """After the model's forward, even a failed one: no layer stays on the device."""
        for i in list(self.loaded):
            self._leave(i)


def stream_layers(model: Any, device: torch.device) -> LayerStream:
    """Move `model` (on the CPU) to `device` except its decoder layers, which stream in."""
    layers = decoder_layers(model)
    inside = {id(t) for t in _tensors(layers)}
    for t in _tensors(model):  # embeddings (once, when tied), head, final norm, rotary tables
        if id(t) not in inside:
            t.data = t.data.to(device)
    stream = LayerStream(model, layers, device)
    model.layer_stream = stream
    return stream


def load_reference(path: str, device: torch.device, dtype: torch.dtype, streamed: bool) -> Any:
    """The frozen base model for the KL term: resident on `device`, or its layers streamed in."""
    if not streamed:
        return freeze(load_causal_lm(path, device, dtype))
    model = freeze(load_causal_lm(path, torch.device("cpu"), dtype))
    stream_layers(model, device)
    return model
