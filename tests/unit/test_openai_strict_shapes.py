"""OpenAI's log-prob shapes as the collector writes them: token text, exact UTF-8 bytes (also
for tokens that split a character), top alternatives, parsed with the SDK's own types."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionTokenLogprob

from services.collector.openai_shapes import ChunkWriter, TokenPieces, completion, logprob_content
from tests.support.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    path = Path(tmp_path_factory.mktemp("tok"))
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def test_bytes_spell_the_text_even_when_tokens_split_characters(tokenizer: Any) -> None:
    text = "héllo wörld ✓ <tool_call>"
    ids = tokenizer(text)["input_ids"]
    pieces = TokenPieces(tokenizer)
    entries = logprob_content(pieces, ids, [-0.5] * len(ids), [], 0)
    parsed = [ChatCompletionTokenLogprob.model_validate(e) for e in entries]
    assert bytes(b for e in parsed for b in e.bytes or []).decode() == text
    split = [e for e in parsed if e.token.startswith("bytes:")]
    assert split, "the test tokenizer splits é, ö and ✓ into byte tokens"
    for e in split:
        assert e.token == "bytes:" + "".join(f"\\x{b:02x}" for b in e.bytes or [])
    assert any(e.token == "<tool_call>" for e in parsed)  # added tokens keep their text


def test_top_logprobs_are_cut_to_the_asked_number(tokenizer: Any) -> None:
    pieces = TokenPieces(tokenizer)
    top = [[(10, -0.1), (11, -2.0), (12, -3.0)], [(12, -0.2), (10, -1.0), (11, -4.0)]]
    entries = logprob_content(pieces, [10, 12], [-0.1, -0.2], top, 2)
    assert [len(e["top_logprobs"]) for e in entries] == [2, 2]
    assert entries[1]["top_logprobs"][0] == {"token": pieces.piece(12)[0], "logprob": -0.2,
                                             "bytes": pieces.piece(12)[1]}  # fmt: skip
    assert logprob_content(pieces, [10], [-0.1], [], 0)[0]["top_logprobs"] == []


def test_completion_and_chunks_carry_logprobs_the_sdk_parses(tokenizer: Any) -> None:
    lp = {"content": logprob_content(TokenPieces(tokenizer), [10], [-0.3], [[(10, -0.3)]], 1),
          "refusal": None}  # fmt: skip
    body = completion("chatcmpl-1", 1, "m", {"role": "assistant", "content": "x"}, "stop", 3, 1, "fp", lp)
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].logprobs is not None and parsed.choices[0].logprobs.content is not None
    assert parsed.choices[0].logprobs.content[0].logprob == -0.3
    ev = ChunkWriter("chatcmpl-1", 1, "m", "fp").delta({"content": "x"}, None, logprobs=lp)
    chunk = ChatCompletionChunk.model_validate(json.loads(ev[6:]))
    assert chunk.choices[0].logprobs is not None and chunk.choices[0].logprobs.content is not None
