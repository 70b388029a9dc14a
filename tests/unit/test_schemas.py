"""Message schemas: JSON round trips, and clear rejections of malformed input."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.errors import MalformedMessage
from shared.schemas import (
    EPISODE_SESSION_PREFIX,
    MESSAGE_TYPES,
    CheckpointFile,
    CheckpointManifest,
    CheckpointPublished,
    DeadLetter,
    EvalResult,
    Outcome,
    PolicyLoaded,
    Promotion,
    Replay,
    ScoredTurn,
    TaskResult,
    TrainBatch,
    TrainSample,
    Turn,
    Vote,
    episode_job_id,
    episode_session_id,
    eval_job_id,
    parse_message,
)


def a_turn(**kw: object) -> Turn:
    base: dict[str, object] = dict(
        session_id="s1",
        messages=[{"role": "user", "content": "hi"}],
        response={"role": "assistant", "content": "hello"},
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5],
        response_logprobs=[-0.5, -1.25],
        next_state=[{"role": "user", "content": "thanks!"}],
    )
    base.update(kw)
    return Turn(**base)  # type: ignore[arg-type]


def a_sample(**kw: object) -> TrainSample:
    base: dict[str, object] = dict(
        session_id="s1", tokens=[1, 2, 3, 4, 5], response_length=2, loss_mask=[1, 1],
        reward=1.0, rollout_logprobs=[-0.5, -1.25],
    )
    base.update(kw)
    return TrainSample(**base)  # type: ignore[arg-type]


EXAMPLES = [
    a_turn(user="alice"),
    ScoredTurn(turn=a_turn(), reward=1, votes=[Vote(score=1, text=r"\boxed{1}")], experience_ids=["t9"]),
    a_sample(),
    TrainBatch(samples=[a_sample(), a_sample(reward=-1.0)]),
    CheckpointManifest(run="r", version=3, files=[CheckpointFile(path="model.safetensors", size=10, sha256="0" * 64)]),
    CheckpointPublished(run="r", version=3, manifest="policies/r/v000003/manifest.json"),
    PolicyLoaded(run="r", version=3, weight_version="3", promotion="demo 0.8 >= 0.75"),
    EvalResult(id=eval_job_id("r", 3, "demo"), run="r", version=3, suite="demo", score=0.8, n=2,
               ci_low=0.3, ci_high=0.97, tasks=[TaskResult(task="q1", score=1.0, passed=True)]),
    Promotion(run="r", version=3, decision="refused", reasons=["drift 2.1 > 0.5"], scores={"drift": 2.1}),
    Outcome(id=episode_job_id("r", "toolcall", "t7", "g1", 2), run="r", env="toolcall", task_id="t7",
            session_id=episode_session_id(episode_job_id("r", "toolcall", "t7", "g1", 2), 1, "x9"),
            group="g1", group_index=2, group_size=4, reward=1.0, passed=True, details={"answer": "42"},
            policy_versions=[3, 4], steps=3, wall_s=2.5),
    Replay(id="experience.t9", session_id="s1", reason="experience"),
    DeadLetter(stream="turns", group="judge", entry_id="1-0", data="{}", error="boom", deliveries=5),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.type)
def test_round_trip(msg: object) -> None:
    data = msg.to_json()  # type: ignore[attr-defined]
    back = parse_message(data)
    assert back == msg
    assert type(back).from_json(data) == msg


def test_every_type_registered() -> None:
    assert {m.type for m in EXAMPLES} == set(MESSAGE_TYPES)


def test_unknown_type_rejected() -> None:
    with pytest.raises(MalformedMessage, match="type"):
        parse_message('{"type": "nope", "id": "x"}')


def test_not_json_rejected() -> None:
    with pytest.raises(MalformedMessage, match="not a valid"):
        parse_message("{not json")


def test_missing_fields_named() -> None:
    with pytest.raises(MalformedMessage) as exc:
        Turn.from_json('{"type": "turn"}')
    assert "session_id" in str(exc.value) and "messages" in str(exc.value)


def test_future_schema_version_rejected() -> None:
    data = a_turn().to_json().replace('"schema_version":1', '"schema_version":2')
    with pytest.raises(MalformedMessage, match="schema_version"):
        Turn.from_json(data)


def test_unknown_field_rejected() -> None:
    data = a_turn().to_json().replace('"type":"turn"', '"type":"turn","surprise":1')
    with pytest.raises(MalformedMessage, match="surprise"):
        Turn.from_json(data)


def test_group_members_are_consistent_and_old_turns_still_read() -> None:
    member = a_turn(group_id="chatcmpl-1", group_index=2, group_size=3, closed_by="unchosen", next_state=None)
    assert member.grouped and Turn.from_json(member.to_json()) == member
    with pytest.raises(ValueError, match="group_index 3 outside a group of 3"):
        a_turn(group_id="g", group_index=3, group_size=3)
    with pytest.raises(ValueError, match="needs a group_id"):
        a_turn(group_size=2)
    # A Turn written before groups existed (no group fields) reads as a turn of its own.
    old = a_turn().model_dump(exclude={"group_id", "group_index", "group_size"})
    again = Turn.model_validate(old)
    assert (again.group_id, again.group_index, again.group_size, again.grouped) == (None, 0, 1, False)
    assert a_sample(group_id="g").group_id == "g" and a_sample().group_id is None


def test_logprobs_must_align_with_ids() -> None:
    with pytest.raises(ValueError, match="response_logprobs has 1 entries for 2"):
        a_turn(response_logprobs=[-0.1])


def test_teacher_logprobs_must_align() -> None:
    with pytest.raises(ValueError, match="teacher_logprobs"):
        ScoredTurn(turn=a_turn(), reward=0, teacher_logprobs=[-1.0])


def test_sample_shapes_checked() -> None:
    with pytest.raises(ValueError, match="loss_mask has 1 entries"):
        a_sample(loss_mask=[1])
    with pytest.raises(ValueError, match="exceeds"):
        a_sample(response_length=9, loss_mask=[1] * 9, rollout_logprobs=None)
    with pytest.raises(ValueError, match="0 or 1"):
        a_sample(loss_mask=[1, 2])


def test_reward_values_limited() -> None:
    with pytest.raises(ValueError):
        ScoredTurn(turn=a_turn(), reward=2)  # type: ignore[arg-type]


def test_empty_batch_rejected() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        TrainBatch(samples=[])


def test_bad_sha_rejected() -> None:
    with pytest.raises(ValueError):
        CheckpointFile(path="x", size=1, sha256="xyz")


def test_outcome_is_an_episode_session() -> None:
    job = episode_job_id("r", "swe", "t1", "g", 0)
    assert episode_session_id(job, 2, "n").startswith(EPISODE_SESSION_PREFIX)
    with pytest.raises(ValidationError, match="session_id"):
        Outcome(run="r", env="swe", task_id="t1", session_id="user-session", group="g", reward=0.0)
    with pytest.raises(ValidationError, match="group_index"):
        Outcome(run="r", env="swe", task_id="t1", session_id=episode_session_id(job, 1, "n"), group="g",
                group_index=1, group_size=1, reward=0.0)
