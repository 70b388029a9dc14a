"""The reward-collapse alarm's pure parts: what a judged turn adds to the window, and how
`nextstate status` shows the window (services/judge/collapse.py, services/ctl/status.py)."""

from __future__ import annotations

import pytest

from services.ctl.status import render_rewards, rewards_snapshot
from services.judge.collapse import WindowState, is_undecided, value_of, window_entry
from shared.schemas import ScoredTurn, Turn, Vote


def scored(reward: float, scores: list[float | None], **kw: object) -> ScoredTurn:
    turn = Turn(session_id="s", messages=[{"role": "user", "content": "q"}],
                response={"role": "assistant", "content": "a"}, prompt_ids=[1], response_ids=[2],
                response_logprobs=[-0.1], next_state=[{"role": "user", "content": "thanks"}])
    votes = [Vote(score=s, text="" if s is None else f"\\boxed{{{s}}}") for s in scores]
    return ScoredTurn(id=turn.id, turn=turn, reward=reward, votes=votes, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("reward", "value"), [
    (1, "1"), (-1, "-1"), (0, "0"), (1.0, "1"), (0.5, "0.5"), (-0.3, "-0.3"), (0.04, "0"),
    (-0.04, "0"), (0.96, "1"), (0.25, "0.2"), (-0.66, "-0.7"),
])  # fmt: skip
def test_values_are_rewards_to_one_decimal(reward: float, value: str) -> None:
    assert value_of(reward) == value


@pytest.mark.parametrize(("scores", "undecided"), [
    ([1, 1, -1], False), ([0, 0, 1], False),  # a 0 that wins the vote is a decision
    ([1, -1, 0], True), ([1, -1, None], True), ([None, None, None], True),  # ties, nothing readable
    ([None, None, 1], False),  # unparsable votes are dropped: the one valid vote decides
    ([1], False),  # a rule or plugin judge's single vote
])  # fmt: skip
def test_undecided_labels(scores: list[float | None], undecided: bool) -> None:
    votes = [Vote(score=s) for s in scores]
    assert is_undecided(votes, "label", None) is undecided


def test_undecided_with_a_threshold_and_graded_votes() -> None:
    votes = [Vote(score=s) for s in (1, 1, -1)]
    assert not is_undecided(votes, "label", None)
    assert is_undecided(votes, "label", 0.8)  # 2 of 3 is not 80 %
    # graded and probability votes are averaged: undecided only when none is readable
    assert not is_undecided([Vote(score=0.4), Vote(score=-0.4)], "graded", None)
    assert is_undecided([Vote(score=None), Vote(score=None)], "probability", None)


def test_what_a_turn_adds_to_the_window() -> None:
    assert window_entry(scored(1, [1, 1, None]), "label", None) == ("1", False)
    assert window_entry(scored(0, [1, -1, 0]), "label", None) == ("0", True)
    assert window_entry(scored(0, [], judged=False), "label", None) is None  # no next state
    assert window_entry(scored(0, [], mode="opd"), "label", None) is None  # reward 0 by design
    assert window_entry(scored(0.6, [0.8, 0.4], mode="combine"), "graded", None) == ("0.6", False)


def test_state_from_the_scripts_reply() -> None:
    s = WindowState.from_reply([120, "1", 118, 3, "one-value", "", 7])
    assert (s.turns, s.top_value, s.top_count, s.undecided) == (120, "1", 118, 3)
    assert s.alarm == ("one-value",) and s.before == () and s.seq == 7
    assert s.share(s.top_count) == pytest.approx(118 / 120)
    both = WindowState.from_reply([b"10", b"0", b"10", b"10", b"one-value,undecided", b"undecided", 8])
    assert both.alarm == ("one-value", "undecided") and both.before == ("undecided",)


def test_status_shows_the_window_and_the_alarm() -> None:
    fields = {"turns": "200", "v:1": "196", "v:-1": "4", "v:0": "0", "undecided": "2", "alarm": "one-value",
              "alarm_since": "1000.0", "updated_at": "1010.0", "window": "200", "min_turns": "100",
              "value_share": "0.95", "undecided_share": "0.5"}
    snap = rewards_snapshot(fields)
    assert snap is not None
    assert snap["values"] == {"1": 0.98, "-1": 0.02} and snap["undecided"] == 0.01
    assert snap["alarm"] == ["one-value"]
    lines = render_rewards({"rewards": snap})
    assert lines[0] == "rewards over the last 200 judged turns: 1 98%, -1 2%; undecided 1%"
    assert "REWARD COLLAPSE" in lines[1] and "one value (1) holds 98% (alarm at 95%)" in lines[1]
    healthy = rewards_snapshot({**fields, "alarm": "", "alarm_since": "", "v:1": "120", "v:-1": "80"})
    assert healthy is not None and healthy["alarm"] == []
    assert len(render_rewards({"rewards": healthy})) == 1
    undecided = rewards_snapshot({**fields, "alarm": "undecided", "undecided": "150"})
    assert "75% undecided" in render_rewards({"rewards": undecided})[1]
    assert rewards_snapshot({}) is None and render_rewards({"rewards": None}) == []
