"""A stand-in policy: a small real OpenAI-compatible HTTP server with fixed latency and
scripted tool calls, for the envs workers' tests and bench/envs.py (a third-party model
server's fake, as a small real HTTP server; the real collector and engine are tested too).

Per request, after `latency_s`: while the conversation holds fewer than `tool_turns`
assistant messages, the answer calls `tool` with `{arg: <the first quoted word of the
first user message>}` (EchoEnv's tasks: "Echo the word 'ping' ..."); then a plain answer.
Every request is recorded (session id, X-Session-Done, message count) in `requests`.

    with StandinPolicy(latency_s=0.2, tool_turns=2) as policy:
        policy.url  # http://127.0.0.1:<port>/v1
    python tests/support/standin_policy.py --port 8123 --latency 0.2   # as a process
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

WORD = re.compile(r"'([^']+)'")


@dataclass
class Seen:
    session_id: str
    done: bool
    messages: int
    assistants: int


@dataclass
class StandinPolicy:
    latency_s: float = 0.2
    tool_turns: int = 2
    tool: str = "echo"
    arg: str = "text"
    version: int = 7
    port: int = 0
    requests: list[Seen] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages", [])
        assistants = sum(1 for m in messages if m.get("role") == "assistant")
        user = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
        found = WORD.search(user if isinstance(user, str) else "")
        message: dict[str, Any] = {"role": "assistant", "content": "done"}
        finish = "stop"
        if assistants < self.tool_turns and body.get("tools"):
            args = json.dumps({self.arg: found.group(1) if found else "x"})
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function",
                 "function": {"name": self.tool, "arguments": args}}]}
            finish = "tool_calls"
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:8]}", "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model", "standin"),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    def __enter__(self) -> StandinPolicy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> StandinPolicy:
        policy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.send_header("x-policy-version", str(policy.version))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send({"object": "list", "data": [{"id": "standin", "object": "model", "owned_by": "test"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))) or b"{}")
                messages = body.get("messages", [])
                policy.requests.append(Seen(
                    self.headers.get("x-session-id", ""), self.headers.get("x-session-done", "") == "1",
                    len(messages), sum(1 for m in messages if m.get("role") == "assistant")))
                time.sleep(policy.latency_s)
                self._send(policy.answer(body))

        ThreadingHTTPServer.daemon_threads = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, name="standin-policy", daemon=True).start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--latency", type=float, default=0.2)
    p.add_argument("--tool-turns", type=int, default=2)
    a = p.parse_args()
    policy = StandinPolicy(latency_s=a.latency, tool_turns=a.tool_turns, port=a.port).start()
    print(policy.url, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
