"""`response_format` end to end on the tiny random model: constrained decoding in the CPU
engine (batched and one-by-one decode), through the collector with the official SDK
(plain and streamed), the captured Turn marked as constrained with the *unmasked*
log-probs the trainer recomputes, and the refusals (unsupported type, bad schema).

The grammar forces termination: the schema's language is finite (bounded strings,
booleans, enums; whitespace bounded per gap) and `max_tokens` exceeds its longest
document, so a random model always ends with a complete, valid document.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import xgrammar  # noqa: F401  (the engine extra: constrained decoding fails without it, never skips)

from shared.chat import ChatTemplate
from shared.engine_client import SGLangClient
from shared.errors import EngineRejected
from shared.schemas import SamplingParams
from tests.support.collector_harness import Turns, collector_process, engine_process, wait_ready

pytestmark = pytest.mark.integration

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "sunny": {"type": "boolean"},
        "level": {"enum": ["low", "mid", "high"]},
    },
    "required": ["city", "sunny", "level"],
    "additionalProperties": False,
}
MAX_TOKENS = 400  # above the longest document SCHEMA allows (~320 tokens)
USER = [{"role": "user", "content": "what is the weather in paris? answer in json"}]


def valid(doc: Any) -> bool:
    return (
        isinstance(doc, dict) and set(doc) == {"city", "sunny", "level"}
        and isinstance(doc["city"], str) and len(doc["city"]) <= 12
        and isinstance(doc["sunny"], bool) and doc["level"] in ("low", "mid", "high")
    )  # fmt: skip


@pytest.fixture(scope="module")
def stack(tiny_model: Path, redis_url: str) -> Iterator[dict[str, str]]:
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    env = {"NEXTSTATE_ENV": "test", "NEXTSTATE_REDIS__URL": redis_url,
           "NEXTSTATE_REDIS__PREFIX": prefix}  # fmt: skip
    batched, batched_url = engine_process(tiny_model, NEXTSTATE_ENGINE__MAX_RUNNING="8")
    alone, alone_url = engine_process(tiny_model, NEXTSTATE_ENGINE__BATCH_DECODE="false")
    collector, url = collector_process(env, batched_url)
    try:
        wait_ready((batched, batched_url), (collector, url))
        alone.wait_http(alone_url + "/health", timeout=120)
        yield {"url": url, "batched": batched_url, "alone": alone_url, "prefix": prefix,
               "redis": redis_url}  # fmt: skip
    finally:
        rc = collector.stop()
        batched.stop()
        alone.stop()
    assert rc == 0, collector.logs()


@pytest.fixture(scope="module")
def tpl(tiny_model: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(tiny_model)


@pytest.fixture
def client(stack: dict[str, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack["url"] + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


# -- the engine ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["batched", "alone"])
def test_engine_json_schema_in_both_decode_paths(stack: dict[str, str], tpl: ChatTemplate, mode: str) -> None:
    """Constrained and free requests decoding together: every constrained one is a valid
    document, and its log-probs are the full-vocabulary ones (equal to a teacher-forced score)."""
    prompt = tpl.encode(USER, None)
    constrained = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, json_schema=json.dumps(SCHEMA))

    async def run() -> list[Any]:
        async with SGLangClient(stack[mode]) as eng:
            jobs = []
            for i in range(6):
                sp = constrained.model_copy(update={"seed": i}) if i % 2 == 0 else SamplingParams(
                    temperature=1.0, max_tokens=40, seed=i)  # fmt: skip
                jobs.append(eng.generate(prompt, sp, stop_token_ids=tpl.stop_token_ids))
            results = await asyncio.gather(*jobs)
            scores = [await eng.score(prompt + r.output_ids, len(prompt)) for r in results[::2]]
            return [results, scores]

    results, scores = asyncio.run(run())
    for res, score in zip(results[::2], scores, strict=True):
        assert res.finish_reason == "stop", res
        assert valid(json.loads(res.text)), res.text
        # What the trainer recomputes from the logits (no grammar): log_softmax(logits / T).
        assert res.output_logprobs == pytest.approx(score, abs=1e-4)
    for res in results[1::2]:
        assert res.finish_reason in ("stop", "length")


def test_engine_ebnf_and_refusals(stack: dict[str, str], tpl: ChatTemplate) -> None:
    prompt = tpl.encode(USER, None)

    async def run() -> None:
        async with SGLangClient(stack["batched"]) as eng:
            ebnf = 'root ::= ("yes" | "no") "! " [0-9] [0-9] [0-9]'
            res = await eng.generate(prompt, {"max_tokens": 40, "seed": 1, "ebnf": ebnf},
                                     stop_token_ids=tpl.stop_token_ids)  # fmt: skip
            assert res.finish_reason == "stop" and re.fullmatch(r"(yes|no)! [0-9]{3}", res.text), res
            for sampling, says in (
                ({"json_schema": '{"type": "nonsense"}'}, 'Unsupported type "nonsense"'),
                ({"json_schema": "{oops"}, "json_schema is invalid"),
                ({"ebnf": 'root ::= "a" |'}, "ebnf is invalid"),
                ({"json_schema": "{}", "ebnf": 'root ::= "a"'}, "at most one of"),
                ({"structural_tag": "{}"}, "structural_tag"),
            ):
                with pytest.raises(EngineRejected, match=re.escape(says)) as info:
                    await eng.generate(prompt, {"max_tokens": 4, **sampling})
                assert info.value.status_code == 400

    asyncio.run(run())


# -- through the collector --------------------------------------------------------------------------


def json_schema_format(schema: dict[str, Any] = SCHEMA) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}


def test_json_schema_answer_validates_and_the_turn_says_it_was_constrained(
    client: openai.OpenAI, stack: dict[str, str], tpl: ChatTemplate
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=USER, max_tokens=MAX_TOKENS, seed=3,  # type: ignore[arg-type]
        response_format=json_schema_format(),  # type: ignore[arg-type]
        extra_headers={"X-Session-Done": "1"},
    )
    choice = raw.parse().choices[0]
    assert choice.finish_reason == "stop"
    assert valid(json.loads(choice.message.content or "")), choice.message.content
    turns = Turns(stack["redis"], stack["prefix"])
    try:
        (turn,) = turns.wait(lambda ts: len(ts) == 1, sessions=[raw.headers["x-session-id"]])
    finally:
        turns.close()
    assert turn.sampling.json_schema is not None and json.loads(turn.sampling.json_schema) == SCHEMA
    assert turn.response["content"] == choice.message.content

    async def score() -> list[float]:
        async with SGLangClient(stack["batched"]) as eng:
            return await eng.score(turn.prompt_ids + turn.response_ids, len(turn.prompt_ids),
                                   temperature=turn.sampling.temperature)  # fmt: skip

    assert turn.response_logprobs == pytest.approx(asyncio.run(score()), abs=1e-4)


def test_json_schema_streamed(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="m", messages=USER, max_tokens=MAX_TOKENS, seed=8, stream=True,  # type: ignore[arg-type]
        response_format=json_schema_format(), logprobs=True,  # type: ignore[arg-type]
    ))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert valid(json.loads(text)), text


def test_json_object_gives_parseable_json(client: openai.OpenAI) -> None:
    finished = 0
    for seed in range(8):
        choice = client.chat.completions.create(
            model="m", messages=USER, max_tokens=120, seed=seed, temperature=0.7,  # type: ignore[arg-type]
            response_format={"type": "json_object"},
        ).choices[0]
        assert (choice.message.content or "").lstrip().startswith("{")
        if choice.finish_reason == "stop":  # a random model may still be mid-string at 120 tokens
            assert isinstance(json.loads(choice.message.content or ""), dict), choice.message.content
            finished += 1
    assert finished > 0


def test_response_format_refusals_are_400s(client: openai.OpenAI) -> None:
    for fmt, says in (
        ({"type": "grammar", "grammar": "root ::= 'a'"}, "'grammar' is not supported"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
        (json_schema_format({"type": "nonsense"}), 'Unsupported type "nonsense"'),  # refused by the engine
    ):
        with pytest.raises(openai.BadRequestError, match=re.escape(says)) as info:
            client.chat.completions.create(model="m", messages=USER, max_tokens=8,  # type: ignore[arg-type]
                                           response_format=fmt)  # type: ignore[arg-type]
        body = info.value.body
        assert isinstance(body, dict) and body["param"] == "response_format", body
    text = client.chat.completions.create(model="m", messages=USER, max_tokens=8,  # type: ignore[arg-type]
                                          response_format={"type": "text"})  # fmt: skip
    assert text.choices[0].message.content is not None
