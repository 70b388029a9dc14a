"""A run's identity: the fingerprint of its base model, and the refusal that names both."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shared.runs import RunMismatch, check, model_fingerprint, record_for


def model(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "README.md").write_text("not part of the identity")
    return folder


def test_the_fingerprint_is_the_contents_not_the_place(tmp_path: Path) -> None:
    a = model(tmp_path / "a", b"weights-a")
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    (copy / "README.md").write_text("edited notes")
    assert model_fingerprint(a) == model_fingerprint(copy)
    tuned = model(tmp_path / "tuned", b"weights-b")  # same config, other weights
    assert model_fingerprint(tuned) != model_fingerprint(a)
    assert model_fingerprint("org/hub-model") == "name:org/hub-model"


def test_a_mismatch_names_both_models_and_the_way_out(tmp_path: Path) -> None:
    a = record_for("exp", model(tmp_path / "a", b"1"))
    b = record_for("exp", model(tmp_path / "b", b"2"))
    check(a, record_for("exp", tmp_path / "a"), "here")  # same model: fine
    with pytest.raises(RunMismatch) as err:
        check(a, b, "in the home")
    msg = str(err.value)
    assert str(tmp_path / "a") in msg and str(tmp_path / "b") in msg
    assert "NEXTSTATE_RUN=" in msg and "--run" in msg
