"""Seeds-format records → Turns (validation, tokenization, ids) and the --mock generator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.buffer.seeds import TurnBuilder, end_of_turn_id, parse_records, turn_id
from services.ctl.importer import chunks, mock_records, read_jsonl
from shared.chat import ChatTemplate
from shared.errors import MalformedMessage, NextstateError
from tests.support.tiny_model import build_tokenizer

SEEDS = Path(__file__).resolve().parents[1] / "data" / "seeds.jsonl"


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    path = tmp_path_factory.mktemp("tiny-tok")
    build_tokenizer(path)
    return ChatTemplate.from_pretrained(path)


def seed_records() -> list[Any]:
    return [obj for _, obj in read_jsonl(SEEDS.read_text().splitlines())]


def test_seed_file_parses() -> None:
    records = parse_records(seed_records())
    assert [r.session_id for r in records] == ["seed-refactor", "seed-weather", "seed-untrainable", "seed-single"]
    assert records[3].turns[0].type == "main" and records[3].turns[0].trainable


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ({"turns": [{"prompt": "p", "response": "r"}]}, "record: session_id: Field required"),
        ([{"session_id": "a", "turns": [{"prompt": "p", "response": "r"}]},
          {"session_id": "b", "turns": [{"prompt": "p"}]}], "record 1: turns.0.response: Field required"),
        ({"session_id": "a", "turns": []}, "record: turns: List should have at least 1 item"),
        ({"session_id": "a", "turns": [{"type": "tool", "prompt": "p", "response": "r"}]},
         "record: turns.0.type: Input should be 'main' or 'side'"),
        ([], "no records"),
        ("text", "record: Input should be a valid dictionary"),
    ],
)
def test_bad_records_name_the_problem(body: Any, problem: str) -> None:
    with pytest.raises(MalformedMessage) as info:
        parse_records(body)
    assert problem in str(info.value)


def test_turns_from_seeds(template: ChatTemplate) -> None:
    builder = TurnBuilder(template)
    eot = template.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert builder.end_of_turn == eot == end_of_turn_id(template)
    turns, counts = builder.turns(parse_records(seed_records()), policy_version=5)
    assert (counts.published, counts.side, counts.untrainable) == (6, 1, 1)
    assert [t.session_id for t in turns].count("seed-weather") == 3
    by_index = {(t.session_id, t.turn_index): t for t in turns}
    t = by_index[("seed-untrainable", 1)]
    prompt = "Translate 'hello' to French"
    response = "Bonjour — café au lait, s'il vous plaît."
    assert t.messages == [{"role": "user", "content": prompt}]
    assert t.prompt_ids == template.encode([{"role": "user", "content": prompt}])
    rendered = template.render([{"role": "user", "content": prompt}])
    assert t.prompt_ids == template.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert t.response_ids[-1] == eot
    assert template.decode(t.response_ids) == response
    assert t.response_logprobs is None
    assert t.next_state == [{"role": "user", "content": "merci, c'est parfait"}]
    assert (t.source, t.closed_by, t.policy_version, t.turn_type) == ("import", "import", 5, "main")
    last = by_index[("seed-weather", 2)]
    assert last.next_state is None  # nothing came after: the at-least-one candidate


def test_turn_ids_are_deterministic(template: ChatTemplate) -> None:
    builder = TurnBuilder(template)
    a, _ = builder.turns(parse_records(seed_records()), 0)
    b, _ = builder.turns(parse_records(seed_records()), 3)
    assert [t.id for t in a] == [t.id for t in b]
    assert len({t.id for t in a}) == len(a)
    rec = parse_records({"session_id": "s", "turns": [{"prompt": "p", "response": "r"}]})[0]
    changed = rec.turns[0].model_copy(update={"response": "r2"})
    assert turn_id("s", 0, rec.turns[0]) != turn_id("s", 0, changed)


def test_mock_records_are_valid_and_varied() -> None:
    records = list(mock_records(40, seed=1))
    assert len({r["session_id"] for r in records}) == 40
    parsed = parse_records(records)
    lengths = {sum(t.type == "main" for t in r.turns) for r in parsed}
    assert len(lengths) >= 3
    states = [t.next_state for r in parsed for t in r.turns if t.type == "main"]
    assert None in states
    assert any(s in ("thanks, perfect", "great, that works") for s in states)
    assert any(s in ("that's wrong, try again", "error: file not found") for s in states)
    assert any(t.type == "side" for r in parsed for t in r.turns)
    assert list(mock_records(5, seed=1)) == records[:5]  # reproducible


def test_read_jsonl_names_the_bad_line() -> None:
    lines = [json.dumps({"a": 1}), "", "{not json"]
    with pytest.raises(NextstateError, match="line 3 is not JSON"):
        list(read_jsonl(lines))
    assert [n for n, _ in read_jsonl(lines[:2])] == [1]


def test_chunks() -> None:
    assert [len(c) for c in chunks(enumerate(range(7)), 3)] == [3, 3, 1]
