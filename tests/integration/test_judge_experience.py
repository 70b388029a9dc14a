"""Experiential learning end to end: the real judge process, the stand-in judge model as a
process of its own (scripted lessons), real Redis, the real CPU engine as the teacher.

What the trainer relies on: a session's turns are published once its experience exists,
each with teacher_prompt_ids = the policy's chat template over the turn's messages with the
lessons in the system message, and teacher log-probs (and top-K) that are the engine's own
for exactly those ids + the turn's response ids. What the operator relies on: the store is
bounded and says where each lesson came from; a judge SIGKILLed mid-replay loses no turn.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.ctl.infra import free_port
from services.judge.experience import Experience, experience_block, user_key, with_experience
from shared import keys as K
from shared.chat import ChatTemplate
from shared.schemas import Replay, ScoredTurn, Turn
from shared.settings import Settings
from shared.streams import Bus
from tests.integration.test_judge_opd import TOKEN, authed, engine_logprobs, engine_top
from tests.integration.test_judge_service import Judge, scored, start_judge
from tests.support.collector_harness import engine_process
from tests.support.judge_standin import StandinProcess
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

LESSONS = ["Answer in one short sentence.", "Give temperatures in degrees Celsius."]


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[str]:
    proc, url = engine_process(tiny_model, NEXTSTATE_INTERNAL__TOKEN=TOKEN)
    try:
        proc.wait_http(f"{url}/health", timeout=120)
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def standin() -> Iterator[StandinProcess]:
    with StandinProcess(free_port()) as s:
        yield s


@pytest.fixture(scope="module")
def template(tiny_model: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(tiny_model)


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[Bus]:
    async with Bus(settings) as b:
        yield b


def experience_judge(env: dict[str, str], standin: StandinProcess, engine: str, tiny_model: Path, name: str,
                     **judge: str) -> Judge:  # fmt: skip
    return start_judge(authed(env), standin.url, name, mode=judge.pop("mode", "opd"), teacher="experience",
                       engine_url=engine, tokenizer=str(tiny_model), timeout_s=judge.pop("timeout_s", "30"),
                       experience_sweep_s="0.1", **judge)  # fmt: skip


class Session:
    """A conversation turn by turn, as the collector captures it."""

    def __init__(self, template: ChatTemplate, sid: str, system: str, user: str | None = None) -> None:
        self.template, self.sid, self.user = template, sid, user
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        self.index = 0

    def turn(self, request: str, answer: str, reply: str | None, **kw: Any) -> Turn:
        self.messages.append({"role": "user", "content": request})
        ids = [*self.template.encode_text(answer), *self.template.stop_token_ids[:1]]
        turn = Turn(
            session_id=self.sid, turn_index=self.index, user=self.user, messages=list(self.messages),
            response={"role": "assistant", "content": answer},
            prompt_ids=self.template.encode(self.messages), response_ids=ids, response_logprobs=[-1.0] * len(ids),
            next_state=None if reply is None else [{"role": "user", "content": reply}],
            closed_by="session_done" if reply is None else "next_request", **kw,
        )  # fmt: skip
        self.messages.append(turn.response)
        self.index += 1
        return turn


async def published(bus: Bus) -> dict[str, ScoredTurn]:
    return {s.id: s for s in await scored(bus)}


async def group_done(bus: Bus, stream: str) -> bool:
    groups = await bus.redis.xinfo_groups(bus.keys.stream(stream))
    return bool(groups) and int(groups[0]["pending"]) == 0 and groups[0]["lag"] == 0


async def records(bus: Bus, key: str) -> list[Experience]:
    return [Experience.model_validate_json(r) for r in await bus.redis.lrange(key, 0, -1)]


async def test_a_session_is_distilled_against_its_own_experience_once_it_ends(
    bus: Bus, env: dict[str, str], standin: StandinProcess, engine: str, template: ChatTemplate,
    tiny_model: Path, unique: str,
) -> None:  # fmt: skip
    s = Session(template, f"{unique}-a", "You are a weather bot. <<standin lessons=" + "|".join(LESSONS) + ">>",
                user="alice")
    t0 = s.turn("What is the weather in Paris?", "It is 75 degrees and sunny in Paris today.", "Too long. Celsius?")
    t1 = s.turn("Too long. Celsius?", "It is 24 degrees.", "Thanks!")
    end = s.turn("Thanks!", "Bye", None)
    judge = experience_judge(env, standin, engine, tiny_model, "exp-a", topk="4")
    try:
        for t in (t0, t1):
            await bus.publish("turns", t)
        held = bus.keys.experience_held(s.sid)
        await eventually(lambda: group_done(bus, K.TURNS), 30, "both turns taken")
        assert sorted(await bus.redis.hkeys(held)) == sorted([t0.id, t1.id])
        assert await published(bus) == {}  # held: nothing is distilled before the session's experience
        await bus.publish("turns", end)
        await eventually(lambda: _count(bus, 3), 60, "the session's three turns published")
        await eventually(lambda: group_done(bus, K.REPLAYS), 30, "the replay acknowledged")
        # A turn of the session that comes after its end is scored at once, with its experience.
        late = t1.model_copy(update={"id": f"{unique}-late"})
        await bus.publish("turns", late)
        await eventually(lambda: _count(bus, 4), 60, "the late turn published")
        out = await published(bus)
    finally:
        assert judge.stop() == 0

    # The store: the session's record with its provenance, in the global and the user's list.
    (raw,) = (await bus.redis.hgetall(bus.keys.experience_session(s.sid))).values()
    record = Experience.model_validate_json(raw)
    assert (record.id, record.session_id, record.user, record.lessons) == (end.id, s.sid, "alice", LESSONS)
    assert record.turn_ids == [*sorted([t0.id, t1.id]), end.id] and record.turn_index == 2
    assert (record.prompt_version, record.extractor_model) == ("experience-v1", "standin-judge")
    assert [r.id for r in await records(bus, bus.keys.experience_global)] == [end.id]
    assert [r.id for r in await records(bus, bus.keys.experience_user(user_key("alice")))] == [end.id]
    assert 0 < await bus.redis.ttl(bus.keys.experience_session(s.sid)) <= 7 * 24 * 3600
    assert not await bus.redis.exists(bus.keys.experience_held(s.sid))
    assert await bus.redis.zscore(bus.keys.experience_waiting, s.sid) is None
    (replay,) = [Replay.from_json(f["data"]) for _, f in await bus.redis.xrange(bus.keys.replays)]
    assert (replay.id, replay.session_id, replay.reason) == (f"experience.{end.id}", s.sid, "experience")

    block, _ = experience_block([record], 2000)
    assert block is not None and all(lesson in block for lesson in LESSONS)
    for turn in (t0, t1, late):
        got = out[turn.id]
        assert (got.mode, got.reward, got.judge, got.prompt_version) == ("opd", 0, "experience", "experience-v1")
        assert got.experience_ids == [end.id] and got.hint is None
        # The teacher prompt: the turn's own context, the lessons in its system message.
        teacher_messages = with_experience(turn.messages, block)
        assert teacher_messages[0]["content"].endswith(block) and teacher_messages[1:] == turn.messages[1:]
        assert got.teacher_prompt_ids == template.encode(teacher_messages)
        ids = [*got.teacher_prompt_ids, *turn.response_ids]
        n = len(turn.response_ids)
        assert got.teacher_logprobs == pytest.approx(await engine_logprobs(engine, ids, n), abs=1e-5)
        top = await engine_top(engine, ids, n, 4)
        assert got.teacher_topk_ids == [[t for t, _ in row] for row in top]
        assert got.teacher_topk_logprobs is not None
        for row, want in zip(got.teacher_topk_logprobs, top, strict=True):
            assert row == pytest.approx([lp for _, lp in want], abs=1e-5)
    assert (out[end.id].judged, out[end.id].teacher_logprobs) == (False, None)
    assert await bus.redis.xlen(bus.keys.dead) == 0


async def _count(bus: Bus, n: int) -> bool:
    return len(await published(bus)) >= n


async def test_the_store_is_bounded_and_cross_sessions_use_the_most_relevant(
    bus: Bus, env: dict[str, str], standin: StandinProcess, engine: str, template: ChatTemplate,
    tiny_model: Path, unique: str,
) -> None:  # fmt: skip
    topics = ["volcanoes", "penguins", "trains", "castles", "tulips"]
    judge = experience_judge(env, standin, engine, tiny_model, "exp-b", experience_scope="cross",
                             experience_store_max="3", experience_records="1", experience_wait_s="1")
    try:
        endings = []
        for i, topic in enumerate(topics):  # one at a time: the lists are newest first
            lesson = f"Answer questions about {topic} with one fact."
            s = Session(template, f"{unique}-{topic}", f"Be brief. <<standin lessons={lesson}>>", user="bob")
            endings.append(s.turn(f"Tell me about {topic}.", f"{topic.title()} are fine.", None))
            await bus.publish("turns", endings[-1])
            await eventually(lambda i=i: _count(bus, i + 1), 30, f"ending {i} judged")
        # A session of bob's that never ends: the sweep replays its turn after EXPERIENCE_WAIT_S,
        # with the stored lesson that shares the most words with its request.
        other = Session(template, f"{unique}-open", "Be brief.", user="bob")
        turn = other.turn("Which trains are fastest?", "The Shinkansen and the TGV are fast trains.", "ok")
        await bus.publish("turns", turn)
        await eventually(lambda: _count(bus, 6), 60, "the open session's turn replayed at its deadline")
        out = await published(bus)
        replays = [Replay.from_json(f["data"]) for _, f in await bus.redis.xrange(bus.keys.replays)]
    finally:
        assert judge.stop() == 0

    newest = [e.id for e in reversed(endings[-3:])]
    assert [r.id for r in await records(bus, bus.keys.experience_global)] == newest
    assert [r.id for r in await records(bus, bus.keys.experience_user(user_key("bob")))] == newest
    assert len(await bus.redis.hgetall(bus.keys.experience_session(f"{unique}-volcanoes"))) == 1  # still its own
    got = out[turn.id]
    assert got.experience_ids == [endings[2].id]  # trains, not the newer castles or tulips
    record = Experience.model_validate_json(
        (await bus.redis.hgetall(bus.keys.experience_session(f"{unique}-trains")))[endings[2].id])
    block, _ = experience_block([record], 2000)
    assert block is not None and got.teacher_prompt_ids == template.encode(with_experience(turn.messages, block))
    assert [(r.session_id, r.reason) for r in replays if r.session_id == other.sid] == [(other.sid, "deadline")]
    assert not await bus.redis.exists(bus.keys.experience_held(other.sid))


async def test_a_judge_killed_mid_replay_loses_no_turn(
    bus: Bus, env: dict[str, str], standin: StandinProcess, engine: str, template: ChatTemplate,
    tiny_model: Path, unique: str,
) -> None:  # fmt: skip
    """combine: each held turn's reward votes take 0.4 s x its index, so the replay publishes them
    one by one; the judge is SIGKILLed after the first few and restarted under its name."""
    s = Session(template, f"{unique}-k", f"Be brief. <<standin lessons={LESSONS[0]}>>", user="carol")
    turns = [s.turn(f"Question {i}?", f"Answer {i}.", f"Too long. <<standin votes=-1; delays={0.4 * i:.1f}>>")
             for i in range(10)]
    end = s.turn("Bye", "Bye", None)
    judge = experience_judge(env, standin, engine, tiny_model, "exp-k", mode="combine", timeout_s="10")
    try:
        for t in turns:
            await bus.publish("turns", t)
        await eventually(lambda: _held(bus, s.sid, 10), 30, "ten turns held")
        await bus.publish("turns", end)
        await eventually(lambda: _count(bus, 4), 60, "the replay under way")
        judge.kill()
        before = len(await published(bus))
        assert before < 11, "the replay finished before the kill: make the votes slower"
        judge = experience_judge(env, standin, engine, tiny_model, "exp-k", mode="combine", timeout_s="10")
        await eventually(lambda: _count(bus, 11), 60, "every turn published after the restart")
        await eventually(lambda: group_done(bus, K.REPLAYS), 30, "the replay acknowledged")
        entries = await scored(bus)
    finally:
        assert judge.stop() == 0
    ids = [e.id for e in entries]
    assert set(ids) == {t.id for t in [*turns, end]}  # none lost
    # A turn published just before the kill and before its release is published again, with
    # its turn id as the message id: the buffer's consumer takes it once.
    assert len(ids) - len(set(ids)) <= 16
    for e in entries:
        if e.id != end.id:
            assert (e.mode, e.reward, e.judge) == ("combine", -1, "prm+experience")
            assert e.experience_ids == [end.id] and e.teacher_logprobs is not None
    assert not await bus.redis.exists(bus.keys.experience_held(s.sid))
    assert await bus.redis.xlen(bus.keys.dead) == 0
    print(json.dumps({"published_before_kill": before, "duplicates": len(ids) - len(set(ids))}))


async def _held(bus: Bus, sid: str, n: int) -> bool:
    return int(await bus.redis.hlen(bus.keys.experience_held(sid))) >= n
