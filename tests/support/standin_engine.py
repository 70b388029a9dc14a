"""A stand-in for SGLang's native API with a fixed latency, over real HTTP; or a stalled one.

For the collector's benchmark (so that what is measured is the proxy's own cost, not a
model's) and its fault tests:

    python -m tests.support.standin_engine --port N [--latency-ms 5] [--tokenizer DIR] [--reply TEXT]
    python -m tests.support.standin_engine --port N --stall

- `POST /generate` answers after `--latency-ms` with a canned reply (`--reply`; plain JSON, or
  SGLang's cumulative server-sent events with `stream: true`, one event per token,
  `--latency-ms` spread over them): `text`, `output_ids` (the reply tokenized with the
  tokenizer in DIR, when given), one log-prob per id, `meta_info` with
  `weight_version`, `finish_reason` and token counts, as SGLang does.
- `GET /model_info`, `/health`, `/get_weight_version`.
- `--stall`: accepts connections, reads requests, and never answers anything.

A raw ASGI app on uvicorn (httptools): a few tens of microseconds per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

REPLY = "Sure. Here is a short answer to that, with a few more words to make it realistic."


class StandIn:
    def __init__(self, latency_s: float, tokenizer: str | None, version: str, model: str,
                 reply: str = REPLY) -> None:  # fmt: skip
        self.latency_s = latency_s
        self.reply = reply
        self.version = version
        self.model = model
        self.tokenizer = tokenizer
        if tokenizer is not None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
            self.ids = list(tok.encode(reply, add_special_tokens=False).ids)
        else:
            self.ids = [100 + i % 300 for i in range(24)]
        self.logprobs = [-0.5 - (i % 7) / 10 for i in range(len(self.ids))]
        # The cumulative text after each token, for streaming.
        n = len(self.ids)
        self.texts = [reply[: round(len(reply) * (i + 1) / n)] for i in range(n)]

    def meta(self, n: int, prompt_tokens: int, done: bool) -> dict[str, Any]:
        lps = [[self.logprobs[i], self.ids[i], None] for i in range(n)]
        return {"id": "standin", "prompt_tokens": prompt_tokens, "completion_tokens": n,
                "weight_version": self.version, "output_token_logprobs": lps,
                "finish_reason": {"type": "stop", "matched": None} if done else None}  # fmt: skip

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
            prompt = len(req.get("input_ids") or [])
            if req.get("stream"):
                await self._stream(send, prompt)
                return
            await asyncio.sleep(self.latency_s)
            n = len(self.ids)
            out = {"text": self.reply, "output_ids": self.ids, "meta_info": self.meta(n, prompt, True)}
            await _json(send, out)
        elif path in ("/model_info", "/get_model_info"):
            await _json(send, {"model_path": self.tokenizer or "standin", "tokenizer_path": self.tokenizer,
                               "served_model_name": self.model, "weight_version": self.version,
                               "is_generation": True})  # fmt: skip
        elif path in ("/get_weight_version", "/weight_version"):
            await _json(send, {"weight_version": self.version})
        elif path in ("/health", "/health_generate"):
            await _json(send, {})
        else:
            await _json(send, {"error": "not found"}, 404)

    async def _stream(self, send: Send, prompt: int) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        n = len(self.ids)
        for i in range(n):
            await asyncio.sleep(self.latency_s / n)
            done = i == n - 1
            event = {"text": self.texts[i], "output_ids": self.ids[: i + 1],
                     "meta_info": self.meta(i + 1, prompt, done)}  # fmt: skip
            data = b"data: " + json.dumps(event).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


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
    a = p.parse_args()
    if a.stall:
        asyncio.run(stall(a.host, a.port))
        return
    import uvicorn

    app = StandIn(a.latency_ms / 1000, a.tokenizer, a.weight_version, a.model, a.reply)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning", access_log=False,
                http="httptools", loop="uvloop", lifespan="off", backlog=2048)  # fmt: skip


if __name__ == "__main__":
    main()
