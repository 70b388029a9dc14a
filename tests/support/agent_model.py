"""A tiny model for the real agents: their ~12k-token default prompts fit, and it calls
Codex's and Claude Code's own shell tools.

The real agents' prompts are big (OpenClaw's system prompt and tools are ~51k characters,
Codex's and Claude Code's ~40k), so the test model of tiny_model.py is built with

- a 32,768-token context (`max_position_embeddings`) and an 8,192-token BPE trained on
  the recorded requests' own text (tests/data/agents) as well, so their prompts take about
  what a real model's tokenizer makes of them (~12k tokens; SmolLM2's: ~10k);
- a few seconds of training (as tool_model.py does) on the recorded requests, rendered by
  the collector's own request builders and `shared.chat.ChatTemplate`, to answer:
  * Codex's task (`CODEX_TASK`): a call of its `exec_command` tool, `{"cmd": "ls"}`;
  * Claude Code's task (`CLAUDE_TASK`): a call of its `Bash` tool, `{"command": "ls", …}`;
  * a tool result: `ANSWER`;
  * anything OpenClaw sends (its turns end on its internal-context message): `REPLY`.

Training on a full 12k-token prompt costs seconds a step on these cores, so each example is
shown as a *view*: the prompt's first few tokens and a random-length tail, with the
position ids they have in the full prompt, so the model learns to answer from the tail
whatever precedes it. `build_agent_model` then checks that greedy decoding of every full
prompt gives its answer (the collector serves it with `default_temperature` 0: the agents
send no temperature).

Requests that today's collector refuses (Codex's `namespace` tool and built-in
`web_search`, Claude Code's `system` entries inside `messages`) are rendered as the
collector is to take them (issue 22): the namespace's functions flattened, built-in
tools left out, a `system` entry as a user message, in the system prompt, or left out
(all three are trained, so the model does not depend on which).
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support.agents import recording
from tests.support.tiny_model import build_tiny_model

CONTEXT = 32768
VOCAB = 8192
RECORDINGS = ("openclaw-openai-completions", "openclaw-openai-responses",
              "openclaw-anthropic-messages", "codex", "claude")  # fmt: skip
RECORDED_TASK = "List the files in this directory with ls, then tell me what you found."
CODEX_TASK = "Run ls here with exec_command and tell me what you found."
CLAUDE_TASK = "Run ls here with Bash and tell me what you found."
CALLS: dict[str, tuple[str, dict[str, Any]]] = {
    "codex": ("exec_command", {"cmd": "ls"}),
    "claude": ("Bash", {"command": "ls", "description": "List files in current directory"}),
}
ANSWER = "The directory holds hello.py and notes.txt."
REPLY = "Hello! How can I help?"


def call_text(agent: str) -> str:
    name, args = CALLS[agent]
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def _strings(x: Any) -> Iterator[str]:
    if isinstance(x, str):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _strings(v)
    elif isinstance(x, list):
        for v in x:
            yield from _strings(v)


def corpus() -> list[str]:
    """Every string of the recorded requests, and their tools as JSON."""
    out: list[str] = []
    for name in RECORDINGS:
        for e in recording(name):
            out += _strings(e["body"])
            out += [json.dumps(t) for t in e["body"].get("tools") or []]
    return out


def _flatten_tools(body: dict[str, Any]) -> None:
    tools = []
    for t in body.get("tools") or []:
        if t.get("type") == "namespace":
            tools += [i for i in t.get("tools") or [] if i.get("type") == "function"]
        elif t.get("type") == "function":
            tools.append(t)
    body["tools"] = tools


def _system_entries(body: dict[str, Any], how: str) -> None:
    """Claude Code's `system` entries in `messages`: as a user message, in `system`, or out."""
    kept = []
    for m in body.get("messages") or []:
        if m.get("role") != "system":
            kept.append(m)
            continue
        text = m["content"] if isinstance(m["content"], str) else "\n".join(
            b.get("text", "") for b in m["content"])  # fmt: skip
        if how == "user":
            kept.append({"role": "user", "content": text})
        elif how == "system":
            system = body.get("system") or []
            body["system"] = [*([{"type": "text", "text": system}] if isinstance(system, str)
                                else system), {"type": "text", "text": text}]  # fmt: skip
    body["messages"] = kept


def _variants(agent: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    if agent == "codex":
        b = copy.deepcopy(body)
        _flatten_tools(b)
        return [b]
    if agent == "claude":
        out = []
        for how in ("user", "system", "drop"):
            b = copy.deepcopy(body)
            _system_entries(b, how)
            for key in ("thinking", "context_management", "output_config"):
                b.pop(key, None)
            out.append(b)
        return out
    return [body]


def _call(path: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    from services.collector.anthropic_request import build_messages_call, parse_messages
    from services.collector.request import build_call, parse_body
    from services.collector.responses_request import build_responses_call, parse_responses
    from services.collector.settings import CollectorConfig

    cfg, raw, path = CollectorConfig(), json.dumps(body).encode(), path.split("?")[0]
    if path.endswith("/chat/completions"):
        call = build_call(parse_body(raw), {}, cfg)
    elif path.endswith("/responses"):
        call = build_responses_call(parse_responses(raw), None, {}, cfg).call
    else:
        call = build_messages_call(parse_messages(raw), {}, cfg).call
    return call.messages, call.tools


def examples() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str]]:
    """(messages, tools, the text the model must answer) from the recordings."""
    out = []
    for name in RECORDINGS:
        agent = name.split("-", 1)[0]
        for i, e in enumerate(recording(name)):
            if agent == "openclaw":
                if i == 1:
                    continue  # a tool follow-up: the test model never calls OpenClaw's tools
                target = REPLY
            else:
                target = call_text(agent) if i == 0 else ANSWER
            task = CODEX_TASK if agent == "codex" else CLAUDE_TASK
            body = json.loads(json.dumps(e["body"]).replace(RECORDED_TASK, task))
            for b in _variants(agent, body):
                messages, tools = _call(e["path"], b)
                out.append((messages, tools, target))
    return out


def build_agent_model(path: str | Path, steps: int = 400, seed: int = 0) -> Path:
    """Write the model to `path` (an HF folder) and return it (~1 min of one core)."""
    import torch
    from transformers import AutoModelForCausalLM

    from shared.chat import ChatTemplate

    path = Path(path)
    build_tiny_model(path, seed=seed, vocab_size=VOCAB, texts=corpus(),
                     max_position_embeddings=CONTEXT)  # fmt: skip
    tpl = ChatTemplate.from_pretrained(path)
    eos = tpl.tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = [(tpl.encode(m, t), [*tpl.encode_text(target), eos]) for m, t, target in examples()]
    longest = max(len(p) for p, _ in rows)
    if longest + 64 > CONTEXT:
        raise RuntimeError(f"a recorded prompt has {longest} tokens: more than the test context")
    rng = random.Random(seed)
    head = 8

    def batch() -> tuple[Any, Any, Any, Any]:
        seqs = []
        for prompt, target in rows:
            k = int(2 ** rng.uniform(4, 11))  # a tail of 16..2048 tokens
            start = max(head, len(prompt) - k)
            ids = prompt[:head] + prompt[start:] + target
            pos = [*range(head), *range(start, len(prompt) + len(target))]
            seqs.append((ids, pos, len(ids) - len(target)))
        width = max(len(s) for s, _, _ in seqs)
        ids_t = torch.full((len(seqs), width), eos, dtype=torch.long)
        pos_t = torch.zeros((len(seqs), width), dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (ids, pos, n) in enumerate(seqs):
            ids_t[i, : len(ids)] = torch.tensor(ids)
            pos_t[i, : len(pos)] = torch.tensor(pos)
            labels[i, n : len(ids)] = torch.tensor(ids[n:])
            mask[i, : len(ids)] = 1
        return ids_t, pos_t, labels, mask

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(str(path))
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        for _ in range(steps):
            ids_t, pos_t, labels, mask = batch()
            loss = model(input_ids=ids_t, position_ids=pos_t, attention_mask=mask, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if loss.item() < 1e-4:
                break
        model.train(False)
        _check_greedy(model, rows, eos)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(str(path))
    return path


def _check_greedy(model: Any, rows: list[tuple[list[int], list[int]]], eos: int) -> None:
    """Greedy decoding of every full prompt gives its answer."""
    import torch

    with torch.no_grad():
        for prompt, target in rows:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=len(target) + 4,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos)  # fmt: skip
            got = out[0, len(prompt):].tolist()
            if got != target:
                raise RuntimeError(f"the agent model did not learn its examples: {got} != {target}")
