"""Reading judge answers: the last \\boxed{} verdict, the majority table, hints."""

from __future__ import annotations

from typing import Any

import pytest

from services.judge.opd import best_hint, with_hint
from services.judge.parsing import (
    Score,
    accepted_hint,
    extract_hint,
    last_boxed,
    majority,
    parse_score,
    unanimous,
    winning_label,
)
from shared.schemas import Vote


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The user thanks the assistant. \\boxed{1}", 1),
        ("\\boxed{-1}", -1),
        ("\\boxed{0}", 0),
        ("first \\boxed{1} then on reflection \\boxed{-1}", -1),  # the last one counts
        ("\\boxed{-1} ... no: \\boxed{1}", 1),
        ("\\boxed{ 1 }", 1),
        ("\\boxed {-1}", -1),
        ("\\boxed{+1}", 1),
        ("\\boxed{−1}", -1),  # unicode minus
        ("\\boxed{- 1}", -1),
        ("\\boxed{\\text{-1}}", -1),  # nested braces
        ("\\boxed{\\textbf{1}}", 1),
        ("$\\boxed{1}$", 1),
        ("\\boxed{$-1$}", -1),
        ("\\boxed{1.0}", 1),
        ("\\boxed{-0}", 0),
        ("<think>maybe \\boxed{1}</think> final \\boxed{0}", 0),
        ("no verdict at all", None),
        ("", None),
        ("\\boxed{}", None),
        ("\\boxed{yes}", None),
        ("\\boxed{2}", None),
        ("\\boxed{10}", None),
        ("\\boxed{1} and then \\boxed{maybe}", None),  # last box unreadable: no fallback
        ("\\boxed{1} and then \\boxed{-", None),  # cut off mid-box: no fallback
        ("boxed{1}", None),
    ],
)
def test_parse_score(text: str, expected: Score | None) -> None:
    assert parse_score(text) == expected


def test_last_boxed_balances_braces() -> None:
    assert last_boxed("\\boxed{a{b}c} x \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{open") is None
    assert last_boxed("nothing") is None


@pytest.mark.parametrize(
    ("scores", "expected"),
    [
        ([1, 1, -1], 1),
        ([-1, -1, 1], -1),
        ([1, -1], 0),
        ([1, -1, 0], 0),
        ([None, None, 1], 1),
        ([None, None, -1], -1),
        ([None, None, None], 0),
        ([], 0),
        ([0, 0, 1], 0),
        ([1, 1, 0], 1),
        ([1, 1, -1, -1], 0),
        ([1, 1, -1, -1, 0], 0),
        ([1, None, -1], 0),
        ([1], 1),
        ([0], 0),
        ([-1, -1, -1], -1),
        ([1, 1, 1, -1, -1], 1),
    ],
)
def test_majority(scores: list[Score | None], expected: Score) -> None:
    assert majority(scores) == expected
    winner = winning_label(scores)
    assert majority(scores) == (0 if winner is None else winner)
    # undecided: a tie or nothing valid; a 0 that wins the vote is a decision
    assert (winner is None) == (expected == 0 and not (scores.count(0) * 2 > sum(s is not None for s in scores)))


def test_unanimous() -> None:
    assert unanimous([1, 1, None])
    assert unanimous([None])
    assert unanimous([])
    assert not unanimous([1, -1])
    assert not unanimous([0, 1, 1])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("x [HINT_START] Use metric units. [HINT_END] \\boxed{1}", "Use metric units."),
        ("[HINT_START]\n  The user wants  Paris,\n not London. \n[HINT_END]", "The user wants Paris, not London."),
        ("[HINT_START] old [HINT_END] [HINT_START] new one [HINT_END]", "new one"),
        ("[HINT_START] never closed", None),
        ("[HINT_END] before [HINT_START]", None),
        ("[HINT_START]   [HINT_END]", None),
        ("no markers", None),
    ],
)
def test_extract_hint(text: str, expected: str | None) -> None:
    assert extract_hint(text) == expected


def test_accepted_hint_rejects_trivial_and_cuts_long() -> None:
    assert accepted_hint(None, 12, 100) is None
    assert accepted_hint("ok", 12, 100) is None
    assert accepted_hint("1234567890123", 12, 100) is None  # no words
    assert accepted_hint("Ask which city first.", 12, 100) == "Ask which city first."
    long = "word " * 100
    cut = accepted_hint(long.strip(), 12, 50)
    assert cut is not None and len(cut) <= 50 and not cut.endswith(" ")


def hint_vote(score: Score | None, hint: str | None) -> Vote:
    text = f"[HINT_START] {hint} [HINT_END] \\boxed{{{score}}}" if hint else f"\\boxed{{{score}}}"
    return Vote(score=score, text=text)


def test_best_hint_is_the_longest_among_votes_that_said_1() -> None:
    votes = [
        hint_vote(1, "Check the file exists first."),
        hint_vote(1, "The user wanted the answer in Celsius, not Fahrenheit."),
        hint_vote(-1, "An even longer hint from a vote that said the next state holds no lesson at all."),
        hint_vote(1, "ok"),
        Vote(score=None, text="", error="timeout"),
    ]
    assert best_hint(votes, 12, 800) == "The user wanted the answer in Celsius, not Fahrenheit."
    assert best_hint([hint_vote(-1, "A long enough hint here."), hint_vote(1, None)], 12, 800) is None
    assert best_hint([], 12, 800) is None


def test_with_hint_appends_to_the_last_user_message_only() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "weather in paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "sunny"},
    ]
    out = with_hint(messages, "Give degrees in Celsius.")
    assert out is not None
    assert out[3]["content"] == "weather in paris?\n\n[Hint] Give degrees in Celsius."
    assert [m for i, m in enumerate(out) if i != 3] == [m for i, m in enumerate(messages) if i != 3]
    assert messages[3]["content"] == "weather in paris?"  # the input is not mutated
    parts = with_hint([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "Be brief please.")
    assert parts is not None and parts[0]["content"][-1] == {"type": "text", "text": "[Hint] Be brief please."}
    assert with_hint([{"role": "system", "content": "s"}], "hint text here") is None
