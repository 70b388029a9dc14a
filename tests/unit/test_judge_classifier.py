"""The classifier judge on a tiny sequence-classification model built on the spot:
reward 2p - 1 of the positive class, batched forwards equal to one-by-one ones."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from services.judge.classifier import ClassifierJudge, SequenceClassifier
from services.judge.judges import build_judge
from services.judge.settings import JudgeConfig
from services.judge.verdict import render_for_judge
from shared.errors import SettingsError
from shared.schemas import Turn
from tests.support.tiny_model import build_tiny_classifier


@pytest.fixture(scope="module")
def classifier_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer and config, as a 2-label sequence classifier (random head)."""
    return build_tiny_classifier(tiny_model, tmp_path_factory.mktemp("tiny-classifier"))


def turn(reply: str, n: int = 0) -> Turn:
    return Turn(
        session_id=f"s{n}", messages=[{"role": "user", "content": f"Question number {n}: what is {n} + {n}?"}],
        response={"role": "assistant", "content": f"It is {2 * n}." + " Surely." * n},
        prompt_ids=[1], response_ids=[2], next_state=[{"role": "user", "content": reply}],
    )  # fmt: skip


def direct_p(folder: Path, text: str) -> float:
    """p(label 1) of one text, unpadded, straight from transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(str(folder))
    model: Any = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        logits = model(**tok([text], return_tensors="pt")).logits
    return float(torch.softmax(logits.float(), -1)[0, 1])


async def test_rewards_are_2p_minus_1_and_batched(classifier_dir: Path) -> None:
    cfg = JudgeConfig(type="classifier", classifier=str(classifier_dir), classifier_batch_size=8,
                      classifier_batch_wait_ms=200)  # fmt: skip
    judge = build_judge(cfg, None)
    assert isinstance(judge, ClassifierJudge)
    turns = [turn(reply, i) for i, reply in enumerate(["thanks!", "wrong, again", "ok", "no", "perfect, works"])]
    try:
        verdicts = await asyncio.gather(*(judge.judge(t) for t in turns))
    finally:
        await judge.aclose()
    assert judge.batches == 1  # five turns in flight: one padded forward
    rewards = [v.reward for v in verdicts]
    for t, v in zip(turns, verdicts, strict=True):
        p = direct_p(classifier_dir, render_for_judge(t, cfg))
        assert v.reward == pytest.approx(2 * p - 1, abs=1e-4)  # padding changes nothing
        assert (v.judge, v.judge_model, v.votes[0].score) == ("classifier", str(classifier_dir), v.reward)
        assert v.votes[0].text.startswith("classifier p=")
    assert all(-1 <= r <= 1 for r in rewards) and max(rewards) - min(rewards) > 1e-3


async def test_batches_are_bounded_and_a_failed_forward_fails_its_turns(classifier_dir: Path) -> None:
    cfg = JudgeConfig(type="classifier", classifier=str(classifier_dir), classifier_batch_size=2,
                      classifier_batch_wait_ms=200)  # fmt: skip
    judge = ClassifierJudge(cfg)
    try:
        await asyncio.gather(*(judge.judge(turn("fine", i)) for i in range(5)))
        assert judge.batches == 3  # 2 + 2 + 1

        def broken(texts: list[str]) -> list[float]:
            raise RuntimeError("out of memory")

        judge.classifier.probabilities = broken  # type: ignore[method-assign]
        with pytest.raises(Exception, match="classifier forward failed: RuntimeError: out of memory"):
            await judge.judge(turn("fine"))
    finally:
        await judge.aclose()


def test_classifier_settings(tmp_path: Path, classifier_dir: Path) -> None:
    with pytest.raises(ValidationError, match="needs NEXTSTATE_JUDGE__CLASSIFIER"):
        JudgeConfig(type="classifier")
    assert not JudgeConfig(type="classifier", classifier="/x").uses_llm
    with pytest.raises(SettingsError, match="not an HF model folder"):
        SequenceClassifier(str(tmp_path), 1, 64)
    with pytest.raises(SettingsError, match="has 2 labels"):
        SequenceClassifier(str(classifier_dir), 2, 64)
