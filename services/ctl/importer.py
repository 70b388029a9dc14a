"""`nextstate import FILE.jsonl | --mock N`: feed conversation records to the buffer.

Records are in the seeds' JSONL format (one object per line: `session_id`, `turns`
with `type` main/side, `prompt`, `response`, optional `next_state` and `trainable`;
see services/buffer/seeds.py). They go to the buffer's `POST /receive` in chunks,
with a progress line per chunk; the buffer tokenizes them and publishes `Turn`s on
`turns` for the judges. A chunk the buffer cannot take right now (503: Redis or the
`turns` stream full) is retried with backoff — turn ids are derived from the content,
so a retried chunk imports nothing twice. A malformed line or record stops the import
and names its line.

`/receive` needs the stack's internal token: `NEXTSTATE_INTERNAL__TOKEN`, else, for a buffer
on this machine, the one the running `nextstate up` recorded in its secrets.json
(services/ctl/stacks.py); a 401 says what to set.

`--mock N` generates N synthetic conversations (1–5 main turns, some side turns,
positive and negative next states, some final turns without one) to exercise the
pipeline without an agent. Progress lines never print conversation text.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from services.ctl.stacks import endpoint, find_stack
from shared.auth import bearer
from shared.errors import NextstateError
from shared.settings import Settings, load_settings

DEFAULT_URL = "http://127.0.0.1:8200"
URL_ENV = "NEXTSTATE_BUFFER_URL"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def register(sub: Any) -> None:
    p = sub.add_parser("import", help="send conversation records (seeds JSONL) to the buffer")
    add_arguments(p)
    p.set_defaults(func=run_import)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", help="JSONL file, one record per line ('-': stdin)")
    p.add_argument("--mock", type=int, metavar="N", help="send N synthetic conversations instead")
    p.add_argument("--seed", type=int, default=0, help="random seed for --mock (default 0)")
    p.add_argument("--url", default=None,
                   help=f"the buffer's base URL (${URL_ENV}, else the running `nextstate up`'s, "
                        f"else {DEFAULT_URL})")
    p.add_argument("--chunk", type=int, default=100, help="records per request (default 100)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request (default 60)")
    p.add_argument("--retries", type=int, default=8, help="tries per chunk on 503 or no answer")


# -- sources ------------------------------------------------------------------------------
def read_jsonl(lines: Iterable[str]) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for each non-blank line; a bad line raises, naming it."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except ValueError as exc:
            raise NextstateError(f"line {number} is not JSON: {exc}") from None


_TASKS = ["write a function", "fix the failing test", "summarize the file", "rename the variable",
          "find the weather in paris", "book a table", "translate the sentence", "sort the list"]
_ANSWERS = ["Here is the change.", "Done: I updated the code.", "The result is 42.",
            "I called the tool and got the answer.", "Sure, see below."]
_GOOD = ["thanks, perfect", "great, that works", "yes, now do the next one", "tool result: ok"]
_BAD = ["that's wrong, try again", "no, I asked for something else", "error: file not found",
        "it still fails, please fix it"]


def mock_records(n: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    """N synthetic sessions: varied length, side turns, positive/negative/no next state."""
    rng = random.Random(seed)
    for i in range(n):
        turns: list[dict[str, Any]] = []
        mains = rng.randint(1, 5)
        for j in range(mains):
            if rng.random() < 0.2:
                turns.append({"type": "side", "prompt": "title this chat", "response": "Chat"})
            turn: dict[str, Any] = {
                "type": "main",
                "prompt": f"{rng.choice(_TASKS)} ({j + 1})",
                "response": " ".join(rng.choice(_ANSWERS) for _ in range(rng.randint(1, 4))),
            }
            last = j == mains - 1
            if not last or rng.random() < 0.5:
                turn["next_state"] = rng.choice(_GOOD if rng.random() < 0.5 else _BAD)
            turns.append(turn)
        yield {"session_id": f"mock-{seed}-{i}", "turns": turns}


def chunks(items: Iterable[tuple[int, Any]], size: int) -> Iterator[list[tuple[int, Any]]]:
    chunk: list[tuple[int, Any]] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# -- sending ---------------------------------------------------------------------------------
def send_chunk(client: httpx.Client, url: str, chunk: list[tuple[int, Any]], retries: int,
               where: str) -> dict[str, Any]:
    body = [record for _, record in chunk]
    delay = 0.5
    for attempt in range(1, retries + 1):
        try:
            resp = client.post(f"{url}/receive", json=body)
        except httpx.HTTPError as exc:
            problem = f"no answer from {url} ({type(exc).__name__}: {exc})"
        else:
            if resp.status_code == 200:
                out: dict[str, Any] = resp.json()
                return out
            message = _message(resp)
            if resp.status_code == 401:
                raise NextstateError(
                    f"the buffer at {url} refused the credential (HTTP 401): {message}. Set "
                    "NEXTSTATE_INTERNAL__TOKEN to the stack's internal token (`nextstate up` keeps "
                    "it in <home>/up/<run>/secrets.json)")
            if resp.status_code != 503:
                lines = f"{where} {chunk[0][0]}-{chunk[-1][0]}"
                raise NextstateError(f"the buffer refused {lines} (HTTP {resp.status_code}): {message}")
            problem = message
        if attempt == retries:
            raise NextstateError(f"giving up after {retries} tries: {problem}")
        print(f"nextstate import: {problem}; retrying in {delay:.1f}s", file=sys.stderr)
        time.sleep(delay)
        delay = min(delay * 2, 10.0)
    raise AssertionError("unreachable")


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


def internal_token(url: str) -> str | None:
    """NEXTSTATE_INTERNAL__TOKEN, else (for a buffer on this machine) the token the
    running `nextstate up` recorded; a remote buffer never gets a local stack's token."""
    token = load_settings(Settings).internal.secret()
    if token is None and urlsplit(url).hostname in LOOPBACK and (stack := find_stack()) is not None:
        token = stack.secrets.get("internal_token") or None
    return token


def run_import(args: argparse.Namespace) -> int:
    if (args.file is None) == (args.mock is None):
        raise NextstateError("give a JSONL file or --mock N (one of the two)")
    if args.chunk < 1:
        raise NextstateError("--chunk must be at least 1")
    url = endpoint(args.url, URL_ENV, "buffer", DEFAULT_URL).rstrip("/")
    totals = {"records": 0, "published": 0, "side": 0, "untrainable": 0}
    handle = None
    if args.mock is not None:
        items: Iterable[tuple[int, Any]] = enumerate(mock_records(args.mock, args.seed), start=1)
        where = "records"
    elif args.file == "-":
        items, where = read_jsonl(sys.stdin), "lines"
    else:
        path = Path(args.file)
        try:
            handle = path.open(encoding="utf-8")
        except OSError as exc:
            raise NextstateError(f"cannot read {path}: {exc.strerror}") from None
        items, where = read_jsonl(handle), "lines"
    try:
        with httpx.Client(timeout=args.timeout, headers=bearer(internal_token(url))) as client:
            for chunk in chunks(items, args.chunk):
                result = send_chunk(client, url, chunk, args.retries, where)
                for k in totals:
                    totals[k] += int(result.get(k, 0))
                print(f"records {totals['records']}  turns published {totals['published']}  "
                      f"side {totals['side']}  untrainable {totals['untrainable']}", flush=True)
    finally:
        if handle is not None:
            handle.close()
    print(f"imported {totals['records']} records: {totals['published']} turns published to "
          f"turns, {totals['side']} side and {totals['untrainable']} untrainable turns skipped")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m services.ctl.importer …`: the same command without the `nextstate` wrapper."""
    parser = argparse.ArgumentParser(prog="nextstate import", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_import(args)
    except NextstateError as exc:
        print(f"nextstate: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
