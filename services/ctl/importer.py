"""`nextstate import FILE.jsonl | - | --watch DIR | --mock N [--continuous]`: feed
conversation records to the buffer.

Records are in the seeds' JSONL format (one object per line: `session_id`, `turns`
with `type` main/side, `prompt`, `response`, optional `next_state` and `trainable`;
see services/buffer/seeds.py). They go to the buffer's `POST /receive` in chunks,
with a progress line per chunk; the buffer tokenizes them and publishes `Turn`s on
`turns` for the judges. A chunk the buffer cannot take right now (503: Redis or the
`turns` stream full) is retried with backoff — turn ids are derived from the content,
so a retried chunk imports nothing twice (sending: services/ctl/import_send.py). A
malformed line or record stops the import and names its line.

`/receive` needs the stack's internal token: `NEXTSTATE_INTERNAL__TOKEN`, else, for a buffer
on this machine, the one the running `nextstate up` recorded in its secrets.json
(services/ctl/stacks.py); a 401 says what to set.

`--mock N` generates N synthetic conversations (1–5 main turns, some side turns,
positive and negative next states, some final turns without one) to exercise the
pipeline without an agent; with `--continuous`, an endless stream of them, N per request
at `--rate R` conversations a second (default 1), each session id new (`mock-<nonce>-<k>`),
until SIGTERM or Ctrl-C (exit 0, with the totals). Progress lines never print conversation
text.

`--watch DIR` follows a directory of `.jsonl` files as they appear and grow, each line
once across restarts, bad lines to dead letters: services/ctl/import_watch.py.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx

from services.ctl.import_send import (
    DEFAULT_URL,
    URL_ENV,
    Stopped,
    buffer_url,
    internal_token,
    send_chunk,
    stop_on_signals,
)
from services.ctl.import_watch import add_watch_arguments, run_watch
from shared.auth import bearer
from shared.errors import NextstateError


def register(sub: Any) -> None:
    p = sub.add_parser("import", help="send conversation records (seeds JSONL) to the buffer")
    add_arguments(p)
    p.set_defaults(func=run_import)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", help="JSONL file, one record per line ('-': stdin)")
    p.add_argument("--mock", type=int, metavar="N", help="send N synthetic conversations instead")
    p.add_argument("--continuous", action="store_true",
                   help="with --mock N: keep sending, N conversations per request, until stopped")
    p.add_argument("--rate", type=float, metavar="R",
                   help="with --continuous: conversations per second (default 1)")
    p.add_argument("--seed", type=int, default=0, help="random seed for --mock (default 0)")
    p.add_argument("--url", default=None,
                   help=f"the buffer's base URL (${URL_ENV}, else the running `nextstate up`'s, "
                        f"else {DEFAULT_URL})")
    p.add_argument("--chunk", type=int, default=100, help="records per request (default 100)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request (default 60)")
    p.add_argument("--retries", type=int, default=8, help="tries per chunk on 503 or no answer")
    add_watch_arguments(p)


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


def mock_records(n: int | None, seed: int = 0, prefix: str | None = None) -> Iterator[dict[str, Any]]:
    """N synthetic sessions (endless when `n` is None): varied length, side turns,
    positive/negative/no next state. Session ids `<prefix>-<i>` (default `mock-<seed>`)."""
    rng = random.Random(seed)
    prefix = prefix or f"mock-{seed}"
    i = 0
    while n is None or i < n:
        yield {"session_id": f"{prefix}-{i}", "turns": _mock_turns(rng)}
        i += 1


def _mock_turns(rng: random.Random) -> list[dict[str, Any]]:
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
    return turns


def paced(items: Iterable[list[tuple[int, Any]]], rate: float, stop: threading.Event) -> Iterator[list[tuple[int, Any]]]:
    """Chunks no faster than `rate` records a second in all (a chunk waits for its turn);
    ends when `stop` is set."""
    due = time.monotonic()
    for chunk in items:
        if stop.wait(max(0.0, due - time.monotonic())):
            return
        yield chunk
        due = max(due, time.monotonic() - 1.0) + len(chunk) / rate  # no burst after a stall


def chunks(items: Iterable[tuple[int, Any]], size: int) -> Iterator[list[tuple[int, Any]]]:
    chunk: list[tuple[int, Any]] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def check_arguments(args: argparse.Namespace) -> None:
    sources = [x for x in (args.file, args.mock, args.watch) if x is not None]
    if len(sources) != 1:
        raise NextstateError("give a JSONL file, --watch DIR or --mock N (one of the three)")
    if args.chunk < 1:
        raise NextstateError("--chunk must be at least 1")
    if args.continuous and args.mock is None:
        raise NextstateError("--continuous goes with --mock N (N conversations per request)")
    if args.rate is not None and not args.continuous:
        raise NextstateError("--rate goes with --mock N --continuous")
    if args.rate is not None and args.rate <= 0:
        raise NextstateError("--rate must be more than 0 conversations a second")
    if args.mock is not None and args.mock < 1:
        raise NextstateError("--mock N needs N of at least 1")


def run_import(args: argparse.Namespace) -> int:
    check_arguments(args)
    if args.watch is not None:
        return run_watch(args)
    url = buffer_url(args)
    totals = {"records": 0, "published": 0, "side": 0, "untrainable": 0}
    handle = None
    stop: threading.Event | None = None
    if args.mock is not None and args.continuous:
        stop = stop_on_signals()
        prefix = f"mock-{int(time.time()):x}{secrets.token_hex(3)}"
        items: Iterable[tuple[int, Any]] = enumerate(mock_records(None, args.seed, prefix), start=1)
        where = "records"
        print(f"nextstate import: {args.mock} conversations per request at {args.rate or 1.0:g}/s, "
              f"sessions {prefix}-*, until stopped", file=sys.stderr)
    elif args.mock is not None:
        items = enumerate(mock_records(args.mock, args.seed), start=1)
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
        size = args.mock if stop is not None else args.chunk
        batches = chunks(items, size)
        if stop is not None:
            batches = paced(batches, args.rate or 1.0, stop)
        with httpx.Client(timeout=args.timeout, headers=bearer(internal_token(url))) as client:
            for chunk in batches:
                try:
                    result = send_chunk(client, url, chunk, args.retries, where, stop)
                except Stopped:
                    break
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
