"""The buffer's inclusion, at-least-one, staleness and sample-building rules (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from services.buffer.archive import decode, encode
from services.buffer.rules import build_sample, classify, is_final, staleness
from shared.schemas import Mode, SamplingParams, ScoredTurn, TrainBatch, Turn


def scored(
    reward: int = 1, *, judged: bool = True, teacher: bool = False, closed_by: str = "next_request",
    next_state: bool = True, turn_type: str = "main", response_ids: list[int] | None = None,
    logprobs: bool = True, policy_version: int = 3,
) -> ScoredTurn:
    ids = [7, 8, 9] if response_ids is None else response_ids
    turn: dict[str, Any] = dict(
        session_id="s", turn_index=2, turn_type=turn_type,
        messages=[{"role": "user", "content": "q"}], response={"role": "assistant", "content": "a"},
        prompt_ids=[1, 2, 3, 4], response_ids=ids,
        response_logprobs=[-0.5] * len(ids) if logprobs else None,
        sampling=SamplingParams(temperature=0.7), weight_version="w3", policy_version=policy_version,
        next_state=[{"role": "user", "content": "thanks"}] if next_state else None,
        closed_by=closed_by,
    )
    return ScoredTurn(
        turn=Turn(**turn), reward=reward, judged=judged,
        teacher_logprobs=[-0.25] * len(ids) if teacher else None,
    )


@pytest.mark.parametrize(
    ("mode", "reward", "teacher", "eligible", "reason"),
    [
        ("rl", 1, False, True, None),
        ("rl", -1, False, True, None),
        ("rl", 0, True, False, "zero_reward"),
        ("opd", 1, False, False, "no_teacher"),
        ("opd", 0, True, True, None),
        ("combine", 0, False, False, "zero_reward_no_teacher"),
        ("combine", 0, True, True, None),
        ("combine", -1, False, True, None),
    ],
)
def test_inclusion_by_mode(mode: Mode, reward: int, teacher: bool, eligible: bool, reason: str | None) -> None:
    v = classify(scored(reward, teacher=teacher), mode)
    assert (v.eligible, v.reason) == (eligible, reason)
    assert not v.final  # closed by the next request, with a next state


@pytest.mark.parametrize("mode", ["rl", "opd", "combine"])
def test_no_next_state_is_excluded_in_every_mode_but_may_be_forced(mode: Mode) -> None:
    v = classify(scored(0, judged=False, next_state=False, teacher=True, closed_by="ttl"), mode)
    assert not v.eligible and v.reason == "no_next_state"
    assert v.final and v.may_force


def test_final_turns() -> None:
    assert is_final(scored(closed_by="session_done"))
    assert is_final(scored(closed_by="ttl"))
    assert is_final(scored(closed_by="import", next_state=False, judged=False))
    assert not is_final(scored(closed_by="import"))
    assert not is_final(scored())
    # An unchosen choice of a group is never its session's last turn, judged or not: the
    # session went on with its sibling, so the at-least-one rule does not force it.
    unchosen = classify(scored(0, judged=False, next_state=False, closed_by="unchosen"), "rl")
    assert (unchosen.eligible, unchosen.reason, unchosen.final, unchosen.may_force) == (
        False, "no_next_state", False, False)
    assert not is_final(scored(closed_by="unchosen"))


def test_a_sample_keeps_its_group() -> None:
    s = scored()
    member = s.model_copy(update={"turn": s.turn.model_copy(update={"group_id": "g", "group_size": 2})})
    assert build_sample(member, "rl").group_id == "g" and build_sample(s, "rl").group_id is None


def test_side_and_empty_turns_are_never_samples() -> None:
    side = classify(scored(closed_by="session_done", turn_type="side"), "rl")
    assert (side.eligible, side.reason, side.may_force) == (False, "side", False)
    empty = classify(scored(closed_by="session_done", response_ids=[]), "rl")
    assert (empty.eligible, empty.reason, empty.may_force) == (False, "no_tokens", False)


def test_a_non_final_excluded_turn_is_not_forced() -> None:
    v = classify(scored(0), "rl")
    assert not v.eligible and not v.may_force


def test_staleness() -> None:
    s = scored(policy_version=3)
    assert staleness(s, None) is None  # no trainer version yet
    assert staleness(s, 5) == 2
    assert staleness(s, 1) == 0  # a rollback put the trainer behind: not negative
    assert staleness(scored(policy_version=3, logprobs=False), 60) is None  # imported: on-policy


def test_a_stale_forced_sample_is_an_anchor_only() -> None:
    sample = build_sample(scored(1, teacher=True), "combine", forced=True, anchor_only=True)
    assert sample.forced and sample.loss_mask == [1, 1, 1]
    assert sample.reward == 0.0 and sample.teacher_logprobs is None  # A = 0 in every mode
    assert sample.rollout_logprobs == [-0.5] * 3


def test_build_sample() -> None:
    s = scored(-1, teacher=True)
    sample = build_sample(s, "combine")
    assert sample.id == s.turn.id
    assert sample.tokens == [1, 2, 3, 4, 7, 8, 9]
    assert sample.response_length == 3 and sample.prompt_length == 4
    assert sample.loss_mask == [1, 1, 1]
    assert sample.reward == -1.0
    assert sample.rollout_logprobs == [-0.5] * 3
    assert sample.teacher_logprobs == [-0.25] * 3
    assert (sample.policy_version, sample.weight_version) == (3, "w3")
    assert sample.temperature == 0.7
    assert sample.mode == "combine" and not sample.forced
    assert (sample.session_id, sample.turn_index) == ("s", 2)


def test_forced_sample_trains_with_zero_advantage() -> None:
    s = scored(0, judged=False, next_state=False, closed_by="ttl")
    sample = build_sample(s, "rl", forced=True)
    assert sample.forced
    assert sample.loss_mask == [1, 1, 1]  # it trains: KL term and token-mean count it
    assert sample.reward == 0.0  # A = r = 0: no policy-gradient push
    assert sample.teacher_logprobs is None


def test_archive_roundtrip() -> None:
    samples = [build_sample(scored(r), "rl") for r in (1, -1)]
    batch = TrainBatch(samples=samples)
    data = encode([x.to_json() for x in batch.samples])
    assert data[:2] == b"\x1f\x8b"  # gzip
    assert decode(data) == samples
