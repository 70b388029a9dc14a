"""What the collector's edge checks cost per request, against parsing the same body.

On the real agents' recorded requests (tests/data/agents: OpenClaw on three APIs, the
Codex CLI, Claude Code; 40-100 KB each), in one process, one core: the body's JSON and
schema validation (the baseline, which every request pays already), the 64-bit integer
check (request.check_integers: one pass over the bytes), and the whole request build
(validation, semantics, tools: namespace flattening and built-in tools left out, the
conversation). Ratios are against the baseline of the same run.

    python bench/edge_checks.py [--repeat 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.collector.anthropic_request import build_messages_call, parse_messages
from services.collector.request import build_call, check_integers, parse_body
from services.collector.responses_request import build_responses_call, parse_responses
from services.collector.settings import CollectorConfig

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "agents"
RECORDINGS = ("openclaw-openai-completions", "openclaw-openai-responses", "openclaw-anthropic-messages",
              "codex", "claude")  # fmt: skip


def best(fn: Callable[[], Any], repeat: int) -> float:
    """The median of `repeat` timings of fn, in µs (the median: robust to a shared host)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def steps(path: str, body: bytes, cfg: CollectorConfig) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(parse the body, build the whole call) for the API at `path`."""
    if path.endswith("/chat/completions"):
        return partial(parse_body, body), lambda: build_call(parse_body(body), {}, cfg)
    if path.endswith("/responses"):
        return (partial(parse_responses, body),
                lambda: build_responses_call(parse_responses(body), None, {}, cfg))  # fmt: skip
    return partial(parse_messages, body), lambda: build_messages_call(parse_messages(body), {}, cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=200)
    args = p.parse_args()
    cfg = CollectorConfig()
    print(f"{'request':<34} {'bytes':>7} {'parse µs':>9} {'int check µs':>13} {'ratio':>6} {'build µs':>9}")
    for name in RECORDINGS:
        with (DATA / f"{name}.jsonl").open() as f:
            req = json.loads(f.readline())
        body = json.dumps(req["body"]).encode()
        parse, build = steps(req["path"].split("?")[0], body, cfg)
        base = best(parse, args.repeat)
        check = best(partial(check_integers, body), args.repeat)
        whole = best(build, args.repeat)
        print(f"{name:<34} {len(body):>7} {base:>9.0f} {check:>13.1f} {check / base:>6.3f} {whole:>9.0f}")


if __name__ == "__main__":
    main()
