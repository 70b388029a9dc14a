"""OPD end to end: the real judge process, the scripted stand-in (hint votes), the real CPU engine.

What the trainer relies on: teacher_prompt_ids are the policy's chat template over the
turn's messages with the hint appended to the last user message, and teacher_logprobs
are the engine's own log-probs of exactly teacher_prompt_ids + response_ids, one per
response token. The engine requires an internal token, which the judge sends (the
stand-in judge model, another server, is never sent it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.ctl.infra import free_port
from shared.auth import bearer
from shared.chat import ChatTemplate
from shared.schemas import ScoredTurn, Turn
from shared.settings import Settings
from shared.streams import Bus
from tests.integration.test_judge_service import all_acked, eventually, get, scored, start_judge
from tests.support.collector_harness import engine_process
from tests.support.judge_standin import StandinThread

pytestmark = pytest.mark.integration

HINT = "The user wants the temperature in degrees Celsius."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOKEN = "opd-test-internal-token-0123"


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[str]:
    proc, url = engine_process(tiny_model, NEXTSTATE_INTERNAL__TOKEN=TOKEN)
    try:
        proc.wait_http(f"{url}/health", timeout=120)
        yield url
    finally:
        proc.stop()


@pytest.fixture
def standin() -> Iterator[StandinThread]:
    with StandinThread(free_port()) as s:
        yield s


@pytest.fixture
async def bus(settings: Settings) -> AsyncIterator[Bus]:
    async with Bus(settings) as b:
        yield b


@pytest.fixture(scope="module")
def template(tiny_model: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(tiny_model)


def opd_turn(template: ChatTemplate, session: str, directive: str, tools: Any = None) -> Turn:
    messages = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    response_ids = [*template.encode_text("It is 75 degrees and sunny in paris"), *template.stop_token_ids[:1]]
    return Turn(
        session_id=session, messages=messages, tools=tools,
        response={"role": "assistant", "content": "It is 75 degrees and sunny in paris"},
        prompt_ids=template.encode(messages, tools), response_ids=response_ids,
        response_logprobs=[-1.0] * len(response_ids),
        next_state=[{"role": "user", "content": f"In Celsius please. <<standin {directive}>>"}],
    )  # fmt: skip


def authed(env: dict[str, str]) -> dict[str, str]:
    return {**env, "NEXTSTATE_INTERNAL__TOKEN": TOKEN}


async def engine_logprobs(engine: str, ids: list[int], n: int) -> list[float]:
    """The engine's own log-probs of the last n of `ids`, from one raw /generate call."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": 0}
    async with httpx.AsyncClient(timeout=60, headers=bearer(TOKEN)) as client:
        resp = await client.post(f"{engine}/generate", json=body)
    entries = resp.json()["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids
    return [float(e[0]) for e in entries[-n:]]


async def test_combine_mode_hint_and_teacher_logprobs(
    bus: Bus, env: dict[str, str], standin: StandinThread, engine: str, template: ChatTemplate,
    tiny_model: Path, unique: str,
) -> None:  # fmt: skip
    hinted = opd_turn(template, f"{unique}-h", f"votes=1,1,-1; hint_votes=1,1,-1; hints=Too short.|{HINT}|x", TOOLS)
    plain = opd_turn(template, f"{unique}-p", "votes=-1; hint_votes=-1")
    # Token ids the engine refuses (4xx): hint kept, no teacher, not retried forever.
    refused = opd_turn(template, f"{unique}-r", f"votes=1; hint_votes=1; hints={HINT}").model_copy(
        update={"response_ids": [10**7], "response_logprobs": [-1.0]}
    )
    for t in (hinted, plain, refused):
        await bus.publish("turns", t)
    judge = start_judge(authed(env), standin.url, "opd", mode="combine", engine_url=engine,
                        tokenizer=str(tiny_model), timeout_s="30")
    try:
        await eventually(lambda: all_acked(bus), 60, "every turn judged")
        out = {s.id: s for s in await scored(bus)}
    finally:
        assert judge.stop() == 0

    s = out[hinted.id]
    assert (s.mode, s.reward, s.hint) == ("combine", 1, HINT)
    assert (s.judge, s.prompt_version, s.judge_model) == ("prm+opd", "prm-v1+hint-v1", "standin-judge")
    assert len(s.votes) == 3 and len(s.hint_votes) == 3
    assert sorted(v.score for v in s.hint_votes if v.score is not None) == [-1, 1, 1]

    expected_messages = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": f"What is the weather in Paris?\n\n[Hint] {HINT}"},
    ]
    assert s.teacher_prompt_ids == template.encode(expected_messages, TOOLS)
    assert s.teacher_prompt_ids != hinted.prompt_ids
    assert s.teacher_logprobs is not None and len(s.teacher_logprobs) == len(hinted.response_ids)
    own = await engine_logprobs(engine, s.teacher_prompt_ids + hinted.response_ids, len(hinted.response_ids))
    assert s.teacher_logprobs == pytest.approx(own, abs=1e-5)
    # The hint changes the context, hence the log-probs (the same response under the original prompt).
    original = await engine_logprobs(engine, hinted.prompt_ids + hinted.response_ids, len(hinted.response_ids))
    assert max(abs(a - b) for a, b in zip(original, s.teacher_logprobs, strict=True)) > 1e-4

    p = out[plain.id]
    assert (p.mode, p.reward, p.hint, p.teacher_prompt_ids, p.teacher_logprobs) == ("combine", -1, None, None, None)
    r = out[refused.id]
    assert (r.reward, r.hint, r.teacher_prompt_ids, r.teacher_logprobs) == (1, HINT, None, None)
    assert await bus.redis.xlen(bus.keys.dead) == 0


async def test_opd_mode_only_hints(
    bus: Bus, env: dict[str, str], standin: StandinThread, engine: str, template: ChatTemplate,
    tiny_model: Path, unique: str,
) -> None:  # fmt: skip
    turn = opd_turn(template, unique, f"hint_votes=1; hints={HINT}")
    await bus.publish("turns", turn)
    judge = start_judge(authed(env), standin.url, "opd-only", mode="opd", engine_url=engine,
                        tokenizer=str(tiny_model), timeout_s="30", topk="4")
    try:
        await eventually(lambda: all_acked(bus), 60, "the turn judged")
        (s,) = await scored(bus)
        ready = (await get(f"{judge.ops}/readyz")).json()
    finally:
        assert judge.stop() == 0
    assert isinstance(s, ScoredTurn)
    assert (s.mode, s.reward, s.judge, s.prompt_version, s.hint) == ("opd", 0, "opd", "hint-v1", HINT)
    assert s.votes == [] and len(s.hint_votes) == 3 and s.teacher_logprobs is not None
    own = await engine_logprobs(engine, (s.teacher_prompt_ids or []) + turn.response_ids, len(turn.response_ids))
    assert s.teacher_logprobs == pytest.approx(own, abs=1e-5)
    assert ready["checks"] == {"redis": "ok", "judge": "ok", "engine": "ok"}
    # TOPK=4: per response token the teacher's 4 most likely ids, best first, as the engine gives them
    ids, lps = s.teacher_topk_ids, s.teacher_topk_logprobs
    assert ids is not None and lps is not None and len(ids) == len(lps) == len(turn.response_ids)
    want = await engine_top(engine, (s.teacher_prompt_ids or []) + turn.response_ids, len(turn.response_ids), 4)
    for j, (row_ids, row_lps) in enumerate(zip(ids, lps, strict=True)):
        assert len(row_ids) == len(set(row_ids)) == 4 and row_lps == sorted(row_lps, reverse=True)
        assert row_ids == [t for t, _ in want[j]] and row_lps == pytest.approx([lp for _, lp in want[j]], abs=1e-5)
        if turn.response_ids[j] in row_ids:  # the chosen token's log-prob agrees with teacher_logprobs
            assert row_lps[row_ids.index(turn.response_ids[j])] == pytest.approx(s.teacher_logprobs[j], abs=1e-5)


async def engine_top(engine: str, ids: list[int], n: int, k: int) -> list[list[tuple[int, float]]]:
    """The engine's own top-k of the last n positions of `ids`, from one raw /generate call."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": k}
    async with httpx.AsyncClient(timeout=60, headers=bearer(TOKEN)) as client:
        resp = await client.post(f"{engine}/generate", json=body)
    rows = resp.json()["meta_info"]["input_top_logprobs"][-n:]
    return [[(int(e[1]), float(e[0])) for e in row] for row in rows]
