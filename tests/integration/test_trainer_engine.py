"""The trainer's log-probs of a sampled response equal the CPU engine's, for the same weights
and temperature: on-policy, the PPO ratio is 1 and nothing clips."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from services.trainer.batching import collate
from services.trainer.model import load_causal_lm, window_logprobs
from services.trainer.step import LossConfig, OptimConfig, Trainer, make_optimizer
from shared.engine_client import SGLangClient
from shared.schemas import SamplingParams, TrainSample
from tests.support.servers import ServiceProcess, free_port

pytestmark = pytest.mark.integration

PROMPTS = [[260, 447, 274, 318, 474, 429, 485], [301, 12, 77, 410, 260, 9]]


@pytest.fixture
async def engine(tiny_model: Path) -> AsyncIterator[SGLangClient]:
    port = free_port()
    proc = ServiceProcess(
        "engine", env={"NEXTSTATE_ENV": "test", "NEXTSTATE_ENGINE__THREADS": "1"},
        args=["--model", str(tiny_model), "--port", str(port)],
    )  # fmt: skip
    try:
        proc.start().wait_http(f"http://127.0.0.1:{port}/health", timeout=90)
        async with SGLangClient(f"http://127.0.0.1:{port}", timeout=60) as client:
            yield client
    finally:
        assert proc.stop() in (0, None), proc.logs()


async def test_trainer_logprobs_match_the_engine(engine: SGLangClient, tiny_model: Path) -> None:
    samples = []
    for temperature in (0.7, 1.0, 0.0, 1.3):
        for i, prompt in enumerate(PROMPTS):
            out = await engine.generate(
                prompt, SamplingParams(temperature=temperature, max_tokens=12, seed=7 + i)
            )
            assert len(out.output_ids) > 0 and len(out.output_logprobs) == len(out.output_ids)
            samples.append(TrainSample(
                session_id="s", tokens=prompt + out.output_ids, response_length=len(out.output_ids),
                loss_mask=[1] * len(out.output_ids), reward=1.0,
                rollout_logprobs=out.output_logprobs, temperature=temperature,
            ))  # fmt: skip
    model = load_causal_lm(tiny_model, torch.device("cpu"), torch.float32)
    mb = collate(samples, "rl")  # one padded micro-batch with mixed temperatures
    assert mb is not None
    with torch.no_grad():
        ours = window_logprobs(model, mb)
    m = mb.mask.bool()
    diff = (ours[m] - mb.old_logprobs[m]).abs().max().item()
    assert diff < 1e-4, f"trainer and engine log-probs differ by {diff}"

    loss, optim = LossConfig(kl_beta=0.0), OptimConfig()
    trainer = Trainer(model, make_optimizer(model, optim), loss, optim, micro_batch_tokens=64)
    metrics = trainer.step(samples)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["clip_frac"] == 0.0
