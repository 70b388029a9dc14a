"""Groups end to end: the official OpenAI SDK asks for n = 3 choices from the real collector
process in front of the CPU engine (tiny random model) with real Redis. The three choices
come back in one response and are captured as one group of three turns, each with the
engine's exact ids and log-probs; the follow-up that continues one choice closes that
turn with its next state, and the two others as NEXTSTATE_COLLECTOR__GROUP_UNCHOSEN says
(a collector for `keep` and one for `judge`, one engine behind them).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from shared.chat import ChatTemplate
from shared.engine_client import SGLangClient
from shared.schemas import SamplingParams, Turn
from tests.support.collector_harness import (
    Turns,
    check_turn,
    collector_process,
    engine_process,
    wait_ready,
)

pytestmark = pytest.mark.integration

# `drop` is the same close script with another argument: test_collector_groups.py runs it
# against a real Redis in process, sparing this module a third collector.
MODES = ("keep", "judge")


@pytest.fixture(scope="module")
def stack(tiny_model: Path, redis_url: str) -> Iterator[dict[str, Any]]:
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    env = {"NEXTSTATE_ENV": "test", "NEXTSTATE_REDIS__URL": redis_url,
           "NEXTSTATE_REDIS__PREFIX": prefix}  # fmt: skip
    engine, engine_url = engine_process(tiny_model)
    collectors = {mode: collector_process(env, engine_url, group_unchosen=mode) for mode in MODES}
    try:
        wait_ready((engine, engine_url), *collectors.values())
        yield {"urls": {m: url for m, (_, url) in collectors.items()}, "engine": engine_url,
               "prefix": prefix, "redis": redis_url}  # fmt: skip
    finally:
        codes = {m: proc.stop() for m, (proc, _) in collectors.items()}
        engine.stop()
    for mode, (proc, _) in collectors.items():
        assert codes[mode] == 0, proc.logs()
        assert "pick a colour" not in proc.logs()  # no conversation text in the logs


@pytest.fixture(scope="module")
def tpl(tiny_model: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(tiny_model)


@pytest.fixture
def turns(stack: dict[str, Any]) -> Iterator[Turns]:
    t = Turns(stack["redis"], stack["prefix"])
    yield t
    t.close()


def client(stack: dict[str, Any], mode: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack["urls"][mode] + "/v1", api_key="none", max_retries=0, timeout=60)


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


@pytest.mark.parametrize("mode", MODES)
def test_three_choices_are_one_group_and_the_follow_up_closes_the_chosen_one(
    stack: dict[str, Any], turns: Turns, tpl: ChatTemplate, mode: str
) -> None:
    msgs = [{"role": "system", "content": "be brief"}, user(f"pick a colour ({mode})")]
    with client(stack, mode) as c:
        raw = c.chat.completions.with_raw_response.create(
            model="tiny", messages=msgs, n=3, max_tokens=8, seed=21, temperature=1.0, logprobs=True,  # type: ignore[arg-type]
        )
        resp = raw.parse()
        sid = raw.headers["x-session-id"]
        assert raw.headers["x-policy-version"] == "0"
        assert [ch.index for ch in resp.choices] == [0, 1, 2]
        replies = [ch.message.model_dump(exclude_none=True) for ch in resp.choices]
        assert len({r["content"] for r in replies}) == 3, "seeds 21..23 should sample three answers"
        assert resp.usage is not None
        assert turns.of(sid) == []  # all three pending until a follow-up
        # The agent keeps choice 1 and goes on.
        follow = [*msgs, replies[1], user("that one, thanks")]
        c.chat.completions.create(model="tiny", messages=follow, max_tokens=4, extra_headers={"X-Session-Id": sid})  # type: ignore[arg-type]
    got = turns.wait(lambda ts: len(ts) == 3, sessions=[sid], what="the group's 3 turns")
    group = {t.group_index: t for t in got}
    assert set(group) == {0, 1, 2}
    for i, t in group.items():
        assert (t.group_id, t.group_size, t.completion_id) == (resp.id, 3, resp.id)
        assert (t.session_id, t.turn_index, t.messages) == (sid, 0, msgs)
        assert t.response["content"] == replies[i]["content"]
        assert t.sampling == SamplingParams(temperature=1.0, max_tokens=8, seed=21 + i)
        check_turn(t, tpl)  # exact prompt ids; response ids decode to the choice sent
        # The log-probs the client got are the captured ones (but a matched stop token's).
        sent = resp.choices[i].logprobs
        assert sent is not None and sent.content is not None
        assert [e.logprob for e in sent.content] == pytest.approx(t.response_logprobs[: len(sent.content)], abs=1e-6)
    chosen = group[1]
    assert chosen.closed_by == "next_request" and chosen.next_state == [user("that one, thanks")]
    for i in (0, 2):
        assert group[i].closed_by == "unchosen"
        assert group[i].next_state == (chosen.next_state if mode == "judge" else None)
    # Usage counts the prompt once and every choice's tokens, as OpenAI does.
    assert resp.usage.completion_tokens == sum(len(t.response_ids) for t in got)
    assert resp.usage.prompt_tokens == len(chosen.prompt_ids)
    # The engine itself, given a member's ids and seed, samples exactly its tokens.
    assert _direct(stack["engine"], chosen, tpl).output_ids == chosen.response_ids


def _direct(engine_url: str, t: Turn, tpl: ChatTemplate) -> Any:
    async def run() -> Any:
        async with SGLangClient(engine_url) as eng:
            return await eng.generate(t.prompt_ids, t.sampling, stop_token_ids=tpl.stop_token_ids)

    return asyncio.run(run())


def test_n_with_stream_and_n_over_the_limit_are_refused_in_openais_shape(stack: dict[str, Any]) -> None:
    with client(stack, "keep") as c:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="tiny", messages=[user("x")], n=2, stream=True)  # type: ignore[arg-type]
        body = info.value.body
        assert isinstance(body, dict) and body["param"] == "n" and body["code"] == "unsupported_value"
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="tiny", messages=[user("x")], n=17)  # type: ignore[arg-type]
        assert isinstance(info.value.body, dict) and info.value.body["param"] == "n"


def test_side_calls_with_n_are_served_not_captured(stack: dict[str, Any], turns: Turns) -> None:
    sid = f"side-{uuid.uuid4().hex[:8]}"
    with client(stack, "keep") as c:
        resp = c.chat.completions.create(model="tiny", messages=[user("title?")], n=2, max_tokens=4,  # type: ignore[arg-type]
                                         extra_headers={"X-Turn-Type": "side", "X-Session-Id": sid})  # fmt: skip
        assert len(resp.choices) == 2
        # A main call that ends its session is emitted at once: the side call left nothing.
        c.chat.completions.create(model="tiny", messages=[user("hello")], n=2, max_tokens=4,  # type: ignore[arg-type]
                                  extra_headers={"X-Session-Id": sid, "X-Session-Done": "1"})  # fmt: skip
    got = turns.wait(lambda ts: len(ts) == 2, sessions=[sid])
    assert sorted(t.group_index for t in got) == [0, 1]
    assert all(t.closed_by == "session_done" and t.messages == [user("hello")] for t in got)
