"""One dtype served (shared/dtypes.py): the dtype a model folder is served in — config.json's,
else its weights' — and the trainer's default publish dtype that follows it
(services/trainer/model.py `publish_dtype`), so v0 and every version are in one dtype."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.ctl.models import default_model_dir, is_default_model, served_dtype
from services.trainer.model import publish_dtype
from shared.dtypes import config_dtype, folder_dtype, weights_dtype


def folder(path: Path, config: dict[str, object] | None, tensors: dict[str, torch.Tensor] | None) -> Path:
    """A model folder with `config` as config.json and `tensors` as model.safetensors."""
    path.mkdir(parents=True)
    if config is not None:
        (path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    if tensors is not None:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"embed.weight": torch.zeros(8, 4, dtype=dtype), "ids": torch.arange(3)}


def test_config_names_the_dtype_else_the_weights_do(tmp_path: Path) -> None:
    assert folder_dtype(folder(tmp_path / "a", {"dtype": "bfloat16"}, weights(torch.float32))) == "bfloat16"
    assert folder_dtype(folder(tmp_path / "b", {"torch_dtype": "float16"}, None)) == "float16"  # transformers 4
    assert config_dtype(folder(tmp_path / "c", {"dtype": "torch.float32"}, None)) == "float32"
    # no dtype in config.json (or "auto"): the safetensors headers say, integer tensors aside
    assert folder_dtype(folder(tmp_path / "d", {}, weights(torch.bfloat16))) == "bfloat16"
    assert folder_dtype(folder(tmp_path / "e", {"dtype": "auto"}, weights(torch.float32))) == "float32"
    assert folder_dtype(folder(tmp_path / "f", {}, None)) is None
    assert folder_dtype(tmp_path / "nowhere") is None


def test_a_mixed_folder_counts_as_the_dtype_of_most_of_its_weights(tmp_path: Path) -> None:
    mixed = {"matrix": torch.zeros(64, 64, dtype=torch.bfloat16), "norm": torch.zeros(64, dtype=torch.float32),
             "bias": torch.zeros(8, dtype=torch.float32)}
    assert weights_dtype(folder(tmp_path / "m", {}, mixed)) == "bfloat16"


def test_publish_dtype_follows_the_served_folder_unless_set(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fp32 = folder(tmp_path / "fp32", {"dtype": "float32"}, weights(torch.float32))
    bf16 = folder(tmp_path / "bf16", {}, weights(torch.bfloat16))
    assert publish_dtype("auto", fp32) is torch.float32  # the demo model, served fp32 on our CPU engine
    assert publish_dtype("auto", str(bf16)) is torch.bfloat16  # what SGLang serves as v0
    with caplog.at_level(logging.WARNING, logger="services.trainer.model"):
        assert publish_dtype("bfloat16", fp32) is torch.bfloat16  # an explicit value wins…
    assert "NEXTSTATE_WATCHER__SERVED_DTYPE=bfloat16" in caplog.text  # …and says what the watcher needs
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="services.trainer.model"):
        assert publish_dtype("float32", fp32) is torch.float32
    assert caplog.text == ""
    # a folder that says nothing the trainer can write: the trainer's own dtype, as before
    assert publish_dtype("auto", folder(tmp_path / "none", {}, None)) is None
    assert publish_dtype("auto", folder(tmp_path / "f64", {"dtype": "float64"}, None)) is None
    assert publish_dtype("auto") is None


def test_the_demo_model_is_converted_to_the_dtype_its_engine_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert served_dtype("cpu") == "float32"  # our engine on a CPU: exact log-probs
    assert served_dtype("vllm", "float32") == "float32"  # vLLM's CPU build, NEXTSTATE_ENGINE__DTYPE's default
    assert served_dtype("vllm", "auto") == "float32"
    assert served_dtype("sglang") == "bfloat16"  # SGLang on a GPU
    assert served_dtype("cpu", "bfloat16") == "bfloat16"  # a configured dtype wins
    monkeypatch.setenv("NEXTSTATE_HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"  # the fp32 folder as before
    assert default_model_dir("bfloat16") == tmp_path / "models" / "SmolLM2-135M-Instruct-bfloat16"
    assert is_default_model(default_model_dir("bfloat16")) and not is_default_model(tmp_path / "mine")


def test_compose_init_picks_the_profiles_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.ctl.compose import compose_dtype, model_folder

    assert compose_dtype({"COMPOSE_PROFILES": "cpu"}) == "float32"
    assert compose_dtype({"COMPOSE_PROFILES": "gpu,monitoring"}) == "bfloat16"
    assert compose_dtype({"COMPOSE_PROFILES": "vllm", "VLLM_DTYPE": "bfloat16"}) == "bfloat16"
    assert compose_dtype({"COMPOSE_PROFILES": "vllm", "VLLM_DTYPE": "float32"}) == "float32"
    # a folder of the user's is kept whatever the profile; the demo folder follows the profile
    monkeypatch.setenv("NEXTSTATE_HOME", str(tmp_path))
    mine = folder(tmp_path / "mine", {"dtype": "float32"}, weights(torch.float32))
    assert model_folder(None, str(mine), "bfloat16") == mine
    demo = folder(default_model_dir("bfloat16"), {"dtype": "bfloat16"}, weights(torch.bfloat16))
    assert model_folder(None, str(default_model_dir("float32")), "bfloat16") == demo  # converted before: reused
