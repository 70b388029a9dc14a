"""The trainer's configuration from the environment, and the CLI's refusal of a bad one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.trainer.settings import TrainerSettings
from shared.errors import SettingsError
from shared.settings import load_settings
from tests.support.servers import REPO


def test_defaults_follow_the_design(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXTSTATE_TRAINER__MODEL", "/models/base")
    cfg = load_settings(TrainerSettings).trainer
    assert (cfg.lr, cfg.eps_clip, cfg.eps_clip_high, cfg.kl_beta) == (1e-6, 0.2, 0.28, 0.02)
    assert (cfg.loss_mode, cfg.checkpoint_every, cfg.lora) == ("rl", 1, False)
    # One window training plus one per version uploading: never fewer than a window.
    assert cfg.consumer_concurrency == 1 * (cfg.max_pending_uploads + 1)


def test_nested_values_parse_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXTSTATE_TRAINER__MODEL", "/m")
    monkeypatch.setenv("NEXTSTATE_TRAINER__BETAS", "[0.9, 0.95]")
    monkeypatch.setenv("NEXTSTATE_TRAINER__LORA_TARGETS", '["q_proj", "v_proj"]')
    monkeypatch.setenv("NEXTSTATE_TRAINER__LOSS_MODE", "combine")
    monkeypatch.setenv("NEXTSTATE_TRAINER__CHECKPOINT_EVERY", "4")
    cfg = load_settings(TrainerSettings).trainer
    assert cfg.betas == (0.9, 0.95) and cfg.lora_targets == ["q_proj", "v_proj"]
    assert cfg.consumer_concurrency == 4 * (cfg.max_pending_uploads + 1)


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({}, "NEXTSTATE_TRAINER__MODEL"),
        ({"NEXTSTATE_TRAINER__MODEL": "/m", "NEXTSTATE_TRAINER__LOSS_MODE": "ppo"}, "NEXTSTATE_TRAINER__LOSS_MODE"),
        ({"NEXTSTATE_TRAINER__MODEL": "/m", "NEXTSTATE_TRAINER__EPS_CLIP": "1.5"}, "NEXTSTATE_TRAINER__EPS_CLIP"),
        ({"NEXTSTATE_TRAINER__MODEL": "/m", "NEXTSTATE_TRAINER__DEVICE": "tpu"}, "NEXTSTATE_TRAINER__DEVICE"),
    ],
)
def test_invalid_settings_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], names: str
) -> None:
    monkeypatch.delenv("NEXTSTATE_TRAINER__MODEL", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SettingsError, match=names):
        load_settings(TrainerSettings)


def test_cli_exits_2_naming_the_variable() -> None:
    env = {"PATH": "/usr/bin:/bin", "NEXTSTATE_TRAINER__KL_BETA": "-1", "NEXTSTATE_TRAINER__MODEL": "/m"}
    out = subprocess.run([sys.executable, "-m", "services.trainer"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "NEXTSTATE_TRAINER__KL_BETA" in out.stderr
