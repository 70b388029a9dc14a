"""shared/vllm_engine.py: how vLLM is started — the engine choice from NEXTSTATE_ENGINE__*, a
missing vLLM venv said plainly, and the command's CPU settings (no token on the command line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.settings import load_settings
from shared.vllm_engine import EngineChoice, EngineChoiceSettings, VLLMLaunch


def test_the_engine_choice_reads_its_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(EngineChoiceSettings).engine.kind == "cpu"
    monkeypatch.setenv("NEXTSTATE_ENGINE__KIND", "vllm")
    monkeypatch.setenv("NEXTSTATE_ENGINE__THREADS", "3")
    monkeypatch.setenv("NEXTSTATE_ENGINE__MODEL", "/models/x")  # the CPU engine's own: ignored here
    choice = load_settings(EngineChoiceSettings).engine
    assert (choice.kind, choice.threads) == ("vllm", 3)


def test_a_missing_vllm_venv_says_how_to_install_it(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="make vllm"):
        VLLMLaunch.from_choice(EngineChoice(kind="vllm", vllm_python=str(tmp_path / "python")))


def test_the_command_runs_services_vllm_with_cpu_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXTSTATE_INTERNAL__TOKEN", "a-secret-token-0123456789")
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    argv, env = VLLMLaunch(python="/v/bin/python", threads=2, max_running=8).command(tmp_path, 31000)
    assert argv[:3] == ["/v/bin/python", "-m", "services.vllm"]

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert (flag("--port"), flag("--max-model-len"), flag("--max-num-seqs"), flag("--dtype")) == ("31000", "2048", "8", "float32")
    assert flag("--logprobs-mode") == "processed_logprobs" and "--enforce-eager" in argv and "--enable-scale-out" in argv
    assert not any("a-secret-token" in a for a in argv) and "--api-key" not in argv
    assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert str(Path(__file__).resolve().parents[2]) in env["PYTHONPATH"].split(":")
