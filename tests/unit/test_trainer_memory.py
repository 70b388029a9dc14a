"""Memory that fits, on the tiny model: activation checkpointing changes no log-prob nor gradient
(full and LoRA), the streamed KL reference gives the resident one's log-probs, and
`build_trainer` wires both from the settings."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from services.trainer.batching import MicroBatch, collate
from services.trainer.build import build_trainer
from services.trainer.fit import enable_activation_checkpointing
from services.trainer.model import LoraSpec, add_lora, freeze, load_causal_lm, window_logprobs
from services.trainer.reference import decoder_layers, load_reference
from services.trainer.resume import ResumePoint
from services.trainer.settings import TrainerConfig
from services.trainer.step import LossConfig, OptimConfig, Trainer, make_optimizer
from shared.schemas import TrainSample

CPU = torch.device("cpu")


def samples(n: int = 4, seed: int = 0) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, r = rng.randint(2, 9), rng.randint(3, 8)
        out.append(TrainSample(
            session_id="s", tokens=[rng.randrange(500) for _ in range(p + r)], response_length=r,
            loss_mask=[1] * r, reward=rng.choice([1.0, -1.0]), temperature=rng.choice([1.0, 0.7]),
        ))  # fmt: skip
    return out


def batch() -> MicroBatch:
    mb = collate(samples(), "rl", CPU)
    assert mb is not None
    return mb


def logprobs_and_grads(model: Any, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logp = window_logprobs(model, mb)
    (logp * mb.mask * mb.rewards[:, None]).sum().backward()  # type: ignore[no-untyped-call]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), grads


def saved_bytes(model: Any, mb: MicroBatch) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        window_logprobs(model, mb)
    return total


@pytest.mark.parametrize("lora", [False, True])
def test_checkpointing_changes_no_logprob_nor_gradient(tiny_model: Path, lora: bool) -> None:
    def build() -> Any:
        torch.manual_seed(0)
        model = load_causal_lm(tiny_model, CPU, torch.float32)
        return add_lora(model, LoraSpec(rank=4, alpha=8)) if lora else model

    plain, checkpointed = build(), build()
    if lora:  # fresh adapters have B = 0: give both the same non-zero ones
        with torch.no_grad():
            for (_, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters(), strict=True):
                if a.requires_grad:
                    a.normal_(0, 0.1)
                    b.copy_(a)
    enable_activation_checkpointing(checkpointed)
    mb = batch()
    assert saved_bytes(checkpointed, mb) < saved_bytes(plain, mb) / 2  # it does checkpoint
    want, want_grads = logprobs_and_grads(plain, mb)
    got, got_grads = logprobs_and_grads(checkpointed, mb)
    assert torch.equal(got, want)
    assert want_grads and got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-6, atol=1e-7, msg=name)
    assert not any(m.training for m in checkpointed.modules() if isinstance(m, torch.nn.Dropout))


def test_a_training_step_is_the_same_with_checkpointing(tiny_model: Path) -> None:
    def trained(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = load_causal_lm(tiny_model, CPU, torch.float32)
        if checkpointing:
            enable_activation_checkpointing(model)
        optim = OptimConfig(lr=1e-2)
        trainer = Trainer(model, make_optimizer(model, optim), LossConfig(kl_beta=0.0), optim,
                          micro_batch_tokens=32, device=CPU)
        trainer.step(samples())
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    plain, checkpointed = trained(False), trained(True)
    for name, p in plain.items():
        torch.testing.assert_close(checkpointed[name], p, rtol=1e-5, atol=1e-6, msg=name)


def test_the_streamed_reference_gives_the_resident_ones_logprobs(tiny_model: Path) -> None:
    resident = freeze(load_causal_lm(tiny_model, CPU, torch.float32))
    streamed = load_reference(str(tiny_model), CPU, torch.float32, streamed=True)
    stream = streamed.layer_stream
    layers = decoder_layers(streamed)
    hosts = [p.data_ptr() for p in layers.parameters()]
    mb = batch()
    with torch.no_grad():
        want = window_logprobs(resident, mb)
        got = window_logprobs(streamed, mb)
        again = window_logprobs(streamed, mb)
    assert torch.equal(got, want) and torch.equal(again, want)
    assert [p.data_ptr() for p in layers.parameters()] == hosts  # back on the host after each forward
    assert stream.loaded == {} and stream.peak_loaded == 2  # the running layer and the next
    assert not any(p.requires_grad for p in streamed.parameters())


def test_the_streamed_reference_puts_its_layers_back_when_a_forward_fails(tiny_model: Path) -> None:
    streamed = load_reference(str(tiny_model), CPU, torch.float32, streamed=True)
    hosts = [p.data_ptr() for p in decoder_layers(streamed).parameters()]
    with pytest.raises(IndexError), torch.no_grad():
        streamed(input_ids=torch.tensor([[10**6]]))  # out of the vocabulary: the embedding raises

    def fails(*_: Any, **__: Any) -> None:
        raise RuntimeError("out of memory, say")

    decoder_layers(streamed)[0].mlp.forward = fails  # type: ignore[union-attr]  # inside layer 0
    with pytest.raises(RuntimeError), torch.no_grad():
        streamed(input_ids=torch.tensor([[1, 2, 3]]))
    assert [p.data_ptr() for p in decoder_layers(streamed).parameters()] == hosts
    assert streamed.layer_stream.loaded == {}


def test_build_trainer_wires_checkpointing_and_the_streamed_reference(tiny_model: Path) -> None:
    cfg = TrainerConfig(model=str(tiny_model), device="cpu", kl_beta=0.05, gradient_checkpointing="true",
                        reference_offload="true", lr=1e-2)
    trainer = build_trainer(cfg, ResumePoint(version=0, step=0, next_version=1, consumed=[]))
    assert all(layer.gradient_checkpointing for layer in decoder_layers(trainer.model))
    assert trainer.reference is not None and hasattr(trainer.reference, "layer_stream")
    resident = build_trainer(TrainerConfig(model=str(tiny_model), device="cpu", kl_beta=0.05, lr=1e-2),
                             ResumePoint(version=0, step=0, next_version=1, consumed=[]))
    assert not hasattr(resident.reference, "layer_stream")  # auto on CPU: resident, no checkpointing
    assert not any(getattr(layer, "gradient_checkpointing", False) for layer in decoder_layers(resident.model))
    batch_ = samples()
    a, b = trainer.step(batch_), resident.step(batch_)
    assert a["kl"] == pytest.approx(b["kl"], rel=1e-5, abs=1e-9)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-9)
