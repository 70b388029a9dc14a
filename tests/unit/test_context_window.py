"""The context window at the edge: where its length comes from, what fits, the overflow
refusal in each API's words, and the engines' own refusals said the same way."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from services.collector.completion import ChatService
from services.collector.context_window import (
    OVERFLOW_CODE,
    context_length,
    engine_refusal,
    fit,
    model_config_length,
    overflow,
)
from services.collector.openai_shapes import ApiError
from services.collector.request import make_call
from services.collector.settings import CollectorConfig
from shared.chat import ChatTemplate
from shared.errors import EngineRejected
from shared.schemas import SamplingParams


def test_the_length_comes_from_the_setting_then_the_engine_then_the_model_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert context_length(4096, {"context_length": 2048}, str(tmp_path)) == 4096
    assert context_length(None, {"context_length": 2048}, str(tmp_path)) == 2048
    assert context_length(None, {"max_model_len": 1024}, str(tmp_path)) == 1024  # vLLM's
    assert context_length(None, {"context_length": None}, str(tmp_path)) == 8192
    assert context_length(None, {}, str(tmp_path / "nope")) is None
    assert context_length(None, {}, "HuggingFaceTB/SmolLM2-135M-Instruct") is None  # a hub id
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 32768}}))
    assert model_config_length(tmp_path) == 32768
    (tmp_path / "config.json").write_text("not json")
    assert model_config_length(tmp_path) is None


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_what_fits(api: str) -> None:
    assert fit(api, 100, None, 5000, "refuse") == 5000  # unknown window: nothing checked here  # type: ignore[arg-type]
    assert fit(api, 8191, 8192, None, "clamp") is None  # one token of room is enough  # type: ignore[arg-type]
    assert fit(api, 100, 8192, 8092, "refuse") == 8092  # type: ignore[arg-type]
    assert fit(api, 100, 8192, 32000, "clamp") == 8092  # cut to the room left  # type: ignore[arg-type]
    with pytest.raises(ApiError) as full:
        fit(api, 8192, 8192, None, "clamp")  # type: ignore[arg-type]
    assert full.value.status == 400 and full.value.code == OVERFLOW_CODE
    with pytest.raises(ApiError) as asked:
        fit(api, 100, 8192, 32000, "refuse")  # type: ignore[arg-type]
    assert asked.value.code == OVERFLOW_CODE and "32000" in asked.value.message


def test_the_overflow_in_each_apis_words() -> None:
    chat = overflow("chat", 10116, 8192)
    assert chat.message == ("This model's maximum context length is 8192 tokens. However, your messages "
                            "resulted in 10116 tokens. Please reduce the length of the messages.")  # fmt: skip
    assert (chat.param, chat.code, chat.kind) == ("messages", "context_length_exceeded", "invalid_request_error")
    asked = overflow("chat", 4012, 4097, 256)
    assert "you requested 4268 tokens (4012 in the messages, 256 in the completion)" in asked.message
    responses = overflow("responses", 10116, 8192)
    assert responses.message.startswith("Your input exceeds the context window of this model")
    assert "resulted in 10116 tokens" in responses.message and responses.param == "input"
    assert overflow("messages", 10116, 8192).message == "prompt is too long: 10116 tokens > 8191 maximum"
    assert overflow("messages", 188240, 200000, 20000).message.startswith(
        "input length and `max_tokens` exceed context limit: 188240 + 20000 > 200000")


# OpenClaw 2026.9.6's overflow classifier, as its npm package ships it (@openclaw/ai
# dist/internal/runtime.mjs, CONTEXT_OVERFLOW_PATTERN_SCOPES "failover-explicit", and the
# token counts it reads back, openclaw dist/embedded-agent-helpers-*.mjs,
# OBSERVED_OVERFLOW_TOKEN_PATTERNS): a message matching one of the first is an overflow,
# answered by compacting. tests/integration/test_overflow_classifiers.py runs the real one.
OPENCLAW_EXPLICIT = [re.compile(p, re.IGNORECASE) for p in (
    r"request_too_large", r"context_overflow", r"context length exceeded", r"maximum context length",
    r"prompt is too long", r"prompt too long", r"exceeds model context window", r"model token limit",
    r"exceed context limit", r"exceeds the model'?s maximum context", r"max_tokens[\s\S]*exceed[\s\S]*context",
    r"context_window_exceeded",
)]  # fmt: skip
OPENCLAW_TOKENS = [re.compile(p, re.IGNORECASE) for p in (
    r"prompt is too long:\s*([\d,]+)\s+tokens\s*>\s*[\d,]+\s+maximum", r"requested\s+([\d,]+)\s+tokens",
    r"resulted in\s+([\d,]+)\s+tokens",
)]  # fmt: skip
OPENCLAW_SUMS = re.compile(r"input length\s+and\s+`max_tokens`\s+exceed\s+context\s+limit:\s*([\d,]+)\s*\+\s*([\d,]+)",
                           re.IGNORECASE)  # fmt: skip


def openclaw_reads(message: str) -> int | None:
    """The prompt size OpenClaw's classifier reads from an overflow message (None: not one)."""
    if not any(p.search(message) for p in OPENCLAW_EXPLICIT):
        return None
    if m := OPENCLAW_SUMS.search(message):
        return int(m.group(1)) + int(m.group(2))
    for p in OPENCLAW_TOKENS:
        if m := p.search(message):
            return int(m.group(1))
    return 0


@pytest.mark.parametrize(("api", "asked", "reads"), [
    ("chat", None, 10116), ("chat", 500, 10616), ("responses", None, 10116), ("responses", 500, 10616),
    ("messages", None, 10116), ("messages", 500, 10616),
])  # fmt: skip
def test_openclaw_classifies_each_overflow_and_reads_its_size(api: str, asked: int | None, reads: int) -> None:
    err = overflow(api, 10116, 8192 if asked is None else 10200, asked)  # type: ignore[arg-type]
    assert openclaw_reads(err.message) == reads
    # What the SDKs make of it: OpenAI's "Error code: 400 - {...}", Anthropic's the same.
    assert openclaw_reads(f"Error code: 400 - {err.body()}") == reads


def test_the_old_refusal_was_no_overflow_to_openclaw() -> None:
    old = ("the model server refused the request: /generate: engine answered 400: the prompt has 10116 "
           "tokens; the context length is 8192")  # fmt: skip
    assert openclaw_reads(old) is None


@pytest.mark.parametrize(("engine", "prompt", "window", "asked"), [
    ("/generate: engine answered 400: the prompt has 10116 tokens; the context length is 8192", 10116, 8192, None),
    ("/generate: engine answered 400: The input (9000 tokens) is longer than the model's context length "
     "(8192 tokens).", 9000, 8192, None),  # SGLang
    ("/generate: engine answered 400: Requested token count exceeds the model's maximum context length of "
     "8192 tokens. You requested a total of 9000 tokens: 5000 tokens from the input messages and 4000 "
     "tokens for the completion. Please reduce the number of tokens in the input messages or the completion "
     "to fit within the limit.", 5000, 8192, 4000),  # SGLang, max_new_tokens
    ("/inference/v1/generate: engine answered 400: This model's maximum context length is 8192 tokens. "
     "However, your prompt contains 9001 input tokens, which exceeds this limit even without any output "
     "tokens. Please reduce the length of the input prompt.", 9001, 8192, None),  # vLLM 0.32
    ("/v1/completions: engine answered 400: This model's maximum context length is 4096 tokens. However, "
     "your request has 5000 input tokens. Please reduce the length of the input messages.", 5000, 4096, None),
    ("engine answered 400: 'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum "
     "context length is 4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778).", 2778, 4096, 8000),
])  # fmt: skip
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_engine_overflows_become_the_apis_overflow(api: str, engine: str, prompt: int, window: int,
                                                    asked: int | None) -> None:  # fmt: skip
    err = engine_refusal(api, EngineRejected(engine, 400))  # type: ignore[arg-type]
    expected = overflow(api, prompt, window, asked)  # type: ignore[arg-type]
    assert (err.status, err.message, err.code, err.param) == (400, expected.message, OVERFLOW_CODE, expected.param)


def test_other_engine_refusals_say_what_happened_and_what_to_do() -> None:
    err = engine_refusal("chat", EngineRejected("/generate: engine answered 400: top_k must be at least 1", 400))
    assert err.status == 400 and err.code == "engine_rejected"
    assert err.message.startswith("the model server refused the request: top_k must be at least 1.")
    assert "/generate" not in err.message and "sent again unchanged it fails again" in err.message
    # The engine refusing the collector's own token is the operator's problem, never the client's 401.
    auth = engine_refusal("messages", EngineRejected("/generate: engine answered 401: bad token", 401))
    assert auth.status == 502 and auth.kind == "server_error" and "NEXTSTATE_INTERNAL__TOKEN" in auth.message
    assert engine_refusal("chat", EngineRejected("x: engine answered 404: Not Found", 404)).status == 502
    busy = engine_refusal("chat", EngineRejected("x: engine answered 429: queue full", 429))
    assert busy.status == 429 and "retry" in busy.message


async def test_prepare_fits_max_tokens_and_refuses_what_does_not_fit(tiny_tokenizer: Path) -> None:
    """The collector's own step: the engine is asked for the room left, the turn records it;
    a prompt over the window never reaches the engine (there is none here)."""
    cfg = CollectorConfig()
    template = ChatTemplate.from_pretrained(tiny_tokenizer)
    messages = [{"role": "user", "content": "the weather in paris"}]
    prompt = len(template.encode(messages))
    service = ChatService(cfg, None, template, None, "m", context_length=prompt + 10)  # type: ignore[arg-type]
    side = {"x-turn-type": "side"}
    call = make_call(messages, None, tools_enabled=False, headers=side, cfg=cfg, max_tokens=32000)
    prep = await service.prepare(call)
    assert isinstance(prep.sampling, SamplingParams) and prep.sampling.max_tokens == 10
    assert prep.sampling_params.max_tokens == 10 and call.sampling.max_tokens == 32000
    asked = make_call(messages, None, tools_enabled=False, headers=side, cfg=cfg, max_tokens=5)
    assert (await service.prepare(asked)).params is None  # it fits: sent as asked
    refuse = ChatService(CollectorConfig(max_tokens_over_context="refuse"), None, template, None, "m",  # type: ignore[arg-type]
                         context_length=prompt + 10)  # fmt: skip
    with pytest.raises(ApiError, match="you requested"):
        await refuse.prepare(call)
    small = ChatService(cfg, None, template, None, "m", context_length=prompt)  # type: ignore[arg-type]
    with pytest.raises(ApiError) as over:
        await small.prepare(make_call(messages, None, tools_enabled=False, headers=side, cfg=cfg, api="messages"))
    assert over.value.message == f"prompt is too long: {prompt} tokens > {prompt - 1} maximum"
