"""A real tool call end to end: the OpenAI SDK sends tools, a tiny model trained to call
`get_weather` answers (greedy) with a Hermes tool call, the collector returns it as
OpenAI `tool_calls` (whole and streamed), and the tool result the agent sends next is
captured as that turn's next state."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from shared.chat import ChatTemplate
from tests.support.collector_harness import (
    Turns,
    check_turn,
    collector_process,
    engine_process,
    wait_ready,
)
from tests.support.tool_model import (
    ANSWER,
    CALL_ARGS,
    QUESTIONS,
    TOOL_RESULT,
    TOOLS,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(tool_model: Path, redis_url: str) -> Iterator[dict[str, str]]:
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    env = {"NEXTSTATE_ENV": "test", "NEXTSTATE_REDIS__URL": redis_url,
           "NEXTSTATE_REDIS__PREFIX": prefix}  # fmt: skip
    engine = engine_process(tool_model)
    collector = collector_process(env, engine[1])
    try:
        wait_ready(engine, collector)
        yield {"url": collector[1], "prefix": prefix, "redis": redis_url}
    finally:
        rc = collector[0].stop()
        engine[0].stop()
    assert rc == 0, collector[0].logs()


@pytest.fixture(scope="module")
def tpl(tool_model: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(tool_model)


@pytest.fixture
def client(stack: dict[str, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack["url"] + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def turns(stack: dict[str, str]) -> Iterator[Turns]:
    t = Turns(stack["redis"], stack["prefix"])
    yield t
    t.close()


def tool_result(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT}


def test_tool_call_and_its_result_as_the_next_state(
    client: openai.OpenAI, turns: Turns, tpl: ChatTemplate
) -> None:
    msgs: list[Any] = [{"role": "user", "content": QUESTIONS[0]}]
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=msgs, tools=TOOLS, temperature=0, max_tokens=64  # type: ignore[arg-type]
    )
    sid = raw.headers["x-session-id"]
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL_ARGS
    # The agent runs the tool and sends the result; the model answers from it.
    msgs += [choice.message.model_dump(exclude_none=True), tool_result(call.id)]
    answer = client.chat.completions.create(
        model="m", messages=msgs, tools=TOOLS, temperature=0, max_tokens=64,  # type: ignore[arg-type]
        extra_headers={"X-Session-Done": "1"},
    )
    assert answer.choices[0].message.content == ANSWER
    assert answer.choices[0].finish_reason == "stop"
    got = sorted(turns.wait(lambda ts: len(ts) == 2, sessions=[sid]), key=lambda t: t.turn_index)
    first, second = got
    assert first.closed_by == "next_request"
    assert first.next_state == [tool_result(call.id)]
    assert first.response["tool_calls"][0]["id"] == call.id
    assert first.tools == TOOLS and first.finish_reason == "tool_calls"
    assert second.closed_by == "session_done" and second.response["content"] == ANSWER
    for t in got:
        check_turn(t, tpl)
    assert "<tool_call>" in tpl.decode(first.response_ids)


def test_streamed_tool_call_deltas(client: openai.OpenAI, turns: Turns, tpl: ChatTemplate) -> None:
    msgs: list[Any] = [{"role": "user", "content": QUESTIONS[1]}]
    with client.chat.completions.with_streaming_response.create(
        model="m", messages=msgs, tools=TOOLS, temperature=0, max_tokens=64, stream=True,  # type: ignore[arg-type]
        extra_headers={"X-Session-Done": "1"},
    ) as raw:
        sid = raw.headers["x-session-id"]
        chunks: list[Any] = list(raw.parse())
    calls: dict[int, dict[str, Any]] = {}
    content = ""
    for c in chunks:
        delta = c.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            fn = tc.function
            slot["name"] += (fn.name or "") if fn else ""
            slot["arguments"] += (fn.arguments or "") if fn else ""
    assert content == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == CALL_ARGS
    (t,) = turns.wait(lambda ts: len(ts) == 1, sessions=[sid])
    assert t.response["tool_calls"][0]["id"] == calls[0]["id"]
    check_turn(t, tpl)
