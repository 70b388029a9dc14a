"""The train/inference mismatch, measured and corrected (services/trainer/offpolicy.py).

Our engine samples in bf16 (a random tiny model whose final norm is scaled ×10, so its
logits have a trained model's scale and the rounding shows as it does on a real one); the
trainer scores the same tokens at the same weights, in fp32 and in bf16. The step's
mismatch figures show the gap the engine's precision opens; with fp32 on both sides the
ratio is 1 to 1e-5. Truncated importance sampling keeps the step finite and each token's
weight at most IS_CAP, even with a sample whose behaviour log-probs are absurd."""

from __future__ import annotations

import asyncio
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from services.trainer.model import load_causal_lm
from services.trainer.step import LossConfig, OptimConfig, Trainer, make_optimizer
from shared.engine_client import SGLangClient
from shared.schemas import SamplingParams, TrainSample
from tests.support.servers import ServiceProcess, free_port

pytestmark = pytest.mark.integration

PROMPTS = [[260, 447, 274, 318, 474, 429, 485], [301, 12, 77, 410, 260, 9], [5, 99, 300, 17]]
CAP = 2.0


@pytest.fixture(scope="module")
def sharp_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its final norm ×10: logits of a trained model's scale."""
    dest = tmp_path_factory.mktemp("sharp-model")
    model = load_causal_lm(tiny_model, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    model.save_pretrained(str(dest))
    for f in tiny_model.iterdir():
        if f.is_file() and not (dest / f.name).exists():
            shutil.copy2(f, dest / f.name)
    return dest


async def sampled(model: Path, dtype: str) -> list[TrainSample]:
    """Responses our engine samples from `model` in `dtype`, as the trainer gets them (v0)."""
    port = free_port()
    proc = ServiceProcess(
        "engine", env={"NEXTSTATE_ENV": "test", "NEXTSTATE_ENGINE__THREADS": "1",
                       "NEXTSTATE_ENGINE__DTYPE": dtype},
        args=["--model", str(model), "--port", str(port)],
    )  # fmt: skip
    samples = []
    try:
        proc.start().wait_http(f"http://127.0.0.1:{port}/health", timeout=90)
        async with SGLangClient(f"http://127.0.0.1:{port}", timeout=60) as client:
            for i, prompt in enumerate(PROMPTS):
                for seed in range(3):
                    out = await client.generate(
                        prompt, SamplingParams(temperature=1.0, max_tokens=24, seed=11 * i + seed))
                    samples.append(TrainSample(
                        session_id="s", tokens=prompt + out.output_ids, response_length=len(out.output_ids),
                        loss_mask=[1] * len(out.output_ids), reward=1.0 if seed % 2 else -1.0,
                        rollout_logprobs=out.output_logprobs, temperature=1.0, policy_version=0,
                    ))  # fmt: skip
    finally:
        assert proc.stop() in (0, None), proc.logs()
    return samples


@pytest.fixture(scope="module")
def bf16_samples(sharp_model: Path) -> list[TrainSample]:
    return asyncio.run(sampled(sharp_model, "bfloat16"))


@pytest.fixture(scope="module")
def fp32_samples(sharp_model: Path) -> list[TrainSample]:
    return asyncio.run(sampled(sharp_model, "float32"))


def step(model_dir: Path, dtype: torch.dtype, samples: list[TrainSample],
         max_sample_kl: float | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = load_causal_lm(model_dir, torch.device("cpu"), dtype)
    optim = OptimConfig(lr=1e-6)
    loss = LossConfig(kl_beta=0.0, is_cap=CAP, max_sample_kl=max_sample_kl)
    return Trainer(model, make_optimizer(model, optim), loss, optim).step(samples, version=0)


@pytest.mark.parametrize("trainer_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_bf16_engine_shows_a_gap_the_trainer_reports(
    sharp_model: Path, bf16_samples: list[TrainSample], trainer_dtype: torch.dtype,
) -> None:  # fmt: skip
    m = step(sharp_model, trainer_dtype, bf16_samples)
    tokens = sum(len(s.rollout_logprobs or []) for s in bf16_samples)
    assert m["mismatch_tokens"] == tokens  # every sample is of the trainer's own version
    assert m["mismatch_abs_log_ratio"] > 1e-3, m  # the gap, visible
    assert m["mismatch_ratio_min"] < 1 - 1e-3 or m["mismatch_ratio_max"] > 1 + 1e-3
    assert math.isfinite(m["grad_norm"]) and math.isfinite(m["loss"])
    assert 0 < m["is_weight_mean"] <= CAP


def test_fp32_on_both_sides_the_ratio_is_one(sharp_model: Path, fp32_samples: list[TrainSample]) -> None:
    m = step(sharp_model, torch.float32, fp32_samples)
    assert m["mismatch_tokens"] > 0
    assert 1 - 1e-5 <= m["mismatch_ratio_min"] <= m["mismatch_ratio_max"] <= 1 + 1e-5, m
    assert m["mismatch_abs_log_ratio"] < 1e-5
    assert m["truncated_samples"] == 0 and m["clip_frac"] == 0


def test_the_correction_bounds_what_an_absurd_behaviour_does(
    sharp_model: Path, bf16_samples: list[TrainSample]
) -> None:
    """A sample whose engine log-probs are absurd (each token 'sampled' at -40) would weigh
    exp(40) uncorrected; truncated, its weight is CAP and the step stays finite."""
    bad = bf16_samples[0].model_copy(update={
        "rollout_logprobs": [-40.0] * bf16_samples[0].response_length, "policy_version": 0})
    m = step(sharp_model, torch.float32, [bad, *bf16_samples[1:]])
    assert m["truncated_samples"] >= 1
    assert math.isfinite(m["grad_norm"]) and m["is_weight_mean"] <= CAP
    assert m["is_truncated_frac"] > 0
    # With a divergence bound, the absurd sample is not trained at all, and counted.
    bounded = step(sharp_model, torch.float32, [bad, *bf16_samples[1:]], max_sample_kl=1.0)
    assert bounded["divergent_samples"] == 1 and math.isfinite(bounded["grad_norm"])
    assert step(sharp_model, torch.float32, bf16_samples, max_sample_kl=1.0)["divergent_samples"] == 0
