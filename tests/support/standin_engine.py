"""A stand-in for SGLang's native API over real HTTP: a fixed reply with a fixed latency, a
scripted reply chosen by the prompt, or a stalled one.

For the collector's benchmark (so that what is measured is the proxy's own cost, not a
model's), its fault tests, and the real agents' end-to-end tests (tests/e2e/test_agents.py):

    python -m tests.support.standin_engine --port N [--latency-ms 5] [--tokenizer DIR] [--reply TEXT]
    python -m tests.support.standin_engine --port N --script FILE [--tokenizer DIR] [--model NAME]
    python -m tests.support.standin_engine --port N --stall

- `POST /generate` answers after `--latency-ms` with a canned reply (`--reply`; plain JSON, or
  SGLang's cumulative server-sent events with `stream: true`, one event per token,
  `--latency-ms` spread over them): `text`, `output_ids` (the reply tokenized with the
  tokenizer in DIR, when given), one log-prob per id, `meta_info` with
  `weight_version`, `finish_reason` and token counts, as SGLang does.
- `GET /model_info`, `/health`, `/get_weight_version`.
- `--stall`: accepts connections, reads requests, and never answers anything.
- `--script FILE`: a deterministic scripted engine (`Script` below). Each `/generate` prompt
  (`input_ids`) is decoded with the tokenizer (DIR, default: the script's folder) into its
  chat messages, and the first of the script's ordered rules that matches gives the reply,
  tokenized with that tokenizer and ended by the end-of-message token, as our engine and
  SGLang end a reply on an EOS (`finish_reason` `{"type": "stop", "matched": <its id>}`,
  `text` without it). A prompt no rule matches is refused: HTTP 500, a JSON error that says
  no rule matched (and shows the prompt's last message), never an arbitrary answer. A prompt
  of the context length or more is refused with a 400, as our engine refuses it.
  `GET /script_counts` says how often each rule fired and how many prompts were refused:
  `{"counts": {rule: n, ...}, "refused": n, "unmatched": [last message, ...]}`.
  `/model_info` reports what our engine does: the folder as `model_path` and
  `tokenizer_path`, `served_model_name` (`--model`), and `context_length` (`--context-length`,
  default the folder's config.json `max_position_embeddings`, else 4096, as our engine).

A raw ASGI app on uvicorn (httptools): a few tens of microseconds per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

REPLY = "Sure. Here is a short answer to that, with a few more words to make it realistic."


@dataclass
class Reply:
    """One answer as the engine streams it: its ids, a log-prob for each, the cumulative text
    after each id, and how it finished (`matched`: the EOS id that ended it, or None)."""

    ids: list[int]
    texts: list[str]
    matched: int | None = None
    finish: str = "stop"

    @property
    def text(self) -> str:
        return self.texts[-1] if self.texts else ""

    @property
    def logprobs(self) -> list[float]:
        return [-0.5 - (i % 7) / 10 for i in range(len(self.ids))]

    def cut(self, max_new_tokens: Any) -> Reply:
        """The reply as an engine sampling at most `max_new_tokens` ends it (SGLang's length)."""
        if not isinstance(max_new_tokens, int) or max_new_tokens >= len(self.ids):
            return self
        n = max(max_new_tokens, 0)
        return Reply(self.ids[:n], self.texts[:n], None, "length")


# -- the script ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """A reply, and what the prompt must hold for it (every condition given, all of them):

    - `prompt_contains`: some message of the prompt contains the text;
    - `new_contains`: some message after the prompt's last assistant message (all of them
      when there is none: what this request brings) contains the text;
    - `last_contains` / `last_starts`: the prompt's last message contains / starts with it.

    Messages are the prompt's chat messages (the generation prompt left out), each its
    content without the role line, split at the template's message-start token's id (so
    client text that looks like one never splits a message)."""

    name: str
    reply: str
    prompt_contains: str | None = None
    new_contains: str | None = None
    last_contains: str | None = None
    last_starts: str | None = None

    def matches(self, messages: Sequence[tuple[str, str]]) -> bool:
        if not messages:
            return False
        last = messages[-1][1]
        after = max((i for i, (role, _) in enumerate(messages) if role == "assistant"), default=-1)
        new = [c for _, c in messages[after + 1 :]]
        return ((self.prompt_contains is None or any(self.prompt_contains in c for _, c in messages))
                and (self.new_contains is None or any(self.new_contains in c for c in new))
                and (self.last_contains is None or self.last_contains in last)
                and (self.last_starts is None or last.startswith(self.last_starts)))  # fmt: skip


class Script:
    """Ordered rules (the first that matches answers) on a tokenizer with a chat template's
    message markers: the JSON `{"rules": [{"name", "reply", <conditions of Rule>}, ...],
    "message_start": "<|im_start|>", "message_end": "<|im_end|>"}` (ChatML's by default)."""

    def __init__(self, spec: dict[str, Any], tokenizer: Any) -> None:
        self.tok = tokenizer
        self.rules = [Rule(**r) for r in spec["rules"]]
        names = [r.name for r in self.rules]
        if len(set(names)) != len(names):
            raise ValueError(f"the script's rule names repeat: {names}")
        for r in self.rules:  # a rule without conditions would answer any prompt
            if (r.prompt_contains, r.new_contains, r.last_contains, r.last_starts) == (None,) * 4:
                raise ValueError(f"rule {r.name}: no condition")
        self.start = self._token(spec.get("message_start", "<|im_start|>"))
        self.end = self._token(spec.get("message_end", "<|im_end|>"))
        self.replies = {r.name: self._reply(r) for r in self.rules}

    @classmethod
    def load(cls, path: str | Path, tokenizer_dir: str | Path) -> Script:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        return cls(json.loads(Path(path).read_text()), tok)

    def _token(self, text: str) -> int:
        tid = self.tok.token_to_id(text)
        if tid is None:
            raise ValueError(f"the tokenizer has no token {text!r}")
        return int(tid)

    def _reply(self, rule: Rule) -> Reply:
        ids = list(self.tok.encode(rule.reply, add_special_tokens=False).ids)
        if self.tok.decode(ids, skip_special_tokens=True) != rule.reply:
            raise ValueError(f"rule {rule.name}: its reply does not decode back to itself")
        ids.append(self.end)
        texts = [self.tok.decode(ids[: i + 1], skip_special_tokens=True) for i in range(len(ids))]
        return Reply(ids, texts, self.end)

    def messages(self, input_ids: Sequence[int]) -> list[tuple[str, str]]:
        """(role, content) of each message of a prompt, without the generation prompt."""
        parts: list[list[int]] = []
        for t in input_ids:
            if t == self.start:
                parts.append([])
            elif parts:
                parts[-1].append(t)
        out = []
        for i, part in enumerate(parts):
            closed = self.end in part
            role, _, content = self.tok.decode(part[: part.index(self.end)] if closed else part,
                                               skip_special_tokens=False).partition("\n")  # fmt: skip
            if not closed and i == len(parts) - 1 and role.strip() == "assistant":
                break  # the generation prompt (`<|im_start|>assistant\n`)
            out.append((role.strip(), content))
        return out

    def pick(self, input_ids: Sequence[int]) -> tuple[Rule | None, list[tuple[str, str]]]:
        messages = self.messages(input_ids)
        for rule in self.rules:
            if rule.matches(messages):
                return rule, messages
        return None, messages


# -- the server ----------------------------------------------------------------------------


class StandIn:
    def __init__(self, latency_s: float, tokenizer: str | None, version: str, model: str,
                 reply: str = REPLY, script: Script | None = None,
                 context_length: int | None = None) -> None:  # fmt: skip
        self.latency_s = latency_s
        self.version = version
        self.model = model
        self.tokenizer = tokenizer
        self.script = script
        self.context_length = context_length
        self.counts = {r.name: 0 for r in script.rules} if script is not None else {}
        self.refused = 0
        self.unmatched: list[str] = []
        if tokenizer is not None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
            ids = list(tok.encode(reply, add_special_tokens=False).ids)
        else:
            ids = [100 + i % 300 for i in range(24)]
        # The cumulative text after each token, for streaming.
        n = len(ids)
        self.reply = Reply(ids, [reply[: round(len(reply) * (i + 1) / n)] for i in range(n)])

    def meta(self, reply: Reply, n: int, prompt_tokens: int, done: bool) -> dict[str, Any]:
        lps = [[lp, tid, None] for lp, tid in zip(reply.logprobs[:n], reply.ids[:n], strict=True)]
        finish = None
        if done:
            finish = ({"type": "stop", "matched": reply.matched} if reply.finish == "stop"
                      else {"type": "length", "length": n})  # fmt: skip
        return {"id": "standin", "prompt_tokens": prompt_tokens, "completion_tokens": n,
                "weight_version": self.version, "output_token_logprobs": lps,
                "finish_reason": finish}  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if path == "/generate" and method == "POST":
            req = json.loads(body)
            ids = req.get("input_ids") or []
            reply = self.reply if self.script is None else await self._scripted(send, ids, req)
            if reply is None:
                return  # refused
            if req.get("stream"):
                await self._stream(send, reply, len(ids))
                return
            await asyncio.sleep(self.latency_s)
            n = len(reply.ids)
            out = {
                "text": reply.text,
                "output_ids": reply.ids,
                "meta_info": self.meta(reply, n, len(ids), True),
            }
            await _json(send, out)
        elif path in ("/model_info", "/get_model_info"):
            info: dict[str, Any] = {
                "model_path": self.tokenizer or "standin", "tokenizer_path": self.tokenizer,
                "served_model_name": self.model, "weight_version": self.version,
                "is_generation": True,
            }  # fmt: skip
            if self.context_length is not None:
                info["context_length"] = self.context_length
            await _json(send, info)
        elif path in ("/get_weight_version", "/weight_version"):
            await _json(send, {"weight_version": self.version})
        elif path in ("/health", "/health_generate"):
            await _json(send, {})
        elif path == "/script_counts" and self.script is not None:
            await _json(
                send, {"counts": self.counts, "refused": self.refused, "unmatched": self.unmatched}
            )
        else:
            await _json(send, {"error": "not found"}, 404)

    async def _scripted(self, send: Send, ids: list[Any], req: dict[str, Any]) -> Reply | None:
        """The script's reply to a prompt, or None once the refusal is sent."""
        assert self.script is not None
        if not ids or not all(isinstance(t, int) for t in ids):
            await _json(
                send,
                _error(400, "input_ids: expected a non-empty list of token ids", "BadRequest"),
                400,
            )
            return None
        if self.context_length is not None and len(ids) >= self.context_length:  # as our engine
            msg = f"the prompt has {len(ids)} tokens; the context length is {self.context_length}"
            await _json(send, _error(400, msg, "BadRequest"), 400)
            return None
        rule, messages = self.script.pick(ids)
        if rule is None:
            self.refused += 1
            last = messages[-1][1][-500:] if messages else ""
            self.unmatched = [*self.unmatched, last][-10:]
            msg = (f"no rule of the script matched this prompt ({len(ids)} tokens, "
                   f"{len(messages)} messages; its last message ends {last!r})")  # fmt: skip
            print(f"standin_engine: refused: {msg}", file=sys.stderr, flush=True)
            await _json(send, _error(500, msg, "ScriptNoRuleMatched"), 500)
            return None
        self.counts[rule.name] += 1
        return self.script.replies[rule.name].cut(
            (req.get("sampling_params") or {}).get("max_new_tokens")
        )

    async def _stream(self, send: Send, reply: Reply, prompt: int) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        n = len(reply.ids)
        for i in range(n):
            await asyncio.sleep(self.latency_s / n)
            done = i == n - 1
            event = {"text": reply.texts[i], "output_ids": reply.ids[: i + 1],
                     "meta_info": self.meta(reply, i + 1, prompt, done)}  # fmt: skip
            data = b"data: " + json.dumps(event).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _error(status: int, message: str, kind: str) -> dict[str, Any]:
    """SGLang's native error shape (our engine's `error_body`)."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


async def _json(send: Send, obj: Any, status: int = 200) -> None:
    data = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": data})


async def stall(host: str, port: int) -> None:
    """Accept and read, never answer: the engine that hangs."""
    held: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(handle, host, port)
    async with server:
        await server.serve_forever()


def config_context_length(folder: str | Path) -> int:
    """What our engine serves a model folder with: its config's `max_position_embeddings`
    (its text config's, for a multimodal one), else 4096 (services/engine/model.py)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return int(text.get("max_position_embeddings") or 4096)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--latency-ms", type=float, default=5.0)
    p.add_argument("--tokenizer", help="HF folder with tokenizer.json (reply ids, tokenizer_path)")
    p.add_argument("--weight-version", default="7")
    p.add_argument("--model", default="standin")
    p.add_argument("--stall", action="store_true")
    p.add_argument("--reply", default=REPLY, help="the text every answer is")
    p.add_argument("--script", help="a JSON script of ordered rules: each prompt's reply (Script)")
    p.add_argument("--context-length", type=int,
                   help="the context /model_info reports and /generate holds prompts to (default: "
                        "with --script, the tokenizer folder's config, as our engine; else none)")  # fmt: skip
    a = p.parse_args()
    if a.stall:
        asyncio.run(stall(a.host, a.port))
        return
    import uvicorn

    script, context = None, a.context_length
    if a.script is not None:
        a.tokenizer = a.tokenizer or str(Path(a.script).resolve().parent)
        script = Script.load(a.script, a.tokenizer)
        context = context or config_context_length(a.tokenizer)
    app = StandIn(
        a.latency_ms / 1000, a.tokenizer, a.weight_version, a.model, a.reply, script, context
    )
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning", access_log=False,
                http="httptools", loop="uvloop", lifespan="off", backlog=2048)  # fmt: skip


if __name__ == "__main__":
    main()
