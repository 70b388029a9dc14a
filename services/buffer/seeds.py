"""Conversation records in the seeds' JSONL format, turned into `Turn`s for the judge.

A record (one JSON object per line in a file; `POST /receive` takes one or a list):

    {"session_id": "abc", "turns": [
        {"type": "main", "prompt": "...", "response": "...", "next_state": "...", "trainable": true},
        {"type": "side", "prompt": "...", "response": "..."}]}

Each trainable main turn becomes a `Turn` (`source="import"`, `closed_by="import"`):

- messages: the prompt as the one user message; response: the assistant message;
- prompt ids: the policy's chat template rendering of those messages with the
  generation prompt, tokenized (`ChatTemplate.encode`), exactly what the collector
  would have sent the engine;
- response ids: `tokenizer(response)` plus the end-of-turn token the template closes
  an assistant message with; `response_logprobs=None` (the trainer then uses its own
  log-probs as the behaviour policy, and the buffer's staleness rule does not apply);
- next state: the `next_state` text as one user message, or None when absent/empty
  (the judge then has nothing to judge and the at-least-one rule may keep it);
- the turn id is a hash of the record's content and position, so importing the same
  record twice yields the same ids and the bus deduplicates the second copy.

Side turns and turns with `trainable: false` are not published (they are counted).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from shared.errors import MalformedMessage, SettingsError
from shared.schemas import Turn


class SeedTurn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["main", "side"] = "main"
    prompt: str
    response: str
    next_state: str | None = None
    trainable: bool = True


class SeedRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    session_id: str = Field(min_length=1, max_length=256)
    turns: list[SeedTurn] = Field(min_length=1)


_RECORDS: TypeAdapter[list[SeedRecord]] = TypeAdapter(list[SeedRecord])


def parse_records(body: Any) -> list[SeedRecord]:
    """One record or a list of them; `MalformedMessage` names every problem and its record."""
    items = body if isinstance(body, list) else [body]
    if not items:
        raise MalformedMessage("no records: send one record object or a non-empty list")
    try:
        return _RECORDS.validate_python(items)
    except ValidationError as exc:
        raise MalformedMessage(_problems(exc, isinstance(body, list))) from None


def _problems(exc: ValidationError, is_list: bool) -> str:
    """`record 2: turns.1.prompt: Field required; ...`."""
    parts = []
    for err in exc.errors():
        loc = list(err.get("loc", ()))
        where = "record"
        if loc and isinstance(loc[0], int):
            index = loc.pop(0)
            where = f"record {index}" if is_list else "record"
        path = ".".join(str(p) for p in loc)
        parts.append(f"{where}: {path + ': ' if path else ''}{err.get('msg', 'invalid')}")
    return "; ".join(parts)


@dataclass
class ImportCounts:
    published: int = 0
    side: int = 0
    untrainable: int = 0


def turn_id(session_id: str, index: int, turn: SeedTurn) -> str:
    raw = json.dumps([session_id, index, turn.prompt, turn.response, turn.next_state])
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


class TurnBuilder:
    """Tokenizes seeds records with the policy's chat template (a `shared.chat.ChatTemplate`)."""

    def __init__(self, template: Any) -> None:
        self.template = template
        self.end_of_turn = end_of_turn_id(template)

    def turns(self, records: list[SeedRecord], policy_version: int) -> tuple[list[Turn], ImportCounts]:
        counts = ImportCounts()
        out: list[Turn] = []
        for rec in records:
            for i, t in enumerate(rec.turns):
                if t.type == "side":
                    counts.side += 1
                    continue
                if not t.trainable:
                    counts.untrainable += 1
                    continue
                out.append(self.turn(rec.session_id, i, t, policy_version))
        counts.published = len(out)
        return out, counts

    def turn(self, session_id: str, index: int, t: SeedTurn, policy_version: int) -> Turn:
        messages = [{"role": "user", "content": t.prompt}]
        prompt_ids = self.template.encode(messages)
        response_ids = [*self.template.tokenizer(t.response, add_special_tokens=False)["input_ids"],
                        self.end_of_turn]
        return Turn(
            id=turn_id(session_id, index, t),
            session_id=session_id,
            turn_index=index,
            messages=messages,
            response={"role": "assistant", "content": t.response},
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_logprobs=None,
            weight_version=str(policy_version),
            policy_version=policy_version,
            finish_reason="stop",
            next_state=[{"role": "user", "content": t.next_state}] if t.next_state else None,
            closed_by="import",
            source="import",
        )


def end_of_turn_id(template: Any) -> int:
    """The token the chat template ends an assistant message with.

    The first of the template's stop tokens (EOS first, then known end-of-turn tokens)
    whose text appears in the template itself: e.g. `<|im_end|>` for ChatML even when a
    base tokenizer's EOS is `<|endoftext|>`, `<|eot_id|>` for Llama 3.
    """
    tok = template.tokenizer
    source = str(getattr(tok, "chat_template", "") or "")
    ids: tuple[int, ...] = template.stop_token_ids
    for tid in ids:
        text = tok.convert_ids_to_tokens(tid)
        if isinstance(text, str) and text in source:
            return tid
    if ids:
        return ids[0]
    raise SettingsError("the tokenizer has no EOS or end-of-turn token to end a response with")
