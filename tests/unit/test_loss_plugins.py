"""Loss plugins: the built-ins are registered through the interface, a plugin loaded from
a module path trains the tiny model, and a bad path is refused at start."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from services.trainer.batching import collate
from services.trainer.loss_plugins import LOSSES, LossConfig, clipped_with_kl, resolve_loss
from services.trainer.model import load_causal_lm, window_logprobs
from services.trainer.settings import TrainerConfig
from services.trainer.step import LossPluginError, OptimConfig, Trainer, make_optimizer
from shared.errors import SettingsError
from shared.schemas import TrainSample
from tests.support.servers import REPO

CPU = torch.device("cpu")
PLUGIN = "tests.support.loss_plugin:reward_weighted_nll"


def samples(seed: int = 0, n: int = 4) -> list[TrainSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, r = rng.randint(1, 8), rng.randint(2, 6)
        out.append(TrainSample(
            session_id="s", tokens=[rng.randrange(500) for _ in range(p + r)], response_length=r,
            loss_mask=[1] * r, reward=rng.choice([1.0, -0.5, 0.25]), temperature=1.0,
        ))  # fmt: skip
    return out


def trainer(model: Any, loss: LossConfig, budget: int = 8192) -> Trainer:
    optim = OptimConfig(lr=1e-2)
    return Trainer(model, make_optimizer(model, optim), loss, optim, micro_batch_tokens=budget, device=CPU)


def test_builtins_are_registered_through_the_interface() -> None:
    for name in ("rl", "opd", "combine"):
        assert resolve_loss(name) is clipped_with_kl and LOSSES[name] is clipped_with_kl
    assert LossConfig(mode="opd").loss_name == "opd"
    assert LossConfig(mode="rl", loss=PLUGIN).loss_name == PLUGIN


def test_a_plugin_from_a_module_path_trains(tiny_model: Path) -> None:
    model = load_causal_lm(tiny_model, CPU, torch.float32)
    batch = samples()
    mb = collate(batch, "rl", CPU)
    assert mb is not None
    with torch.no_grad():  # the closed form: -2 · Σ r·log p over trained tokens / their count
        logp = window_logprobs(model, mb)
        expected = float(-2.0 * (mb.rewards[:, None] * logp * mb.mask).sum() / mb.mask.sum())
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    t = trainer(model, LossConfig(mode="rl", kl_beta=0.0, loss=PLUGIN, options={"scale": 2.0}), budget=32)
    metrics = t.step(batch)
    assert metrics["plugin_loss"] == pytest.approx(expected, rel=1e-4)
    assert metrics["plugin_calls"] >= 2  # micro-batches: the plugin's metrics add up across them
    assert "pg_loss" not in metrics and "clip_frac" not in metrics  # the built-in did not run
    changed = [k for k, v in model.named_parameters() if not torch.equal(v, before[k])]
    assert changed and metrics["grad_norm"] > 0


def test_a_bad_plugin_is_refused(tiny_model: Path) -> None:
    for spec, message in (
        ("tests.support.no_such_module:f", "cannot import 'tests.support.no_such_module'"),
        ("tests.support.loss_plugin:missing", "has no 'missing'"),
        ("tests.support.loss_plugin:NOT_A_FUNCTION", "is a int, not a function"),
        ("ppo", "not a registered loss"),
    ):
        with pytest.raises(SettingsError, match=message):
            resolve_loss(spec)
    model = load_causal_lm(tiny_model, CPU, torch.float32)
    with pytest.raises(SettingsError, match="cannot import"):
        trainer(model, LossConfig(loss="tests.support.no_such_module:f"))
    bad = trainer(model, LossConfig(loss="tests.support.loss_plugin:returns_a_float", kl_beta=0.0))
    with pytest.raises(LossPluginError, match="expected \\(loss, metrics\\)"):
        bad.step(samples())


def test_loss_settings() -> None:
    assert TrainerConfig(model="m").loss is None
    assert TrainerConfig(model="m", loss=PLUGIN, loss_options={"scale": 2}).loss_options == {"scale": 2}
    with pytest.raises(ValueError, match="disagrees with LOSS_MODE=rl"):
        TrainerConfig(model="m", loss="opd")
    with pytest.raises(ValueError, match="module:function"):
        TrainerConfig(model="m", loss="not a loss")


def test_the_trainer_refuses_a_bad_plugin_path_at_start(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "NEXTSTATE_ENV": "test",
           "NEXTSTATE_TRAINER__MODEL": str(tmp_path), "NEXTSTATE_TRAINER__LOSS": "tests.support.nope:loss"}
    proc = subprocess.run([sys.executable, "-m", "services.trainer"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "NEXTSTATE_TRAINER__LOSS='tests.support.nope:loss': cannot import" in proc.stderr
