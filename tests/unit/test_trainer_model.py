"""The trainer on the tiny random model: log-probs, micro-batching, a step, LoRA export."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from services.trainer.batching import collate, pack
from services.trainer.model import (
    LoraSpec,
    add_lora,
    export_state_dict,
    load_causal_lm,
    save_hf_folder,
    window_logprobs,
)
from services.trainer.step import LossConfig, OptimConfig, Trainer, make_optimizer
from shared.errors import MalformedMessage
from shared.schemas import TrainSample

CPU = torch.device("cpu")


def sample(
    rng: random.Random, prompt: int, response: int, *, reward: float = 1.0, temperature: float = 1.0,
    rollout: bool = False, teacher: bool = False, vocab: int = 500, **kw: Any,
) -> TrainSample:
    tokens = [rng.randrange(vocab) for _ in range(prompt + response)]
    mask = [1 if rng.random() > 0.2 else 0 for _ in range(response)]
    mask[-1] = 1
    lp = [-rng.uniform(0.5, 6.0) for _ in range(response)]
    return TrainSample(
        session_id="s", tokens=tokens, response_length=response, loss_mask=mask, reward=reward,
        rollout_logprobs=lp if rollout else None,
        teacher_logprobs=[x + rng.uniform(-0.5, 0.5) for x in lp] if teacher else None,
        temperature=temperature, **kw,
    )  # fmt: skip


def batch(seed: int = 0, n: int = 6, **kw: Any) -> list[TrainSample]:
    rng = random.Random(seed)
    return [
        sample(rng, rng.randint(0, 20), rng.randint(1, 12), reward=rng.choice([1.0, -1.0]),
               temperature=rng.choice([0.0, 0.7, 1.0, 1.3]), **kw)
        for _ in range(n)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def base(tiny_model: Path) -> Any:
    return load_causal_lm(tiny_model, CPU, torch.float32)


def fresh(tiny_model: Path) -> Any:
    return load_causal_lm(tiny_model, CPU, torch.float32)


def trainer_for(model: Any, *, kl_beta: float = 0.0, reference: Any = None, budget: int = 8192,
                lr: float = 1e-3, mode: str = "rl") -> Trainer:
    loss = LossConfig(mode=mode, kl_beta=kl_beta)  # type: ignore[arg-type]
    optim = OptimConfig(lr=lr)
    return Trainer(model, make_optimizer(model, optim), loss, optim, reference=reference,
                   micro_batch_tokens=budget, device=CPU)


def test_window_logprobs_equal_log_softmax_over_temperature_per_sample(base: Any) -> None:
    samples = batch(1, n=5)
    mb = collate(samples, "rl")
    assert mb is not None
    with torch.no_grad():
        got = window_logprobs(base, mb)
    start = int(mb.keep[0])
    for i, s in enumerate(samples):
        with torch.no_grad():
            logits = base(input_ids=torch.tensor([s.tokens])).logits[0]  # no padding at all
        t = 1.0 if s.temperature == 0 else s.temperature
        full = torch.log_softmax(logits.double() / t, dim=-1)
        p = s.prompt_length
        for j in range(s.response_length):
            pos = p + j
            if pos == 0:
                continue  # the first token of a sequence has no prediction
            expected = full[pos - 1, s.tokens[pos]]
            col = pos - 1 - start
            assert got[i, col].item() == pytest.approx(expected.item(), abs=1e-4)
            assert mb.mask[i, col].item() == s.loss_mask[j]


def test_pack_covers_every_sample_once_within_budget() -> None:
    lengths = [5, 40, 12, 12, 33, 7, 100, 1]
    groups = pack(lengths, 64)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 64


def test_opd_mode_masks_samples_without_teacher_logprobs() -> None:
    rng = random.Random(2)
    with_teacher = sample(rng, 4, 3, rollout=True, teacher=True)
    without = sample(rng, 4, 3, rollout=True)
    mb = collate([with_teacher, without], "opd")
    assert mb is not None
    assert mb.mask[0].sum() == sum(with_teacher.loss_mask)
    assert mb.mask[1].sum() == 0
    assert mb.has_teacher.tolist() == [True, False]


def grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kl_beta", [0.0, 0.05])
def test_micro_batches_accumulate_to_the_one_batch_gradient(tiny_model: Path, base: Any, kl_beta: float) -> None:
    samples = batch(3, n=8, rollout=True)
    model = fresh(tiny_model)
    with torch.no_grad():  # move off the reference so the KL term has a gradient
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    ref = base if kl_beta else None
    one = trainer_for(model, kl_beta=kl_beta, reference=ref, budget=100_000)
    one.optimizer.zero_grad()
    m1 = one.accumulate(samples)
    g1 = grads(model)
    many = trainer_for(model, kl_beta=kl_beta, reference=ref, budget=24)
    assert len(pack([len(s.tokens) for s in samples], 24)) >= 4
    many.optimizer.zero_grad()
    m2 = many.accumulate(samples)
    g2 = grads(model)
    assert g1.keys() == g2.keys() and g1
    for name in g1:
        assert torch.allclose(g1[name], g2[name], atol=1e-6, rtol=1e-4), name
    for key in ("loss", "pg_loss", "clip_frac", "ratio_mean"):
        assert m1[key] == pytest.approx(m2[key], abs=1e-5)


def test_on_policy_samples_have_ratio_one(tiny_model: Path) -> None:
    t = trainer_for(fresh(tiny_model))
    m = t.step(batch(4, n=4), version=3)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m["clip_frac"] == 0.0
    assert m["staleness"] == 3.0 and m["tokens"] > 0 and m["grad_norm"] > 0


def test_step_changes_parameters_and_kl_needs_a_reference(tiny_model: Path, base: Any) -> None:
    model = fresh(tiny_model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    t = trainer_for(model, kl_beta=0.02, reference=base)
    m = t.step(batch(5, n=4, rollout=True))
    assert "kl" in m and m["kl"] >= 0
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)
    with pytest.raises(ValueError, match="reference"):
        trainer_for(fresh(tiny_model), kl_beta=0.02)


def test_out_of_vocabulary_tokens_are_refused_before_any_update(tiny_model: Path) -> None:
    model = fresh(tiny_model)
    before = [p.detach().clone() for p in model.parameters()]
    bad = batch(6, n=2)
    bad[1].tokens[0] = 10_000_000
    with pytest.raises(MalformedMessage, match="vocabulary"):
        trainer_for(model).step(bad)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_lora_trains_only_adapters_and_exports_merged_weights(tiny_model: Path, tmp_path: Path) -> None:
    model = add_lora(fresh(tiny_model), LoraSpec(rank=4, alpha=8))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    t = trainer_for(model, kl_beta=0.02, lr=1e-2)  # the reference is the base, adapters off
    for seed in range(3):
        m = t.step(batch(seed, n=4, rollout=True))
    assert m["kl"] > 0  # adapters moved the policy away from its base
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    weights = export_state_dict(model)
    assert not any("lora_" in k or "base_layer" in k for k in weights)
    save_hf_folder(model, weights, tmp_path / "merged", None)
    merged = load_causal_lm(tmp_path / "merged", CPU, torch.float32)
    assert type(merged).__name__ == "LlamaForCausalLM"
    ids = torch.tensor([batch(9, n=1)[0].tokens])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        plain = fresh(tiny_model)(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-4)
