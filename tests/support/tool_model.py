"""A tiny model that really calls a tool: the test Llama overfit on a few Hermes tool calls.

A random model never emits a well-formed tool call, so the collector's tool path would
only ever be tested with text. This builder takes the tiny model of tiny_model.py and
trains it for a few seconds of CPU on chat-rendered examples (rendered by
`shared.chat.ChatTemplate`, exactly as the collector renders requests):

- a user asking about the weather, with the `get_weather` tool offered, is answered with
  `<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>`;
- once the tool result is in the conversation, the answer is `It is sunny in Paris.`

Served with greedy decoding (temperature 0), the model reproduces both for the
prompts in `QUESTIONS`; `build_tool_model` checks that before returning.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.tiny_model import build_tiny_model

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
# The same tool as the OpenAI Agents SDK offers it (a FunctionTool, strict_json_schema=False):
# its Responses tool carries `strict`, which the chat template then renders too.
STRICT_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {**TOOLS[0]["function"], "strict": False}}
]
CALL_ARGS = {"city": "Paris"}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_RESULT = '{"weather": "sunny", "degrees": 21}'
ANSWER = "It is sunny in Paris."
QUESTIONS = ["What is the weather in Paris?", "weather in paris please"]


def call_message(call_id: str = "call_0") -> dict[str, Any]:
    """The assistant message the model's tool call becomes (as an agent sends it back)."""
    fn = {"name": "get_weather", "arguments": json.dumps(CALL_ARGS)}
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": fn}]}  # fmt: skip


def conversations() -> list[tuple[list[dict[str, Any]], str]]:
    """(messages, the assistant text the model must produce next)."""
    out = []
    for q in QUESTIONS:
        user = {"role": "user", "content": q}
        out.append(([user], CALL_TEXT))
        tool = {"role": "tool", "tool_call_id": "call_0", "content": TOOL_RESULT}
        out.append(([user, call_message(), tool], ANSWER))
    return out


def build_tool_model(
    path: str | Path, steps: int = 300, seed: int = 0, special_markers: Sequence[str] = (),
    tool_sets: Sequence[list[dict[str, Any]]] = (TOOLS,),
) -> Path:
    """Write the trained model to `path` (an HF folder) and return it (~5 s of one core).
    `special_markers`: see `tiny_model.build_tokenizer` (e.g. the tool-call markers).
    `tool_sets`: the `tools` the examples are rendered with (each set, every example)."""
    import torch
    from transformers import AutoModelForCausalLM

    from shared.chat import ChatTemplate

    path = Path(path)
    build_tiny_model(path, seed=seed, special_markers=special_markers)
    tpl = ChatTemplate.from_pretrained(path)
    eos = tpl.tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows: list[tuple[list[int], int]] = []  # (prompt + target ids, prompt length)
    for tools in tool_sets:
        for messages, target in conversations():
            prompt = tpl.encode(messages, tools)
            rows.append((prompt + tpl.encode_text(target) + [eos], len(prompt)))
    width = max(len(r) for r, _ in rows)
    pad = tpl.tokenizer.pad_token_id
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, n) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, n : len(row)] = torch.tensor(row[n:])
        mask[i, : len(row)] = 1

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend on a shared machine
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(str(path))
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        for _ in range(steps):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if loss.item() < 0.005:
                break
        model.train(False)
        _check_greedy(model, rows, eos)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(str(path))
    return path


def _check_greedy(model: Any, rows: list[tuple[list[int], int]], eos: int) -> None:
    import torch

    with torch.no_grad():
        for row, n in rows:
            out = model.generate(
                torch.tensor([row[:n]]), max_new_tokens=len(row) - n + 4, do_sample=False,
                eos_token_id=eos, pad_token_id=eos,
            )  # fmt: skip
            got = out[0, n:].tolist()
            if got != row[n:]:
                raise RuntimeError(f"the tool model did not learn its examples: {got} != {row[n:]}")
