"""The agent model for the real agents: a tokenizer and config their ~12k-token default
prompts fit, and a script that answers them exactly (tests/support/standin_engine.py
`--script`), so what the agents are answered is fixed by construction, not by sampling.

The real agents' prompts are big (OpenClaw's system prompt and tools are ~51k characters,
Codex's and Claude Code's ~40k), so the folder `build_agent_model` writes has

- an 8,192-token BPE trained on the recorded requests' own text (tests/data/agents) as
  well, so their prompts take about what a real model's tokenizer makes of them (~12k
  tokens; SmolLM2's: ~10k), with the ChatML chat template of tiny_model.py (tools in the
  system turn, Hermes `<tool_call>`s, tool results as `<tool_response>`), which the
  collector renders every request with;
- a model config (`config.json`, no weights) with a 32,768-token context
  (`max_position_embeddings`), which the scripted engine reports as its `context_length`
  as our engine does, so the collector refuses a longer prompt itself;
- `script.json`: the scripted engine's ordered rules (`script()`), each on the chat
  messages of the prompt it is sent (decoded with this tokenizer):
  * `openclaw`: anything OpenClaw sends (its requests end on its internal-context
    message) -> `REPLY`;
  * `codex-answer` / `claude-answer`: a tool result as the last message of a
    conversation holding Codex's / Claude Code's task -> `ANSWER`;
  * `codex-call`: Codex's task (`CODEX_TASK`) in what the request brings (the messages
    after its last assistant message) -> a call of its `exec_command` tool, `{"cmd": "ls"}`;
  * `claude-call`: Claude Code's task (`CLAUDE_TASK`) so -> a call of its `Bash` tool,
    `{"command": "ls", …}`.
  Any other prompt is refused by the engine (a 500 that names it), never answered.

`build_agent_model` checks that the rules pick the expected answer for every recorded
request (the tasks put in), rendered by the collector's own request builders and
`shared.chat.ChatTemplate`, and that each fits the context.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support.agents import recording
from tests.support.tiny_model import build_tokenizer

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
OPENCLAW_CONTEXT_END = "<<<END_OPENCLAW_INTERNAL_CONTEXT>>>"  # ends each OpenClaw request
TOOL_RESULT = "<tool_response>\n"  # how the chat template opens a tool result


def call_text(agent: str) -> str:
    name, args = CALLS[agent]
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def script() -> dict[str, Any]:
    """The scripted engine's rules (tests.support.standin_engine.Script), first match wins."""
    return {"message_start": "<|im_start|>", "message_end": "<|im_end|>", "rules": [
        {"name": "openclaw", "last_contains": OPENCLAW_CONTEXT_END, "reply": REPLY},
        {"name": "codex-answer", "prompt_contains": CODEX_TASK, "last_starts": TOOL_RESULT,
         "reply": ANSWER},
        {"name": "claude-answer", "prompt_contains": CLAUDE_TASK, "last_starts": TOOL_RESULT,
         "reply": ANSWER},
        {"name": "codex-call", "new_contains": CODEX_TASK, "reply": call_text("codex")},
        {"name": "claude-call", "new_contains": CLAUDE_TASK, "reply": call_text("claude")},
    ]}  # fmt: skip


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


def collector_conversation(
    path: str, body: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools the collector renders for a recorded request."""
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


def expected_rules() -> Iterator[tuple[str, int, dict[str, Any], str]]:
    """(recording, index, request with the test's task put in, the rule that must answer it)
    for every recorded request but OpenClaw's tool follow-ups (the script never calls its
    tools)."""
    for name in RECORDINGS:
        agent = name.split("-", 1)[0]
        for i, e in enumerate(recording(name)):
            if agent == "openclaw":
                if i == 1:
                    continue  # its tool follow-up: no rule answers it
                rule = "openclaw"
            else:
                rule = f"{agent}-call" if i == 0 else f"{agent}-answer"
            task = CODEX_TASK if agent == "codex" else CLAUDE_TASK
            yield name, i, json.loads(json.dumps(e).replace(RECORDED_TASK, task)), rule


def build_agent_model(path: str | Path) -> Path:
    """Write the folder (tokenizer, config.json, script.json) to `path` and return it; check
    the script on the recorded requests (a few seconds)."""
    from transformers import LlamaConfig

    from shared.chat import ChatTemplate
    from tests.support.standin_engine import Script

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, VOCAB, texts=corpus())
    tpl = ChatTemplate.from_pretrained(path)
    eos = tpl.tokenizer.convert_tokens_to_ids("<|im_end|>")
    LlamaConfig(vocab_size=len(tpl.tokenizer), max_position_embeddings=CONTEXT, hidden_size=64,
                intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, eos_token_id=eos, pad_token_id=tpl.tokenizer.pad_token_id,
                bos_token_id=None, tie_word_embeddings=True).save_pretrained(str(path))  # fmt: skip
    (path / "script.json").write_text(json.dumps(script(), indent=1))
    rules = Script.load(path / "script.json", path)
    for name, i, e, want in expected_rules():
        prompt = tpl.encode(*collector_conversation(e["path"], e["body"]))
        if len(prompt) >= CONTEXT:
            raise RuntimeError(f"{name}[{i}] has {len(prompt)} tokens: more than the test context")
        got, _ = rules.pick(prompt)
        if got is None or got.name != want:
            picked = got.name if got is not None else "no rule"
            raise RuntimeError(f"{name}[{i}]: the script picks {picked}, not {want}")
    return path
