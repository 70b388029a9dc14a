"""Every agent API against the real collector and CPU engine, with the real client libraries.

A tiny model trained on the spot to call `get_weather` (tests/support/tool_model.py)
serves: the OpenAI Agents SDK on its default Responses path (`Runner.run`,
`Runner.run_streamed`, a function tool), the `openai` client's `responses.create`
(plain, streamed, `previous_response_id` chains, resent history), the `anthropic`
client's `messages.create` / `messages.stream` with a tool-use round trip, and
`langchain-openai`'s `ChatOpenAI.bind_tools` (Chat Completions and Responses). For each,
the tool result (or the next user input) is the captured turn's next state, and the
turn's prompt ids equal those of the same conversation sent as a chat completion.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from shared.schemas import Turn
from tests.support.collector_harness import Turns, collector_process, engine_process, wait_ready
from tests.support.tool_model import (
    ANSWER,
    CALL_ARGS,
    QUESTIONS,
    STRICT_TOOLS,
    TOOL_RESULT,
    TOOLS,
    build_tool_model,
)

pytestmark = pytest.mark.integration

KEY = "apis-key"
FN = TOOLS[0]["function"]
RESPONSES_TOOLS = [{"type": "function", **FN}]  # the Responses API's flat function tool
ANTHROPIC_TOOLS = [{"name": FN["name"], "description": FN["description"], "input_schema": FN["parameters"]}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[dict[str, str]]:
    model = build_tool_model(tmp_path_factory.mktemp("api-model"), tool_sets=(TOOLS, STRICT_TOOLS))
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    env = {"NEXTSTATE_ENV": "test", "NEXTSTATE_REDIS__URL": redis_url,
           "NEXTSTATE_REDIS__PREFIX": prefix}  # fmt: skip
    engine = engine_process(model)
    # Greedy unless a request says otherwise: this anthropic client sends no temperature.
    collector = collector_process(env, engine[1], api_keys=KEY, default_temperature=0)
    try:
        wait_ready(engine, collector)
        yield {"url": collector[1], "prefix": prefix, "redis": redis_url}
    finally:
        rc = collector[0].stop()
        engine[0].stop()
    assert rc == 0, collector[0].logs()


@pytest.fixture
def client(stack: dict[str, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack["url"] + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def turns(stack: dict[str, str]) -> Iterator[Turns]:
    t = Turns(stack["redis"], stack["prefix"])
    yield t
    t.close()


def session() -> str:
    return "s-" + uuid.uuid4().hex[:12]


def by_index(turns: Turns, sid: str, n: int) -> list[Turn]:
    got = turns.wait(lambda ts: len(ts) >= n, sessions=[sid], timeout=30)
    return sorted(got, key=lambda t: t.turn_index)


def chat_prompt_ids(client: openai.OpenAI, turns: Turns, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]]) -> list[int]:  # fmt: skip
    """The prompt ids captured for this conversation sent as a chat completion."""
    sid = session()
    client.chat.completions.create(
        model="m", messages=messages, tools=tools, temperature=0, max_tokens=1,  # type: ignore[arg-type]
        extra_headers={"X-Session-Id": sid, "X-Session-Done": "1"},
    )  # fmt: skip
    (t,) = turns.wait(lambda ts: len(ts) == 1, sessions=[sid])
    return t.prompt_ids


def call_message(call_id: str) -> dict[str, Any]:
    fn = {"name": "get_weather", "arguments": json.dumps(CALL_ARGS)}
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": fn}]}  # fmt: skip


def tool_message(call_id: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT}


def check_tool_round(client: openai.OpenAI, turns: Turns, first: Turn, second: Turn, question: str,
                     tools: list[dict[str, Any]]) -> str:  # fmt: skip
    """The call turn and the answer turn of a tool round trip, each with the prompt ids of
    the same conversation sent as chat; returns the call id."""
    (call,) = first.response["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == CALL_ARGS
    assert first.finish_reason == "tool_calls" and first.closed_by == "next_request"
    assert first.next_state == [tool_message(call["id"])]
    assert second.response["content"] == ANSWER and second.turn_index == first.turn_index + 1
    user = {"role": "user", "content": question}
    assert first.prompt_ids == chat_prompt_ids(client, turns, [user], tools)
    assert second.prompt_ids == chat_prompt_ids(
        client, turns, [user, call_message(call["id"]), tool_message(call["id"])], tools)
    for t in (first, second):
        assert t.response_ids and t.response_logprobs and len(t.response_logprobs) == len(t.response_ids)
        assert t.weight_version and t.turn_type == "main"
    return str(call["id"])


# -- the OpenAI Agents SDK, on its default Responses path ------------------------------------


def weather_agent(client: openai.AsyncOpenAI, headers: dict[str, str]) -> tuple[Any, Any]:
    from agents import Agent, FunctionTool, ModelSettings, RunConfig
    from agents.models.openai_provider import OpenAIProvider

    async def get_weather(ctx: Any, args: str) -> str:
        assert json.loads(args) == CALL_ARGS
        return TOOL_RESULT

    tool = FunctionTool(name="get_weather", description=FN["description"],
                        params_json_schema=FN["parameters"], on_invoke_tool=get_weather,
                        strict_json_schema=False)  # fmt: skip
    settings = ModelSettings(temperature=0, max_tokens=64, extra_headers=headers)
    agent = Agent(name="weather", model="m", tools=[tool], model_settings=settings)
    config = RunConfig(model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
    return agent, config


@pytest.fixture
async def aclient(stack: dict[str, str]) -> Any:
    async with openai.AsyncOpenAI(base_url=stack["url"] + "/v1", api_key=KEY, max_retries=0,
                                  timeout=60) as c:  # fmt: skip
        yield c


async def say_thanks(aclient: openai.AsyncOpenAI, sid: str, items: list[Any]) -> None:
    """The user goes on: the answer's next state is that message (the turn ends the session)."""
    from agents import Runner

    agent, config = weather_agent(aclient, {"X-Session-Id": sid, "X-Session-Done": "1"})
    await Runner.run(agent, [*items, {"role": "user", "content": "thanks"}], run_config=config,
                     max_turns=1)  # fmt: skip


async def test_agents_sdk_runner_run(aclient: openai.AsyncOpenAI, client: openai.OpenAI,
                                     turns: Turns) -> None:  # fmt: skip
    from agents import Runner

    sid = session()
    agent, config = weather_agent(aclient, {"X-Session-Id": sid})
    result = await Runner.run(agent, QUESTIONS[0], run_config=config)
    assert result.final_output == ANSWER
    await say_thanks(aclient, sid, result.to_input_list())
    first, second, third = by_index(turns, sid, 3)[:3]
    check_tool_round(client, turns, first, second, QUESTIONS[0], STRICT_TOOLS)
    assert second.closed_by == "next_request"
    assert second.next_state == [{"role": "user", "content": "thanks"}]
    assert third.closed_by == "session_done"


async def test_agents_sdk_run_streamed(aclient: openai.AsyncOpenAI, client: openai.OpenAI,
                                       turns: Turns) -> None:  # fmt: skip
    from agents import Runner

    sid = session()
    agent, config = weather_agent(aclient, {"X-Session-Id": sid})
    streamed = Runner.run_streamed(agent, QUESTIONS[1], run_config=config)
    kinds = [e.data.type async for e in streamed.stream_events() if e.type == "raw_response_event"]
    assert streamed.final_output == ANSWER
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" in kinds
    assert kinds.count("response.completed") == 2
    await say_thanks(aclient, sid, streamed.to_input_list())
    first, second = by_index(turns, sid, 3)[:2]
    check_tool_round(client, turns, first, second, QUESTIONS[1], STRICT_TOOLS)
    assert second.next_state == [{"role": "user", "content": "thanks"}]


# -- the openai client's responses.create --------------------------------------------------------


def test_responses_create_and_previous_response_id_chain(
    client: openai.OpenAI, turns: Turns
) -> None:
    raw = client.responses.with_raw_response.create(
        model="m", input=QUESTIONS[0], tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=64,  # type: ignore[arg-type]
    )  # fmt: skip
    sid = raw.headers["x-session-id"]
    r1 = raw.parse()
    assert r1.status == "completed" and r1.id.startswith("resp_")
    (call,) = r1.output
    assert call.type == "function_call" and json.loads(call.arguments) == CALL_ARGS
    assert r1.usage is not None and r1.usage.output_tokens > 0
    assert client.responses.retrieve(r1.id).model_dump() == r1.model_dump()
    r2 = client.responses.create(
        model="m", previous_response_id=r1.id, tools=RESPONSES_TOOLS, temperature=0,  # type: ignore[arg-type]
        max_output_tokens=64,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}],
    )  # fmt: skip
    assert r2.output_text == ANSWER and r2.previous_response_id == r1.id
    r3 = client.responses.create(model="m", previous_response_id=r2.id, input="thanks",
                                 tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=8,  # type: ignore[arg-type]
                                 extra_headers={"X-Session-Done": "1"})  # fmt: skip
    assert r3.status in ("completed", "incomplete")
    first, second, third = by_index(turns, sid, 3)
    check_tool_round(client, turns, first, second, QUESTIONS[0], TOOLS)
    assert second.next_state == [{"role": "user", "content": "thanks"}]
    assert third.closed_by == "session_done" and third.completion_id == r3.id
    assert first.completion_id == r1.id and second.completion_id == r2.id


def test_responses_streamed_and_resent_history(client: openai.OpenAI, turns: Turns) -> None:
    user = {"role": "user", "content": QUESTIONS[1]}
    with client.responses.with_streaming_response.create(
        model="m", input=[user], tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=64,  # type: ignore[arg-type, list-item]
        stream=True, store=False,
    ) as raw:  # fmt: skip
        sid = raw.headers["x-session-id"]
        events = list(raw.parse())
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == CALL_ARGS
    # store=False: nothing to continue from; the agent resends the history instead.
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(final.id)
    history = [user, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}]  # fmt: skip
    with client.responses.stream(model="m", input=history, tools=RESPONSES_TOOLS, temperature=0,  # type: ignore[arg-type]
                                 max_output_tokens=64, extra_headers={"X-Session-Done": "1"}) as s:  # fmt: skip
        text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        answer = s.get_final_response()
    assert text == ANSWER == answer.output_text
    first, second = by_index(turns, sid, 2)
    check_tool_round(client, turns, first, second, QUESTIONS[1], TOOLS)
    assert second.closed_by == "session_done"


def test_responses_input_items_and_text_logprobs(client: openai.OpenAI, turns: Turns) -> None:
    """`responses.input_items.list` pages the items a stored response was generated from
    (the whole chain's); `include` logprobs gives the answer text's tokens, plain and
    streamed, with the log-probs captured for training."""
    raw = client.responses.with_raw_response.create(
        model="m", input=QUESTIONS[0], tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=64,  # type: ignore[arg-type]
    )  # fmt: skip
    sid, r1 = raw.headers["x-session-id"], raw.parse()
    (call,) = r1.output
    assert call.type == "function_call"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}
    include: Any = ["message.output_text.logprobs"]
    r2 = client.responses.create(model="m", previous_response_id=r1.id, input=[output],  # type: ignore[list-item]
                                 tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=64,  # type: ignore[arg-type]
                                 include=include, top_logprobs=2)  # fmt: skip
    assert r2.output_text == ANSWER
    items = list(client.responses.input_items.list(r2.id, limit=1))  # one per page, newest first
    assert [i.type for i in items] == ["function_call_output", "function_call", "message"]
    fco, fc, question = items
    assert (fco.call_id, fco.output) == (call.call_id, TOOL_RESULT)  # type: ignore[union-attr]
    assert (fc.call_id, fc.name, fc.arguments) == (call.call_id, "get_weather", call.arguments)  # type: ignore[union-attr]
    assert question.role == "user" and question.content[0].text == QUESTIONS[0]  # type: ignore[union-attr]
    first = client.responses.input_items.list(r1.id, order="asc")
    assert [i.id for i in first.data] == [question.id] and first.has_more is False
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.input_items.list(r2.id, limit=101)
    assert bad.value.param == "limit"
    unauthorized = httpx.get(f"{client.base_url}responses/{r2.id}/input_items", timeout=30)
    assert unauthorized.status_code == 401
    # The answer's log-probs: its text's tokens, each with two alternatives, and the
    # values the captured turn holds for the same tokens.
    lps = r2.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert lps and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert b"".join(bytes(lp.bytes) for lp in lps).decode().strip() == ANSWER
    with client.responses.stream(model="m", input=[{"role": "user", "content": QUESTIONS[0]}, call, output],  # type: ignore[list-item]
                                 tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=64,  # type: ignore[arg-type]
                                 include=include, top_logprobs=2,
                                 extra_headers={"X-Session-Done": "1"}) as s:  # fmt: skip
        streamed = [lp for e in s if e.type == "response.output_text.delta" for lp in e.logprobs]
        final = s.get_final_response()
    assert final.output_text == ANSWER
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in lps]
    assert final.output[0].content[0].logprobs == lps  # type: ignore[union-attr]
    second = by_index(turns, sid, 2)[1]
    assert [lp.logprob for lp in lps] == second.response_logprobs[: len(lps)]


# -- the anthropic client ----------------------------------------------------------------------------


def test_anthropic_messages_tool_use_round_trip(
    stack: dict[str, str], client: openai.OpenAI, turns: Turns
) -> None:
    sid = session()
    with anthropic.Anthropic(base_url=stack["url"], api_key=KEY, max_retries=0, timeout=60,
                             default_headers={"X-Session-Id": sid}) as ac:  # fmt: skip
        user = {"role": "user", "content": QUESTIONS[0]}
        first = ac.messages.create(model="m", max_tokens=64, messages=[user],  # type: ignore[list-item]
                                   tools=ANTHROPIC_TOOLS)  # type: ignore[arg-type]
        assert first.stop_reason == "tool_use" and first.id.startswith("msg_")
        (use,) = first.content
        assert use.type == "tool_use" and use.name == "get_weather" and use.input == CALL_ARGS
        result = {"type": "tool_result", "tool_use_id": use.id, "content": TOOL_RESULT}
        follow = [user, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [result]}]  # fmt: skip
        with ac.messages.stream(model="m", max_tokens=64, messages=follow,  # type: ignore[arg-type]
                                tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
                                extra_headers={"X-Session-Done": "1"}) as s:  # fmt: skip
            text = "".join(s.text_stream)
            final = s.get_final_message()
    assert text == ANSWER and final.stop_reason == "end_turn"
    assert final.usage.output_tokens > 0 and final.usage.input_tokens > 0
    a, b = by_index(turns, sid, 2)
    check_tool_round(client, turns, a, b, QUESTIONS[0], TOOLS)
    assert a.completion_id == first.id and b.completion_id == final.id


def test_anthropic_count_tokens_is_the_captured_prompt_length(
    stack: dict[str, str], client: openai.OpenAI, turns: Turns
) -> None:
    sid = session()
    user = {"role": "user", "content": QUESTIONS[1]}
    with anthropic.Anthropic(base_url=stack["url"], api_key=KEY, max_retries=0, timeout=60) as ac:
        counted = ac.messages.count_tokens(model="m", messages=[user], system="be brief",  # type: ignore[list-item]
                                           tools=ANTHROPIC_TOOLS)  # type: ignore[arg-type]
        sent = ac.messages.create(model="m", max_tokens=64, messages=[user], system="be brief",  # type: ignore[list-item]
                                  tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
                                  extra_headers={"X-Session-Id": sid, "X-Session-Done": "1"})  # fmt: skip
        bare = ac.messages.count_tokens(model="m", messages=[user])  # type: ignore[list-item]
        with pytest.raises(anthropic.BadRequestError, match="text only"):
            image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
            ac.messages.count_tokens(model="m", messages=[{"role": "user", "content": [image]}])  # type: ignore[list-item]
    (turn,) = turns.wait(lambda ts: len(ts) == 1, sessions=[sid])
    assert counted.input_tokens == len(turn.prompt_ids) == sent.usage.input_tokens
    system = {"role": "system", "content": "be brief"}
    assert counted.input_tokens == len(chat_prompt_ids(client, turns, [system, user], TOOLS))
    assert 0 < bare.input_tokens < counted.input_tokens
    url = stack["url"] + "/v1/messages/count_tokens"
    r = httpx.post(url, json={"model": "m", "messages": [user]}, headers={"x-api-key": "wrong"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_anthropic_auth_and_errors(stack: dict[str, str]) -> None:
    url = stack["url"] + "/v1/messages"
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    ok = httpx.post(url, json=body, headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}, timeout=30)
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    for headers, status, kind in [
        ({}, 401, "authentication_error"), ({"x-api-key": "wrong"}, 401, "authentication_error"),
    ]:  # fmt: skip
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == status and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == kind
    with anthropic.Anthropic(base_url=stack["url"], api_key=KEY, max_retries=0, timeout=30) as ac:
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
        with pytest.raises(anthropic.BadRequestError, match="text only") as bad:
            ac.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [image]}])  # type: ignore[list-item]
        assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        search = {"type": "web_search_20250305", "name": "web_search"}
        with pytest.raises(anthropic.BadRequestError, match="forces the server tool 'web_search'"):
            ac.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               tools=[search], tool_choice={"type": "tool", "name": "web_search"})  # type: ignore[list-item]
        # Offered, not forced: left out of the prompt, and said so.
        offered = ac.messages.with_raw_response.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
            tools=[search, *ANTHROPIC_TOOLS], extra_headers={"X-Turn-Type": "side"})  # type: ignore[list-item]
        assert offered.headers["x-nextstate-dropped-tools"] == "web_search_20250305"
        assert offered.parse().type == "message"
    wrong = httpx.get(url, headers={"x-api-key": KEY}, timeout=30)
    assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"


def test_responses_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="forces the built-in tool 'web_search'") as bad:
        client.responses.create(model="m", input="hi", tools=[{"type": "web_search"}],  # type: ignore[list-item]
                                tool_choice={"type": "web_search"})  # type: ignore[arg-type]
    assert bad.value.param == "tool_choice"
    offered = client.responses.with_raw_response.create(
        model="m", input="hi", tools=[{"type": "web_search"}, *RESPONSES_TOOLS],  # type: ignore[list-item]
        extra_headers={"X-Turn-Type": "side"})  # fmt: skip
    assert offered.headers["x-nextstate-dropped-tools"] == "web_search"
    assert offered.parse().status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="m", input="hi", previous_response_id="resp_nope")
    assert missing.value.param == "previous_response_id"
    assert "store: false" in missing.value.message and "whole conversation" in missing.value.message
    with pytest.raises(openai.BadRequestError, match="No tool output found"):
        client.responses.create(model="m", input=[
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}])  # fmt: skip


def test_side_turns_are_served_not_captured(stack: dict[str, str], client: openai.OpenAI,
                                            turns: Turns) -> None:  # fmt: skip
    sid = session()
    side = {"X-Session-Id": sid, "X-Turn-Type": "side", "X-Session-Done": "1"}
    assert client.responses.create(model="m", input="hi", max_output_tokens=4, extra_headers=side).id
    with anthropic.Anthropic(base_url=stack["url"], api_key=KEY, max_retries=0, timeout=30) as ac:
        assert ac.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                  extra_headers=side).id  # fmt: skip
    # A main turn that ends the session is emitted before its response returns; the side
    # ones (which would have been too, as main turns) are not there.
    client.responses.create(model="m", input="hi", max_output_tokens=4,
                            extra_headers={**side, "X-Turn-Type": "main"})  # fmt: skip
    (only,) = turns.wait(lambda ts: len(ts) >= 1, sessions=[sid])
    assert only.turn_type == "main" and len(turns.of(sid)) == 1


# -- langchain-openai ---------------------------------------------------------------------------------


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_langchain_bind_tools(
    stack: dict[str, str], client: openai.OpenAI, turns: Turns, responses_api: bool
) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    sid = session()
    llm = ChatOpenAI(model="m", base_url=stack["url"] + "/v1", api_key=KEY, temperature=0,  # type: ignore[arg-type]
                     max_tokens=64, max_retries=0, timeout=60, use_responses_api=responses_api,
                     default_headers={"X-Session-Id": sid})  # fmt: skip
    bound = llm.bind_tools(TOOLS)
    history: list[Any] = [HumanMessage(QUESTIONS[1])]
    ai = bound.invoke(history)
    (call,) = ai.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather" and call["args"] == CALL_ARGS
    history += [ai, ToolMessage(TOOL_RESULT, tool_call_id=call["id"])]
    answer = bound.invoke(history)
    assert answer.text == ANSWER
    # The answer's turn waits for what comes next; the call's turn is closed by the result.
    (first,) = turns.wait(lambda ts: len(ts) == 1, sessions=[sid])
    assert first.next_state == [tool_message(call["id"])]
    user = {"role": "user", "content": QUESTIONS[1]}
    assert first.prompt_ids == chat_prompt_ids(client, turns, [user], TOOLS)


def test_a_prompt_over_the_context_is_an_overflow_every_agent_recognises(stack: dict[str, str],
                                                                         client: openai.OpenAI) -> None:  # fmt: skip
    """The tool model's window is 2048 tokens (its config's max_position_embeddings): the
    collector knows it from the engine and refuses before calling it, on every API, in
    each one's words; streamed requests too (before any event). A max_tokens past the
    window is cut to the room left (NEXTSTATE_COLLECTOR__MAX_TOKENS_OVER_CONTEXT=clamp)."""
    models = client.models.list().data
    assert models[0].model_extra == {"max_model_len": 2048, "context_length": 2048}
    card = httpx.get(stack["url"] + "/v1/models", headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
                     timeout=30).json()  # fmt: skip
    assert card["data"][0]["type"] == "model" and card["data"][0]["max_input_tokens"] == 2047
    long = "weather " * 3000
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as chat:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": long}], stream=stream)
        assert chat.value.code == "context_length_exceeded" and chat.value.param == "messages"
        assert chat.value.body["message"].startswith(  # type: ignore[index]
            "This model's maximum context length is 2048 tokens. However, your messages resulted in ")
        with pytest.raises(openai.BadRequestError) as resp:
            client.responses.create(model="m", input=long, stream=stream)
        assert resp.value.code == "context_length_exceeded" and resp.value.param == "input"
        with anthropic.Anthropic(base_url=stack["url"], api_key=KEY, max_retries=0, timeout=60) as ac:
            with pytest.raises(anthropic.BadRequestError, match=r"prompt is too long: \d+ tokens > 2047 maximum") as msg:
                if stream:
                    with ac.messages.stream(model="m", max_tokens=8, messages=[{"role": "user", "content": long}]) as s:
                        s.get_final_message()
                else:
                    ac.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": long}])
            assert msg.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
            # Claude Code asks for 32000 tokens whatever the model: served, not refused.
            fits = ac.messages.create(model="m", max_tokens=32000, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                      extra_headers={"X-Turn-Type": "side"})  # type: ignore[list-item]
            assert fits.type == "message"
