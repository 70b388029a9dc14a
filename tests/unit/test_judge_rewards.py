"""How m votes become a reward: graded and probability scores, the vote threshold, the mean.

Hand-built vote sets for each aggregation (services/judge/parsing.py), the settings that
choose it, and the float reward accepted end to end (ScoredTurn -> TrainSample).
"""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from services.buffer.rules import build_sample, classify
from services.judge.judges import plugin_result
from services.judge.metrics import score_label
from services.judge.parsing import ScoreScale, aggregate, majority, mean_score, parse_score
from services.judge.settings import JudgeConfig
from shared.schemas import ScoredTurn, Turn, Vote


@pytest.mark.parametrize(
    ("text", "scale", "expected"),
    [
        ("\\boxed{0.5}", "graded", 0.5),
        ("\\boxed{-0.25}", "graded", -0.25),
        ("\\boxed{-.25}", "graded", -0.25),
        ("\\boxed{+0.4}", "graded", 0.4),
        ("\\boxed{−0.75}", "graded", -0.75),  # unicode minus
        ("\\boxed{\\text{0.3}}", "graded", 0.3),
        ("\\boxed{$-1$}", "graded", -1.0),
        ("\\boxed{1}", "graded", 1.0),
        ("\\boxed{0}", "graded", 0.0),
        ("\\boxed{-0}", "graded", 0.0),
        ("at first \\boxed{1} then \\boxed{0.2}", "graded", 0.2),  # the last box counts
        ("\\boxed{1.5}", "graded", None),  # out of range: unparsable, never clipped
        ("\\boxed{-2}", "graded", None),
        ("\\boxed{1e-1}", "graded", None),  # no exponents
        ("\\boxed{50\\%}", "graded", None),  # no percentages
        ("\\boxed{1/2}", "graded", None),
        ("\\boxed{0.5} then \\boxed{high}", "graded", None),
        ("no box", "graded", None),
        ("\\boxed{0.8}", "probability", 0.6),  # 2p - 1
        ("\\boxed{0.5}", "probability", 0.0),
        ("\\boxed{1}", "probability", 1.0),
        ("\\boxed{0}", "probability", -1.0),
        ("\\boxed{0.05}", "probability", -0.9),
        ("\\boxed{-0.2}", "probability", None),  # not a probability
        ("\\boxed{1.01}", "probability", None),
        ("\\boxed{0.5}", "label", None),  # labels only: a graded answer is unparsable
        ("\\boxed{-1}", "label", -1),
    ],
)
def test_parse_score_on_each_scale(text: str, scale: ScoreScale, expected: float | None) -> None:
    got = parse_score(text, scale)
    if expected is None:
        assert got is None
    else:
        assert got is not None and got == pytest.approx(expected, abs=1e-12)
        assert not (got == 0 and math.copysign(1, got) < 0)  # never -0.0


@pytest.mark.parametrize(
    ("scores", "threshold", "expected"),
    [
        # default: strictly more than half of the valid votes
        ([1, 1, -1], None, 1),
        ([1, 1, -1, 0], None, 0),  # 2 of 4 is not more than half (a plurality is not enough)
        ([1, 1, 1, -1, 0], None, 1),
        ([1, None, None], None, 1),  # shares count valid votes only
        ([None, None], None, 0),
        # a threshold: the share a label needs (at least)
        ([1, 1, 1, -1, -1], 0.6, 1),  # 3 of 5 = 0.6 reaches 0.6
        ([1, 1, -1, -1, 0], 0.6, 0),
        ([1, 1, -1], 0.6, 1),  # 2/3
        ([1, 1, -1], 0.7, 0),  # 2/3 < 0.7
        ([-1, -1, -1, 1], 0.75, -1),
        ([-1, -1, -1, 1], 0.8, 0),
        ([1, 1, 1, 1, None], 1.0, 1),  # unanimity of the valid votes
        ([1, 1, 1, 0], 1.0, 0),
        ([1, 1, -1, -1], 0.5, 0),  # two labels reach it: no winner
        ([1, 1, -1, 0], 0.5, 1),
        ([0, 0, 0, 1, 1], 0.6, 0),  # the label 0 wins: reward 0
    ],
)
def test_majority_with_a_threshold(scores: list[int | None], threshold: float | None, expected: int) -> None:
    assert majority(scores, threshold) == expected


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        ([0.5, 0.7, 0.9], 0.7),
        ([1.0, -1.0], 0.0),
        ([0.6, None, -0.2], 0.2),  # unparsable votes do not count
        ([None, None], 0.0),
        ([], 0.0),
        ([-1.0, -1.0, -0.4], -0.8),
    ],
)
def test_mean_of_graded_votes(scores: list[float | None], expected: float) -> None:
    assert mean_score(scores) == pytest.approx(expected)


def test_aggregate_picks_the_rule_by_scale() -> None:
    votes = [1.0, 1.0, -1.0, 0.0]
    assert aggregate(votes, "label", None) == 0  # 2 of 4: no strict majority
    assert aggregate(votes, "label", 0.5) == 1
    assert aggregate(votes, "graded", None) == pytest.approx(0.25)
    assert aggregate([0.6, 0.2, None], "probability", None) == pytest.approx(0.4)


def test_settings_scores_threshold_and_prompt() -> None:
    assert JudgeConfig().prompt_version == "prm-v1" and JudgeConfig().vote_threshold is None
    assert JudgeConfig(scores="graded").prompt_version == "prm-graded-v1"
    assert JudgeConfig(scores="probability").prompt_version == "prm-prob-v1"
    assert JudgeConfig(scores="graded", prompt_version="prm-v1").prompt_version == "prm-v1"
    assert JudgeConfig(vote_threshold=0.6).vote_threshold == 0.6
    with pytest.raises(ValidationError, match="VOTE_THRESHOLD applies to labels"):
        JudgeConfig(scores="graded", vote_threshold=0.6)
    for bad in (0, 1.5):
        with pytest.raises(ValidationError, match="vote_threshold"):
            JudgeConfig(vote_threshold=bad)


def test_plugins_may_return_graded_scores() -> None:
    assert plugin_result("m:f", 0.25) == (0.25, "")
    assert plugin_result("m:f", (-1, "bad")) == (-1.0, "bad")
    assert score_label(0.25) == "(0,1)" and score_label(-0.5) == "(-1,0)" and score_label(-1.0) == "-1"


def a_scored(reward: float, votes: list[Vote]) -> ScoredTurn:
    turn = Turn(
        session_id="s", messages=[{"role": "user", "content": "hi"}],
        response={"role": "assistant", "content": "hello"}, prompt_ids=[1, 2], response_ids=[3, 4],
        response_logprobs=[-0.1, -0.2], next_state=[{"role": "user", "content": "thanks"}],
    )  # fmt: skip
    return ScoredTurn(turn=turn, reward=reward, votes=votes)


def test_a_graded_reward_travels_to_the_train_sample() -> None:
    raw = "Partial progress. \\boxed{0.4}"
    scored = ScoredTurn.from_json(a_scored(0.35, [Vote(score=0.4, text=raw), Vote(score=0.3, text="x")]).to_json())
    assert scored.reward == 0.35 and scored.votes[0].text == raw  # the raw answer is kept
    assert classify(scored, "rl").eligible
    assert build_sample(scored, "rl").reward == 0.35
    for bad in (1.5, -1.01, math.nan):
        with pytest.raises(ValidationError):
            a_scored(bad, [])
    with pytest.raises(ValidationError):
        Vote(score=2.0)


def test_topk_settings() -> None:
    opd = {"mode": "opd", "engine_url": "http://127.0.0.1:1", "tokenizer": "/t"}
    assert JudgeConfig(**opd, topk=50).topk == 50 and JudgeConfig().topk == 0
    with pytest.raises(ValidationError, match="needs MODE=opd or combine"):
        JudgeConfig(topk=5)
    with pytest.raises(ValidationError, match="ENGINE_KIND=sglang"):
        JudgeConfig(**opd, topk=5, engine_kind="vllm")
