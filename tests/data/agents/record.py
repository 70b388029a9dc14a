"""Real agents' requests, recorded: what OpenClaw, the Codex CLI and Claude Code send a model.

The `*.jsonl` files beside this one are the exact requests (method, path, headers with keys
redacted, body) that the real agents sent to a scripted stand-in model, one JSON object a
line, in the order they came. They are fixtures for the collector's pairing and request
shapes; the end-to-end tests drive the live agents against the real collector.

The stand-in (this file) answers every API in its own shape, streamed or not, the way the
provider would: `POST …/chat/completions`, `…/responses`, `…/messages` (and
`…/messages/count_tokens`), `GET …/models`. Its script: when a request offers the tool
named by `--tool` and its conversation has no tool call yet, it calls that tool with
`--args`; otherwise it answers `--reply`. So a session's first message is answered with one
tool call, the agent runs the tool and sends its result (the follow-up), and every later
message gets text.

Recorded with the agents `make agents` installs (openclaw 2026.9.6, @openai/codex 0.171.0,
@anthropic-ai/claude-code 2.1.332, Node 24.19.0), each in a private HOME, by

    python tests/data/agents/record.py --all --out tests/data/agents

which runs, per recording (the commands are in `AGENTS` below):

- `openclaw-<api>.jsonl`, api = openai-completions | openai-responses | anthropic-messages:
  OpenClaw's default setup (its full system prompt and tools), a custom provider
  `models.providers.rec` in `$HOME/.openclaw/openclaw.json`, two messages in one session:
  `openclaw agent --local --session-id S --message "…" --json`, twice. First message: a
  tool call (`exec`) and its follow-up; second: text.
- `openclaw-lean.jsonl`: the same on `openai-completions` with OpenClaw's lean setup
  (`tools.profile: minimal`, `agents.defaults.contextInjection: never`, `skipBootstrap`).
- `codex.jsonl`: `codex exec --skip-git-repo-check` with its default configuration (sandbox
  read-only, approval never) plus a custom provider (`wire_api = "responses"`), one task: a
  shell tool call (`exec_command`) and its follow-up. Codex's
  requests are refused by today's collector (a `namespace` tool, the built-in
  `web_search`), so this records what it sends, not what it is told.
- `claude.jsonl`: `claude -p --allowedTools Bash` with `ANTHROPIC_BASE_URL`, one task: a
  `Bash` tool call and its follow-up.
- `codex-subagent.jsonl`: the same `codex exec`, a task for a subagent: the model calls
  `spawn_agent` (of the `multi_agent_v1` namespace), Codex starts the subagent's thread
  (its own `thread-id`, the root's `session-id`) and sends the call's output.
- `claude-subagents.jsonl`: `claude -p --allowedTools Bash,Agent`, a task for a subagent:
  the model calls `Agent`, and so does each subagent (they are offered it too), three
  deep; every request has the session's `x-claude-code-session-id`, a subagent's also its
  own `x-claude-code-agent-id` (and `x-claude-code-parent-agent-id`), and the two nested
  ones send the very same first request.

The commands, configuration files and environment are those of tests/support/agents.py.

`python tests/data/agents/record.py --sizes [--tokenizer MODEL_FOLDER]` prints the size of
each recording's first prompt (in tokens as the collector renders it for that model). One recording by hand: `python tests/data/agents/record.py --serve --port N --out F.jsonl
--tool exec --args '{"command": "ls"}'`, then point an agent at http://127.0.0.1:N.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SECRET_HEADERS = {"authorization", "x-api-key", "api-key", "openai-api-key", "cookie"}
KEY = "sk-nextstate-recording"  # the key the agents are given; redacted in the recordings


class Script:
    """What the stand-in model answers."""

    def __init__(self, tool: str | None, args: dict[str, Any], reply: str) -> None:
        self.tool, self.args, self.reply = tool, args, reply

    def call_tool(self, body: dict[str, Any], api: str) -> bool:
        """Call `tool` when offered and the conversation holds no tool call yet."""
        if self.tool is None or self.tool not in _tool_names(body, api):
            return False
        return not _has_tool_call(body, api)


def _tool_names(body: dict[str, Any], api: str) -> set[str]:
    names: set[str] = set()
    for t in body.get("tools") or []:
        if not isinstance(t, dict):
            continue
        if api == "chat":
            names.add(str((t.get("function") or {}).get("name")))
        else:
            names.add(str(t.get("name")))
            for inner in t.get("tools") or []:  # a Responses `namespace` tool: namespace.name
                if isinstance(inner, dict):
                    names.add(f"{t.get('name')}.{inner.get('name')}")
    return names


def _has_tool_call(body: dict[str, Any], api: str) -> bool:
    if api == "chat":
        return any(m.get("tool_calls") for m in body.get("messages") or [] if isinstance(m, dict))
    if api == "responses":
        items = body.get("input")
        return isinstance(items, list) and any(
            isinstance(i, dict) and i.get("type") in ("function_call", "custom_tool_call",
                                                       "local_shell_call") for i in items)  # fmt: skip
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") == "tool_use" for b in content
        ):
            return True
    return False


class Recorder(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, out: Path, script: Script) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.out, self.script, self.lock = out, script, threading.Lock()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("")

    def record(self, entry: dict[str, Any]) -> None:
        with self.lock, self.out.open("a") as f:
            f.write(json.dumps(entry, ensure_ascii=False) + "\n")


class Handler(BaseHTTPRequestHandler):
    server: Recorder
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _record(self, body: Any) -> None:
        headers = {k.lower(): ("<redacted>" if k.lower() in SECRET_HEADERS else v)
                   for k, v in self.headers.items()}  # fmt: skip
        self.server.record({"method": self.command, "path": self.path, "headers": headers,
                            "body": body})  # fmt: skip

    def do_GET(self) -> None:
        self._record(None)
        if self.path.split("?")[0].rstrip("/").endswith("/models"):
            self._json(200, {"object": "list", "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": "nextstate",
                 "type": "model", "display_name": m, "created_at": "2026-01-01T00:00:00Z"}
                for m in ("rec-model",)]})  # fmt: skip
        else:
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

    def do_HEAD(self) -> None:
        self._record(None)
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(n) if n else self._read_chunked()
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            body = {"_raw": raw.decode(errors="replace")}
        self._record(body)
        path = self.path.split("?")[0].rstrip("/")
        if path.endswith("/count_tokens"):
            self._json(200, {"input_tokens": len(json.dumps(body)) // 4})
        elif path.endswith("/chat/completions"):
            self._answer(body, "chat")
        elif path.endswith("/responses"):
            self._answer(body, "responses")
        elif path.endswith("/messages"):
            self._answer(body, "messages")
        else:
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})

    def _read_chunked(self) -> bytes:
        if "chunked" not in (self.headers.get("transfer-encoding") or ""):
            return b""
        out = b""
        while True:
            size = int(self.rfile.readline().strip() or b"0", 16)
            if size == 0:
                self.rfile.readline()
                return out
            out += self.rfile.read(size)
            self.rfile.readline()

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _answer(self, body: dict[str, Any], api: str) -> None:
        script = self.server.script
        call = script.call_tool(body, api) if isinstance(body, dict) else False
        model = str(body.get("model", "rec-model")) if isinstance(body, dict) else "rec-model"
        make = {"chat": _chat, "responses": _responses, "messages": _messages}[api]
        events = make(model, script, call)
        if isinstance(body, dict) and body.get("stream"):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("cache-control", "no-cache")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for name, data in events:
                line = (f"event: {name}\n" if name else "") + f"data: {data}\n\n"
                chunk = line.encode()
                self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        else:
            final = [json.loads(d) for n, d in events if n == "final"]
            self._json(200, final[0])


Events = Iterator[tuple[str | None, str]]  # (SSE event name or None, data); "final": whole body


def _usage_chat() -> dict[str, int]:
    return {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105}


def _chat(model: str, script: Script, call: bool) -> Events:
    cid, created = f"chatcmpl-{uuid.uuid4().hex[:12]}", int(time.time())
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
    args = json.dumps(script.args)
    if call:
        tc = {"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function",
              "function": {"name": script.tool, "arguments": args}}  # fmt: skip
        yield None, json.dumps({**head, "choices": [{"index": 0, "delta": {
            "role": "assistant", "content": None, "tool_calls": [{"index": 0, **tc}]},
            "finish_reason": None}]})  # fmt: skip
        finish, message = "tool_calls", {"role": "assistant", "content": None, "tool_calls": [tc]}
    else:
        yield None, json.dumps({**head, "choices": [{"index": 0, "delta": {
            "role": "assistant", "content": script.reply}, "finish_reason": None}]})  # fmt: skip
        finish, message = "stop", {"role": "assistant", "content": script.reply}
    yield None, json.dumps({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    yield None, json.dumps({**head, "choices": [], "usage": _usage_chat()})
    yield None, "[DONE]"
    yield "final", json.dumps({"id": cid, "object": "chat.completion", "created": created,
                               "model": model, "usage": _usage_chat(), "choices": [
                                   {"index": 0, "message": message, "finish_reason": finish}]})  # fmt: skip


def _responses(model: str, script: Script, call: bool) -> Events:
    rid = f"resp_{uuid.uuid4().hex[:16]}"
    seq = iter(range(10_000))
    base = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
            "usage": None}  # fmt: skip

    def ev(kind: str, **data: Any) -> tuple[str, str]:
        return kind, json.dumps({"type": kind, "sequence_number": next(seq), **data})

    yield ev("response.created", response=base)
    yield ev("response.in_progress", response=base)
    if call:
        iid, args = f"fc_{uuid.uuid4().hex[:12]}", json.dumps(script.args)
        namespace, _, name = str(script.tool).rpartition(".")
        item = {"id": iid, "type": "function_call", "status": "in_progress",
                "call_id": f"call_{uuid.uuid4().hex[:8]}", "name": name, "arguments": "",
                **({"namespace": namespace} if namespace else {})}  # fmt: skip
        yield ev("response.output_item.added", output_index=0, item=item)
        yield ev("response.function_call_arguments.delta", item_id=iid, output_index=0, delta=args)
        yield ev("response.function_call_arguments.done", item_id=iid, output_index=0, arguments=args)
        done = {**item, "status": "completed", "arguments": args}
    else:
        iid, text = f"msg_{uuid.uuid4().hex[:12]}", script.reply
        item = {"id": iid, "type": "message", "status": "in_progress", "role": "assistant",
                "content": []}  # fmt: skip
        part = {"type": "output_text", "text": "", "annotations": []}
        yield ev("response.output_item.added", output_index=0, item=item)
        yield ev("response.content_part.added", item_id=iid, output_index=0, content_index=0, part=part)
        yield ev("response.output_text.delta", item_id=iid, output_index=0, content_index=0, delta=text)
        yield ev("response.output_text.done", item_id=iid, output_index=0, content_index=0, text=text)
        yield ev("response.content_part.done", item_id=iid, output_index=0, content_index=0,
                 part={**part, "text": text})  # fmt: skip
        done = {**item, "status": "completed", "content": [{**part, "text": text}]}
    yield ev("response.output_item.done", output_index=0, item=done)
    usage = {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": 105}  # fmt: skip
    final = {**base, "status": "completed", "output": [done], "usage": usage}
    yield ev("response.completed", response=final)
    yield "final", json.dumps(final)


def _messages(model: str, script: Script, call: bool) -> Events:
    mid = f"msg_{uuid.uuid4().hex[:16]}"
    message = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 100, "output_tokens": 1}}  # fmt: skip

    def ev(kind: str, **data: Any) -> tuple[str, str]:
        return kind, json.dumps({"type": kind, **data})

    yield ev("message_start", message=message)
    if call:
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:12]}", "name": script.tool,
                 "input": {}}  # fmt: skip
        yield ev("content_block_start", index=0, content_block=block)
        yield ev("content_block_delta", index=0,
                 delta={"type": "input_json_delta", "partial_json": json.dumps(script.args)})  # fmt: skip
        content, stop = [{**block, "input": script.args}], "tool_use"
    else:
        yield ev("content_block_start", index=0, content_block={"type": "text", "text": ""})
        yield ev("content_block_delta", index=0, delta={"type": "text_delta", "text": script.reply})
        content, stop = [{"type": "text", "text": script.reply}], "end_turn"
    yield ev("content_block_stop", index=0)
    yield ev("message_delta", delta={"stop_reason": stop, "stop_sequence": None},
             usage={"output_tokens": 5})  # fmt: skip
    yield ev("message_stop")
    yield "final", json.dumps({**message, "content": content, "stop_reason": stop,
                               "usage": {"input_tokens": 100, "output_tokens": 5}})  # fmt: skip


def serve(port: int, out: Path, script: Script) -> Recorder:
    server = Recorder(port, out, script)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# -- the recordings -------------------------------------------------------------------------

WORKSPACE_FILES = {"notes.txt": "buy milk\n", "hello.py": "print('hello')\n"}
OPENCLAW_APIS = ("openai-completions", "openai-responses", "anthropic-messages")
OPENCLAW_MESSAGES = ("List the files in your workspace with ls.", "Thanks! What is 2 + 2?")
TASK = "List the files in this directory with ls, then tell me what you found."
LEAN = {"tools": {"profile": "minimal"}}  # OpenClaw's lean setup, with LEAN_DEFAULTS
LEAN_DEFAULTS = {"contextInjection": "never", "skipBootstrap": True}
AGENTS: dict[str, tuple[str, dict[str, Any]]] = {  # recording -> (tool to call, its arguments)
    "openclaw": ("exec", {"command": "ls", "title": "List workspace files"}),
    "codex": ("exec_command", {"cmd": "ls"}),
    "claude": ("Bash", {"command": "ls", "description": "List files in current directory"}),
}
SUBTASK = "List the files in this directory with ls and report them."
SUBAGENTS: dict[str, tuple[str, dict[str, Any]]] = {  # a namespaced tool: namespace.name
    "codex-subagent": ("multi_agent_v1.spawn_agent", {"message": SUBTASK}),
    "claude-subagents": ("Agent", {"description": "List files", "prompt": SUBTASK,
                                   "subagent_type": "general-purpose"}),
}
SUBAGENT_TASK = "Use a subagent to list the files in this directory, then tell me what it found."


def record(name: str, out_dir: Path, reply: str = "Done.") -> Path:
    """Run one recording (see the module docstring); returns the .jsonl written."""
    from tests.support import agents as A
    from tests.support.servers import free_port

    kind = name.split("-", 1)[0]
    tool, args = SUBAGENTS.get(name) or AGENTS[kind]
    task = SUBAGENT_TASK if name in SUBAGENTS else TASK
    out = out_dir / f"{name}.jsonl"
    port = free_port()
    server = serve(port, out, Script(tool, args, reply))
    base = f"http://127.0.0.1:{port}"
    tmp = Path(tempfile.mkdtemp(prefix=f"ns-rec-{kind}-"))
    try:
        home = A.AgentHome(tmp / "home")
        work = tmp / "work"
        work.mkdir(parents=True)
        for fname, text in WORKSPACE_FILES.items():
            (work / fname).write_text(text)
        runs: list[subprocess.CompletedProcess[str]] = []
        if kind == "openclaw":
            api = name.split("-", 1)[1]
            lean = api == "lean"
            config = A.openclaw_config(base, "openai-completions" if lean else api, "rec-model")
            config["agents"]["defaults"]["workspace"] = str(work)
            if lean:
                config.update(LEAN)
                config["agents"]["defaults"].update(LEAN_DEFAULTS)
            A.write_openclaw_config(home, config)
            for message in OPENCLAW_MESSAGES:
                runs.append(A.openclaw_turn(home, "rec-session", message, cwd=work))
        elif kind == "codex":
            A.write_codex_config(home, A.codex_config(base, "rec-model"))
            runs.append(A.codex_exec(home, work, task))
        else:
            flags = ["--allowedTools", "Bash,Agent", "--output-format", "json"] if name in SUBAGENTS else None
            runs.append(A.claude_print(home, work, base, "rec-model", task, flags=flags))
        for run in runs:
            if run.returncode != 0:
                raise RuntimeError(f"{name}: exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def sizes(folder: Path, tokenizer: Path | None) -> None:
    """Characters of each recording's first prompt (system prompt, messages, tools as JSON);
    with `tokenizer` (an HF model folder), its prompt ids as the collector renders them."""
    tpl = None
    if tokenizer is not None:
        from shared.chat import ChatTemplate

        tpl = ChatTemplate.from_pretrained(tokenizer)
    for path in sorted(folder.glob("*.jsonl")):
        first = json.loads(path.open().readline())
        body = first["body"]
        parts = [body.get(k) for k in ("system", "instructions", "messages", "input", "tools")]
        chars = sum(len(p) if isinstance(p, str) else len(json.dumps(p, ensure_ascii=False))
                    for p in parts if p)  # fmt: skip
        line = f"{path.stem}: {chars} characters, {len(body.get('tools') or [])} tools"
        if tpl is not None:
            from tests.support.agent_model import collector_conversation

            messages, tools = collector_conversation(first["path"], body)
            line += f", {len(tpl.encode(messages, tools))} prompt tokens"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--all", action="store_true", help="every recording of the docstring")
    ap.add_argument("names", nargs="*", help="openclaw-<api> | codex | claude | codex-subagent | claude-subagents")
    ap.add_argument("--serve", action="store_true", help="only serve and record (by hand)")
    ap.add_argument("--sizes", action="store_true", help="each recording's first prompt: its size")
    ap.add_argument("--tokenizer", type=Path, help="with --sizes: count its tokens with this model's")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tool")
    ap.add_argument("--args", default="{}")
    ap.add_argument("--reply", default="Done.")
    a = ap.parse_args()
    if a.serve:
        server = Recorder(a.port, a.out, Script(a.tool, json.loads(a.args), a.reply))
        print(f"recording to {a.out} on http://127.0.0.1:{server.server_address[1]}", flush=True)
        server.serve_forever()
        return
    if a.sizes:
        sizes(a.out, a.tokenizer)
        return
    names = [*(f"openclaw-{api}" for api in OPENCLAW_APIS), "openclaw-lean", "codex", "claude",
             *SUBAGENTS] if a.all else a.names  # fmt: skip
    for name in names:
        t0 = time.monotonic()
        path = record(name, a.out)
        n = sum(1 for _ in path.open())
        print(f"{name}: {n} requests in {time.monotonic() - t0:.0f} s -> {path}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
