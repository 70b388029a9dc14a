"""The engine's grammar layer (services/engine/grammar.py) on the test tokenizer: masks that
keep a random "model" inside a JSON Schema, regex or EBNF, termination, and clear errors."""

from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar  # noqa: F401  (the engine extra: constrained decoding fails without it, never skips)

from services.engine.grammar import (
    ANY_JSON,
    CompiledGrammar,
    Constraint,
    GrammarError,
    GrammarSpec,
    compile_grammar,
)
from services.engine.sampling import SamplingConfig, new_generator, sample_token
from tests.support.tiny_model import build_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "sunny": {"type": "boolean"},
        "level": {"enum": ["low", "high"]},
    },
    "required": ["city", "sunny", "level"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tok_path: str) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_path)


def eos(tokenizer: object) -> int:
    return int(tokenizer.convert_tokens_to_ids("<|im_end|>"))  # type: ignore[attr-defined]


def run(grammar: CompiledGrammar, tokenizer: object, seed: int, vocab: int, limit: int = 400,
        temperature: float = 1.0) -> tuple[list[int], Constraint]:  # fmt: skip
    """Decode random logits under the grammar until it terminates (or `limit` tokens)."""
    c = Constraint(grammar, frozenset({eos(tokenizer)}))
    gen = new_generator(seed)
    logits_gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while not c.terminated and len(out) < limit:
        logits = torch.randn(vocab, generator=logits_gen) * 3
        token, _ = sample_token(logits, SamplingConfig(temperature), gen, c.allowed(vocab))
        c.accept(token)
        out.append(token)
    return out, c


def text_of(tokenizer: object, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=True))  # type: ignore[attr-defined]


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_output_parses_validates_and_terminates(tok_path: str, tokenizer: object, seed: int) -> None:
    vocab = len(tokenizer)  # type: ignore[arg-type]
    grammar = compile_grammar(GrammarSpec("json_schema", json.dumps(SCHEMA)), tok_path, vocab)
    ids, c = run(grammar, tokenizer, seed, vocab)
    assert c.terminated and ids[-1] == eos(tokenizer)  # the grammar forced the end
    doc = json.loads(text_of(tokenizer, ids))
    assert set(doc) == {"city", "sunny", "level"}
    assert isinstance(doc["city"], str) and len(doc["city"]) <= 10
    assert isinstance(doc["sunny"], bool) and doc["level"] in ("low", "high")


def test_any_json_and_object(tok_path: str, tokenizer: object) -> None:
    vocab = len(tokenizer)  # type: ignore[arg-type]
    for source in (ANY_JSON, '{"type":"object"}'):
        grammar = compile_grammar(GrammarSpec("json_schema", source), tok_path, vocab)
        done = 0
        for seed in range(8):
            ids, c = run(grammar, tokenizer, seed, vocab, limit=120, temperature=0.7)
            if c.terminated:
                doc = json.loads(text_of(tokenizer, ids))
                assert source == ANY_JSON or isinstance(doc, dict)
                done += 1
        assert done > 0


def test_regex_and_ebnf(tok_path: str, tokenizer: object) -> None:
    vocab = len(tokenizer)  # type: ignore[arg-type]
    grammar = compile_grammar(GrammarSpec("regex", r"(yes|no), [0-9]{2}"), tok_path, vocab)
    ids, c = run(grammar, tokenizer, 1, vocab)
    assert c.terminated and re.fullmatch(r"(yes|no), [0-9]{2}", text_of(tokenizer, ids))
    grammar = compile_grammar(GrammarSpec("ebnf", 'root ::= "a" ("b" | "c")*  "."'), tok_path, vocab)
    ids, c = run(grammar, tokenizer, 2, vocab)
    assert c.terminated and re.fullmatch(r"a[bc]*\.", text_of(tokenizer, ids))


def test_padded_vocabulary_rows_are_never_allowed(tok_path: str, tokenizer: object) -> None:
    vocab = len(tokenizer)  # type: ignore[arg-type]
    grammar = compile_grammar(GrammarSpec("json_schema", ANY_JSON), tok_path, vocab + 30)
    mask = Constraint(grammar, frozenset({eos(tokenizer)})).allowed(vocab + 30)
    assert mask.shape == (vocab + 30,) and mask.dtype == torch.bool
    assert mask.any() and not mask[vocab:].any()


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (GrammarSpec("json_schema", "{not json"), "json_schema is invalid"),
        (GrammarSpec("json_schema", "[1, 2]"), "must be a JSON object"),
        (GrammarSpec("json_schema", '{"type": "nonsense"}'), 'Unsupported type "nonsense"'),
        (GrammarSpec("regex", "[a-z"), "regex is invalid"),
        (GrammarSpec("ebnf", 'root ::= "a" |'), "ebnf is invalid"),
    ],
)
def test_bad_grammars_say_what_is_wrong(tok_path: str, tokenizer: object, spec: GrammarSpec, says: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(says)) as info:
        compile_grammar(spec, tok_path, len(tokenizer))  # type: ignore[arg-type]
    assert "/project/" not in str(info.value)  # no C++ source locations
