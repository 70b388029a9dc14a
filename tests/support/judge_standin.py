"""A stand-in judge model: a small real HTTP server with scripted answers, cheap enough for benches.

It speaks the subset the judge uses: OpenAI `POST /v1/chat/completions` (+ `GET
/v1/models`) and SGLang's native `POST /generate` with text in (+ `GET /health`).
Raw asyncio + httptools (no framework), so at hundreds of calls in flight it stays
far from being the bottleneck.

Script a turn by putting a directive anywhere in the text the judge sends (e.g. in the
turn's next state): `<<standin votes=1,-1,x; delays=0,0,5; fail=2; status=503>>`

- `votes`: the answer of the 1st, 2nd, … call with this exact prompt (the last entry
  repeats): `1`, `-1`, `0` (a reasoning line with an earlier decoy box, then the
  verdict box last), `x` (no box: unparsable). Default `1`.
- `hint_votes` / `hints` (`|`-separated): the same for hint-judge calls (recognized by
  the [HINT_START] marker in the prompt); `hint_votes` default `-1`.
- `lessons` (`|`-separated): what an experience-extractor call (recognized by the
  [EXPERIENCE_START] marker) answers, one `- ` line each between the markers; default
  none (the markers with nothing between); `lessons=x`: no markers (unparsable). The
  extractor reads a whole session: its FIRST directive counts (put it in the first message).
- `delays`: seconds before answering, per call (last repeats); default `--latency`.
- `fail=N`: the first N calls with this prompt answer `status` (default 500) instead.

Calls are counted per (kind, prompt): `GET /stats` returns the counts, the paths hit
and the Authorization headers seen. `python -m tests.support.judge_standin --port N
[--latency 0.1]` runs it as a process; `StandinThread` runs it inside a test process.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import re
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

import httptools

DIRECTIVE = re.compile(r"<<standin\s+([^>]*)>>")
HINT_MARKER = "[HINT_START]"
EXPERIENCE_MARKER = "[EXPERIENCE_START]"


def parse_directive(text: str) -> dict[str, str]:
    m = DIRECTIVE.search(text)
    if m is None:
        return {}
    out = {}
    for part in m.group(1).split(";"):
        key, sep, value = part.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    return out


def pick(values: str | None, i: int, default: str, sep: str = ",") -> str:
    if not values:
        return default
    items = values.split(sep)
    return items[min(i, len(items) - 1)].strip()


def vote_text(vote: str, hint: str | None = None) -> str:
    if vote == "x":
        return "I cannot tell what happened here; no verdict."
    if hint:
        return f"The reply shows what was missing. [HINT_START] {hint} [HINT_END]\n\\boxed{{{vote}}}"
    return f"At first glance \\boxed{{0}} seemed right, but the next state decides.\n\\boxed{{{vote}}}"


def lessons_text(lessons: str | None) -> str:
    if lessons == "x":
        return "Nothing to see here."
    lines = [f"- {lesson.strip()}" for lesson in (lessons or "").split("|") if lesson.strip()]
    return "Lessons:\n[EXPERIENCE_START]\n" + "\n".join(lines) + "\n[EXPERIENCE_END]"


@dataclass
class Standin:
    latency: float = 0.0
    calls: Counter[str] = field(default_factory=Counter)
    paths: Counter[str] = field(default_factory=Counter)
    auth: list[str] = field(default_factory=list)
    open_transports: set[asyncio.Transport] = field(default_factory=set)

    def answer(self, prompt: str) -> tuple[float, int, str]:
        """(delay, status, text) for the next call with this prompt."""
        kind = "experience" if EXPERIENCE_MARKER in prompt else "hint" if HINT_MARKER in prompt else "prm"
        key = kind + ":" + hashlib.sha1(prompt.encode()).hexdigest()[:16]
        i = self.calls[key]
        self.calls[key] += 1
        d = parse_directive(prompt)
        delay = float(pick(d.get("delays"), i, str(self.latency)))
        if i < int(d.get("fail", "0")):
            return delay, int(d.get("status", "500")), ""
        if kind == "experience":
            return delay, 200, lessons_text(d.get("lessons"))
        if kind == "hint":
            vote = pick(d.get("hint_votes"), i, "-1")
            hint = pick(d.get("hints"), i, "", sep="|") if vote == "1" else ""
            return delay, 200, vote_text(vote, hint or None)
        return delay, 200, vote_text(pick(d.get("votes"), i, "1"))

    def stats(self) -> dict[str, Any]:
        return {"calls": dict(self.calls), "total": sum(self.calls.values()),
                "paths": dict(self.paths), "auth": self.auth[-20:]}


def _body(status: int, payload: Any) -> bytes:
    data = json.dumps(payload).encode()
    reason = {200: "OK", 404: "Not Found", 400: "Bad Request"}.get(status, "Error")
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n")
    return head.encode() + data


class _Conn(asyncio.Protocol):
    def __init__(self, standin: Standin) -> None:
        self.standin = standin
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.previous: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self.standin.open_transports.add(self.transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.headers, self.body = b"", {}, []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        path = self.url.decode().split("?")[0]
        body = b"".join(self.body)
        if b"authorization" in self.headers:
            self.standin.auth.append(self.headers[b"authorization"].decode())
        if path != "/stats":
            self.standin.paths[path] += 1
        self.previous = asyncio.get_running_loop().create_task(
            self.respond(method, path, body, self.previous)
        )

    async def respond(self, method: str, path: str, body: bytes, previous: asyncio.Task[None] | None) -> None:
        status = 404
        payload: Any = {"error": {"message": f"no route {method} {path}"}}
        delay = 0.0
        if method == "POST" and path in ("/v1/chat/completions", "/generate"):
            try:
                req = json.loads(body)
                chat = path.endswith("completions")
                prompt = ("\n".join(str(m.get("content", "")) for m in req["messages"])
                          if chat else str(req["text"]))
            except (ValueError, KeyError, TypeError, AttributeError):
                status, payload = 400, {"error": {"message": "bad request body"}}
            else:
                delay, status, text = self.standin.answer(prompt)
                if status != 200:
                    payload = {"error": {"message": "scripted failure"}}
                elif chat:
                    payload = {"id": "standin", "object": "chat.completion", "model": req.get("model"),
                               "choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant", "content": text}}]}
                else:
                    payload = {"text": text, "meta_info": {"finish_reason": {"type": "stop"}}}
        elif method == "GET" and path in ("/v1/models", "/health", "/stats"):
            status = 200
            payload = (self.standin.stats() if path == "/stats"
                       else {"object": "list", "data": [{"id": "standin", "object": "model"}]})
        if delay > 0:
            await asyncio.sleep(delay)
        if previous is not None:
            await previous
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_body(status, payload))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.standin.open_transports.discard(self.transport)
        self.transport = None


async def serve(standin: Standin, host: str, port: int) -> asyncio.Server:
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Conn(standin), host, port, backlog=8192)


class StandinThread:
    """The stand-in on its own event loop in a daemon thread: `with StandinThread(port) as s:`."""

    def __init__(self, port: int, host: str = "127.0.0.1", latency: float = 0.0) -> None:
        self.standin = Standin(latency=latency)
        self.host, self.port = host, port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="judge-standin")
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> StandinThread:
        self.thread.start()
        fut = asyncio.run_coroutine_threadsafe(serve(self.standin, self.host, self.port), self.loop)
        self.server = fut.result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            if self.server is not None:
                self.server.close()
            for transport in list(self.standin.open_transports):
                transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


async def _main(args: argparse.Namespace) -> None:
    server = await serve(Standin(latency=args.latency), args.host, args.port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--latency", type=float, default=0.0, help="default seconds before each answer")
    ns = p.parse_args()
    try:
        import uvloop

        uvloop.run(_main(ns))
    except ImportError:
        asyncio.run(_main(ns))


class StandinProcess:
    """The stand-in as a process of its own (`python -m tests.support.judge_standin`)."""

    def __init__(self, port: int, latency: float = 0.0) -> None:
        self.port = port
        self.latency = latency
        self.proc: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> StandinProcess:
        import subprocess
        import sys
        import time
        from pathlib import Path

        import httpx

        repo = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.judge_standin", "--port", str(self.port),
             "--latency", str(self.latency)], cwd=repo,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the stand-in judge exited ({self.proc.returncode})")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.__exit__()
        raise TimeoutError(f"the stand-in judge on :{self.port} did not answer within 30 s")

    def __exit__(self, *exc: object) -> None:
        import subprocess

        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
