"""A tiny model for the real agents: their ~12k-token default prompts fit, and it calls
Codex's and Claude Code's own shell tools.

The real agents' prompts are big (OpenClaw's system prompt and tools are ~51k characters,
Codex's and Claude Code's ~40k), so the test model of tiny_model.py is built with

- a 32,768-token context (`max_position_embeddings`) and an 8,192-token BPE trained on
  the recorded requests' own text (tests/data/agents) as well, so their prompts take about
  what a real model's tokenizer makes of them (~12k tokens; SmolLM2's: ~10k);
- sliding-window attention (a Mistral; each of its two layers attends to the last
  `WINDOW` tokens), so what it answers is a function of the prompt's last `TAIL` tokens,
  exactly (the engine still prefills every token);
- a few seconds of training (as tool_model.py does) on those tails of the recorded
  requests, rendered by the collector's own request builders and `shared.chat.ChatTemplate`
  (with what changes between runs, dates, times, temporary paths, Codex's chunk ids,
  redrawn), to answer:
  * Codex's task (`CODEX_TASK`): a call of its `exec_command` tool, `{"cmd": "ls"}`;
  * Claude Code's task (`CLAUDE_TASK`): a call of its `Bash` tool, `{"command": "ls", …}`;
  * a tool result: `ANSWER`;
  * anything OpenClaw sends (its turns end on its internal-context message): `REPLY`.

`build_agent_model` checks that greedy decoding of every recorded full prompt gives its
answer. The collector serves it with `default_temperature` 0 (the agents send none).

Requests that today's collector refuses (Codex's `namespace` tool and built-in
`web_search`, Claude Code's `system` entries inside `messages`) are rendered as the
collector is to take them (issue 22): the namespace's functions flattened, built-in
tools left out, a `system` entry as a user message, in the system prompt, or left out
(all three are trained, so the model does not depend on which).
"""

from __future__ import annotations

import copy
import json
import logging
import random
import re
import time
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
log = logging.getLogger(__name__)
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
            out.append(b)
        return out
    return [body]


def collector_conversation(path: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    from services.collector.anthropic_request import build_messages_call, parse_messages
    from services.collector.request import build_call, parse_body
    from services.collector.responses_request import build_responses_call, parse_responses
    """The messages and tools the collector renders for a recorded request."""
    from services.collector.settings import CollectorConfig

    cfg, raw, path = CollectorConfig(), json.dumps(body).encode(), path.split("?")[0]
    if path.endswith("/chat/completions"):
        call = build_call(parse_body(raw), {}, cfg)
    elif path.endswith("/responses"):
        call = build_responses_call(parse_responses(raw), None, {}, cfg).call
    else:
        call = build_messages_call(parse_messages(raw), {}, cfg).call
    return call.messages, call.tools


def examples() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str, bool]]:
    """(messages, tools, the text the model must answer, whether to check it on the full
    prompt: the first rendering of each recorded Codex and Claude Code request, and of
    OpenClaw's first) from the recordings."""
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
            for v, b in enumerate(_variants(agent, body)):
                messages, tools = collector_conversation(e["path"], b)
                out.append((messages, tools, target, v == 0 and (agent != "openclaw" or (name, i) == (RECORDINGS[0], 0))))
    return out


WINDOW = 64  # each layer attends to the last 64 tokens: the answer is a function of the tail
TAIL = 2 * WINDOW + 32  # what two layers can see, and some


def _augment(text: str, rng: random.Random) -> str:
    """The recorded request with what changes from run to run redrawn: dates and times,
    temporary paths, Codex's chunk ids and wall times."""
    text = re.sub(r"\d{4}-\d{2}-\d{2}", lambda _: f"20{rng.randint(24, 39)}-{rng.randint(1, 12):02}-"
                  f"{rng.randint(1, 28):02}", text)  # fmt: skip
    text = re.sub(r"\b\d{2}:\d{2}\b", lambda _: f"{rng.randint(0, 23):02}:{rng.randint(0, 59):02}", text)
    text = re.sub(r"/tmp/[\w.-]+/work", lambda _: f"/tmp/pytest-of-root/pytest-{rng.randint(0, 999)}/"
                  f"test_{rng.choice('abcdefgh')}{rng.randint(0, 99)}/work", text)  # fmt: skip
    text = re.sub(r"Chunk ID: \w+", lambda _: f"Chunk ID: {rng.getrandbits(24):06x}", text)
    return re.sub(r"Wall time: [\d.]+", lambda _: f"Wall time: {rng.random():.4f}", text)


def build_agent_model(path: str | Path, steps: int = 600, seed: int = 0, variants: int = 6) -> Path:
    """Write the model to `path` (an HF folder) and return it (~1 min of one core)."""
    import torch
    from transformers import AutoModelForCausalLM

    from shared.chat import ChatTemplate

    path = Path(path)
    build_tiny_model(path, seed=seed, vocab_size=VOCAB, texts=corpus(),
                     max_position_embeddings=CONTEXT, sliding_window=WINDOW)  # fmt: skip
    tpl = ChatTemplate.from_pretrained(path)
    eos = tpl.tokenizer.convert_tokens_to_ids("<|im_end|>")
    rng = random.Random(seed)
    full: list[tuple[list[int], list[int]]] = []  # (whole prompt, answer) to check
    views: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()  # (prompt tail, answer) to train
    for messages, tools, target, check in examples():
        answer = [*tpl.encode_text(target), eos]
        for i in range(variants):
            m, t = (messages, tools) if i == 0 else json.loads(_augment(json.dumps([messages, tools]), rng))
            prompt = tpl.encode(m, t)
            if len(prompt) + len(answer) > CONTEXT:
                raise RuntimeError(f"a recorded prompt has {len(prompt)} tokens: more than the test context")
            if i == 0 and check:
                full.append((prompt, answer))
            views.add((tuple(prompt[-TAIL:]), tuple(answer)))
    rows = sorted(views)
    log.debug("%d prompts, %d distinct tails", len(full), len(rows))

    def batch(picked: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[Any, Any, Any, Any]:
        width = max(len(p) + len(a) for p, a in picked)
        ids = torch.full((len(picked), width), eos, dtype=torch.long)
        mask = torch.zeros((len(picked), width), dtype=torch.long)
        where, labels = [], []  # (row, position) predicting each answer token, and the token
        for r, (p, a) in enumerate(picked):
            seq = [*p, *a]
            ids[r, : len(seq)] = torch.tensor(seq)
            mask[r, : len(seq)] = 1
            where += [(r, j - 1) for j in range(len(p), len(seq))]
            labels += a
        at = (torch.tensor([r for r, _ in where]), torch.tensor([c for _, c in where]))
        return ids, mask, at, torch.tensor(labels)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend on a shared machine
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(str(path))
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        t0 = time.monotonic()
        for step in range(steps):
            ids, mask, at, labels = batch(rng.sample(rows, min(16, len(rows))))
            # The vocabulary head only where an answer token is predicted.
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[at]), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 20 == 0:
                log.debug("step %d: loss %.5f, %.1f s", step, loss.item(), time.monotonic() - t0)
            if step % 50 == 49 and _all_learned(model, rows, batch):
                break
        model.train(False)
        _check_greedy(model, full, eos)
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(str(path))
    return path


def _all_learned(model: Any, rows: list[Any], batch: Any) -> bool:
    """Every answer token is the argmax, with a margin, in every training view."""
    import torch

    with torch.no_grad():
        ids, mask, at, labels = batch(rows)
        logits = model.lm_head(model.model(input_ids=ids, attention_mask=mask).last_hidden_state[at])
        top2 = logits.topk(2, dim=-1)
        right = top2.indices[:, 0] == labels
        margin = top2.values[:, 0] - top2.values[:, 1]
        return bool(right.all() and (margin > 2.0).all())


def _check_greedy(model: Any, rows: list[tuple[list[int], list[int]]], eos: int) -> None:
    """Greedy decoding of each full prompt gives its answer: at every answer position the
    answer's token is the argmax (one forward of prompt + answer; the eos ends it)."""
    import torch

    with torch.no_grad():
        for prompt, answer in rows:
            logits = model(input_ids=torch.tensor([prompt + answer]), logits_to_keep=len(answer) + 1).logits
            got = logits[0, :-1].argmax(-1).tolist()
            if got != answer:
                raise RuntimeError(f"the agent model did not learn its examples: {got} != {answer}")
