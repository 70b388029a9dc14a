"""The top-K OPD loss: reverse KL(student || teacher) over the teacher's top-K + a tail bin,
against closed forms (K = V is the full reverse KL), gradient flow, and a tiny-model step."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from services.trainer.batching import collate
from services.trainer.loss_plugins import LossConfig, resolve_loss
from services.trainer.losses import topk_reverse_kl
from services.trainer.model import load_causal_lm, window_logits
from services.trainer.settings import TrainerConfig
from services.trainer.step import OptimConfig, Trainer, make_optimizer
from shared.schemas import TrainSample

CPU = torch.device("cpu")


def dists(b: int = 2, w: int = 3, v: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    student = torch.log_softmax(torch.randn(b, w, v, generator=g, dtype=torch.float64) * 2, -1)
    teacher = torch.log_softmax(torch.randn(b, w, v, generator=g, dtype=torch.float64) * 2, -1)
    return student, teacher


def top(teacher: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    lp, ids = teacher.topk(k, dim=-1)
    return ids, lp


def test_k_equal_to_the_vocabulary_is_the_full_reverse_kl() -> None:
    student, teacher = dists()
    ids, lp = top(teacher, teacher.shape[-1])
    full = (student.exp() * (student - teacher)).sum(-1)  # (B, W)
    assert torch.allclose(topk_reverse_kl(student, ids, lp), full, atol=1e-6)
    assert (full > 0).all()


def test_top_k_with_a_tail_bin_matches_the_closed_form() -> None:
    student, teacher = dists(b=1, w=2, v=6, seed=3)
    ids, lp = top(teacher, 2)
    got = topk_reverse_kl(student, ids, lp)
    for pos in range(2):
        s = student[0, pos].exp().tolist()
        t = teacher[0, pos].exp().tolist()
        chosen = ids[0, pos].tolist()
        want = sum(s[i] * math.log(s[i] / t[i]) for i in chosen)
        s_tail = 1 - sum(s[i] for i in chosen)
        t_tail = 1 - sum(t[i] for i in chosen)
        want += s_tail * math.log(s_tail / t_tail)
        assert got[0, pos].item() == pytest.approx(want, abs=1e-9)


def test_padding_is_not_in_the_set() -> None:
    student, teacher = dists(seed=5)
    ids, lp = top(teacher, 3)
    padded_ids = torch.cat([ids, torch.zeros_like(ids[..., :2])], -1)
    padded_lp = torch.cat([lp, torch.full_like(lp[..., :2], float("-inf"))], -1)
    assert torch.allclose(topk_reverse_kl(student, padded_ids, padded_lp), topk_reverse_kl(student, ids, lp))


def test_gradients_flow_only_through_the_student() -> None:
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    _, teacher = dists()
    ids, lp = top(teacher, 4)
    lp = lp.clone().requires_grad_(True)
    topk_reverse_kl(torch.log_softmax(logits, -1), ids, lp).sum().backward()  # type: ignore[no-untyped-call]
    assert lp.grad is None
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    # at the teacher itself (K = V) the divergence and its gradient vanish
    at = teacher.clone().requires_grad_(True)
    ids_all, lp_all = top(teacher, 7)
    kl = topk_reverse_kl(torch.log_softmax(at, -1), ids_all, lp_all)
    kl.sum().backward()  # type: ignore[no-untyped-call]
    assert kl.abs().max() < 1e-9 and at.grad is not None and at.grad.abs().max() < 1e-7


def topk_sample(rng: random.Random, prompt: int, response: int, k: int, vocab: int = 500) -> TrainSample:
    return TrainSample(
        session_id="s", tokens=[rng.randrange(vocab) for _ in range(prompt + response)],
        response_length=response, loss_mask=[1] * response, reward=0.0, mode="opd",
        teacher_logprobs=[-1.0] * response,
        teacher_topk_ids=[rng.sample(range(vocab), k) for _ in range(response)],
        teacher_topk_logprobs=[sorted((-rng.uniform(0.1, 3.0) for _ in range(k)), reverse=True)
                               for _ in range(response)],
    )  # fmt: skip


def test_opd_topk_trains_the_tiny_model(tiny_model: Path) -> None:
    assert resolve_loss("opd_topk").__name__ == "opd_topk"
    model = load_causal_lm(tiny_model, CPU, torch.float32)
    rng = random.Random(0)
    batch = [topk_sample(rng, rng.randint(1, 6), rng.randint(2, 5), k=rng.choice([3, 5])) for _ in range(4)]
    batch.append(TrainSample(session_id="s", tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 1],
                             reward=0.0, mode="opd", teacher_logprobs=[-1.0, -1.0]))  # no top-K
    optim = OptimConfig(lr=1e-2)
    cfg = LossConfig(mode="opd", kl_beta=0.0, loss="opd_topk")
    t = Trainer(model, make_optimizer(model, optim), cfg, optim, device=CPU)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    first = t.step(batch)
    assert first["topk_kl"] > 0 and first["topk_tokens"] == sum(s.response_length for s in batch[:4])
    assert "pg_loss" not in first
    assert any(not torch.equal(v, before[k]) for k, v in model.named_parameters())
    again = t.step(batch)
    assert again["topk_kl"] < first["topk_kl"]  # the student moved toward the teacher


def test_a_teacher_equal_to_the_student_gives_zero(tiny_model: Path) -> None:
    model = load_causal_lm(tiny_model, CPU, torch.float32)
    rng = random.Random(1)
    s = topk_sample(rng, 3, 3, k=2)
    mb = collate([s], "opd", CPU)
    assert mb is not None
    with torch.no_grad():
        own = torch.log_softmax(window_logits(model, mb).float(), -1)[0]  # (W, V)
    lo = s.prompt_length - 1 - int(mb.keep[0])
    rows = own[lo : lo + s.response_length]
    lp, ids = rows.topk(rows.shape[-1], dim=-1)  # K = V: the student's own distribution
    same = s.model_copy(update={"teacher_topk_ids": ids.tolist(), "teacher_topk_logprobs": lp.tolist()})
    optim = OptimConfig(lr=1e-2)
    t = Trainer(model, make_optimizer(model, optim), LossConfig(mode="opd", kl_beta=0.0, loss="opd_topk"),
                optim, device=CPU)  # fmt: skip
    assert t.step([same])["topk_kl"] == pytest.approx(0.0, abs=1e-5)


def test_settings_and_schema() -> None:
    assert TrainerConfig(model="m", loss_mode="opd", loss="opd_topk").loss == "opd_topk"
    with pytest.raises(ValueError, match="opd_topk needs LOSS_MODE=opd"):
        TrainerConfig(model="m", loss="opd_topk")
    base = {"session_id": "s", "tokens": [1, 2, 3], "response_length": 2, "loss_mask": [1, 1], "reward": 0.0}
    for ids, lps, message in (
        ([[1], [2]], None, "come together"),
        ([[1]], [[-1.0]], "rows for 2 response tokens"),
        ([[1, 2], [3]], [[-1.0, -2.0], [-1.0]], "same K"),
        ([[1], [-2]], [[-1.0], [-1.0]], ">= 0"),
        ([[1], [2]], [[-1.0], [0.5]], "<= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            TrainSample(**base, teacher_topk_ids=ids, teacher_topk_logprobs=lps)  # type: ignore[arg-type]


def test_the_buffer_carries_the_top_k_to_the_sample() -> None:
    from services.buffer.rules import build_sample
    from shared.schemas import ScoredTurn, Turn

    turn = Turn(session_id="s", messages=[{"role": "user", "content": "hi"}], response={"role": "assistant"},
                prompt_ids=[1, 2], response_ids=[3, 4], next_state=[{"role": "user", "content": "no"}])
    ids, lps = [[3, 9], [4, 8]], [[-0.1, -2.5], [-0.2, -1.9]]
    scored = ScoredTurn(turn=turn, reward=0, mode="opd", teacher_logprobs=[-0.1, -0.2],
                        teacher_topk_ids=ids, teacher_topk_logprobs=lps)
    sample = build_sample(ScoredTurn.from_json(scored.to_json()), "opd")
    assert (sample.teacher_topk_ids, sample.teacher_topk_logprobs) == (ids, lps)
    assert build_sample(scored, "opd", anchor_only=True).teacher_topk_ids is None
    with pytest.raises(ValueError, match="rows for 2"):
        ScoredTurn(turn=turn, reward=0, teacher_topk_ids=ids[:1], teacher_topk_logprobs=lps[:1])
