"""`nextstate demo`: a simulated user with a clear success criterion, to watch learning happen.

The user runs short sessions through the collector with the official `openai` client:
it asks, reads the answer, and replies with natural praise when the answer meets the
task's criterion or a correction when it does not — that reply is the answer's next
state, which the judge scores. The last reply of a session goes out with
`X-Session-Done: 1`. The display shows the success rate overall, over the recent
window, and per policy version (from the `X-Policy-Version` response header), so the
trend is visible as the trainer publishes and the watcher reloads. At the end, each
version's line carries what the evaluator measured for it (`nextstate eval show`): the
suites' scores and the gate's decision, when the stack evaluates versions.

Tasks (shared/demo_tasks.py, which the evaluator's `demo` suite also scores):
  short   answer in at most 12 words (learnable by an instruct model: SmolLM2 rambles)
  vowel   the answer starts with a vowel (for tiny random test models)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from services.ctl.stacks import endpoint
from shared.demo_tasks import QUESTIONS, TASKS, Task

PRAISE = ["Perfect, thanks!", "Great, that's exactly what I needed, thanks.", "Thank you, perfect.",
          "Looks good, thanks!"]


@dataclass
class Tally:
    started: float = field(default_factory=time.monotonic)
    turns: int = 0
    ok: int = 0
    errors: int = 0
    recent: deque[bool] = field(default_factory=lambda: deque(maxlen=50))
    by_version: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    version: str = "?"

    def add(self, version: str, ok: bool) -> None:
        self.turns += 1
        self.ok += ok
        self.recent.append(ok)
        self.version = version
        v = self.by_version[version]
        v[0] += 1
        v[1] += ok

    def summary(self) -> dict[str, Any]:
        def key(v: str) -> tuple[int, str]:
            return (int(v), v) if v.isdigit() else (-1, v)

        return {
            "turns": self.turns,
            "success_rate": round(self.ok / self.turns, 3) if self.turns else None,
            "errors": self.errors,
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "by_version": [
                {"version": v, "turns": n, "success_rate": round(k / n, 3)}
                for v, (n, k) in sorted(self.by_version.items(), key=lambda kv: key(kv[0]))
            ],
        }

    def line(self) -> str:
        rate = self.ok / self.turns if self.turns else 0.0
        recent = sum(self.recent) / len(self.recent) if self.recent else 0.0
        bar = "#" * round(recent * 20)
        return (f"{time.monotonic() - self.started:6.0f}s  turns {self.turns:5d}  success {rate:5.1%}  "
                f"last {len(self.recent):2d}: {recent:5.1%} |{bar:<20}|  policy v{self.version}")


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="drive the collector with a simulated user and show the reward trend")
    p.add_argument("--url", default=None, help="the OpenAI base URL (NEXTSTATE_DEMO_URL, else the running "
                                                 "`nextstate up`'s collector, else http://127.0.0.1:8000/v1)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "local"))
    p.add_argument("--model", default="policy", help="model name sent to the collector")
    p.add_argument("--task", choices=sorted(TASKS), default="short")
    p.add_argument("--turns", type=int, default=0, help="stop after this many answers (0: until --minutes)")
    p.add_argument("--minutes", type=float, default=10.0, help="stop after this long")
    p.add_argument("--concurrency", type=int, default=4, help="sessions at once")
    p.add_argument("--session-turns", type=int, default=3, help="questions per session")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the final summary as JSON")
    p.add_argument("--no-eval", action="store_true",
                   help="do not read the evaluations from the stack for the summary")
    p.set_defaults(func=lambda a: asyncio.run(demo(a)))


async def session(client: Any, args: argparse.Namespace, task: Task, tally: Tally, rng: random.Random,
                  deadline: float) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": task.system},
                                      {"role": "user", "content": rng.choice(QUESTIONS)}]
    for i in range(args.session_turns):
        last = i == args.session_turns - 1
        raw = await client.chat.completions.with_raw_response.create(
            model=args.model, messages=messages, max_tokens=args.max_tokens,
            temperature=args.temperature,
        )
        completion = raw.parse()
        answer = completion.choices[0].message.content or ""
        ok = task.ok(answer)
        tally.add(raw.headers.get("x-policy-version", "?"), ok)
        feedback = rng.choice(PRAISE) if ok else task.correction
        messages.append({"role": "assistant", "content": answer})
        if last or time.monotonic() > deadline or (args.turns and tally.turns >= args.turns):
            # The feedback to the last answer closes the session (its own reply is not needed).
            messages.append({"role": "user", "content": feedback})
            await client.chat.completions.create(
                model=args.model, messages=messages, max_tokens=1,
                extra_headers={"X-Session-Done": "1"},
            )
            return
        messages.append({"role": "user", "content": f"{feedback} Next: {rng.choice(QUESTIONS)}"})


async def demo(args: argparse.Namespace) -> int:
    from openai import AsyncOpenAI, OpenAIError

    task = TASKS[args.task]
    tally = Tally()
    deadline = time.monotonic() + args.minutes * 60
    args.url = endpoint(args.url, "NEXTSTATE_DEMO_URL", "collector", "http://127.0.0.1:8000/v1", "/v1")
    client = AsyncOpenAI(base_url=args.url, api_key=args.api_key, timeout=120.0, max_retries=1)
    rng = random.Random(args.seed)
    stop = asyncio.Event()

    def done() -> bool:
        return stop.is_set() or time.monotonic() > deadline or bool(args.turns and tally.turns >= args.turns)

    async def worker(n: int) -> None:
        local = random.Random(rng.random() + n)
        while not done():
            try:
                await session(client, args, task, tally, local, deadline)
            except OpenAIError as exc:
                tally.errors += 1
                print(f"request failed: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
                await asyncio.sleep(1.0)

    async def display() -> None:
        while not done():
            await asyncio.sleep(5.0)
            print(tally.line(), flush=True)

    if not args.json:
        print(f"demo task '{task.name}' against {args.url}: {args.concurrency} simulated users; Ctrl-C stops")
    workers = [asyncio.create_task(worker(i)) for i in range(args.concurrency)]
    shower = asyncio.create_task(display()) if not args.json else None
    try:
        await asyncio.gather(*workers)
    except (KeyboardInterrupt, asyncio.CancelledError):
        stop.set()
    finally:
        if shower:
            shower.cancel()
        await client.close()
    summary = summary_of(tally, task)
    if not args.no_eval:
        attach_evaluations(summary, await evaluations())
    if args.json:
        print(json.dumps(summary))
    else:
        print(tally.line())
        print("success by policy version (evaluation: suite scores, gate decision):")
        for row in summary["by_version"]:
            bar = "#" * round(row["success_rate"] * 40)
            print(f"  v{row['version']:>4}  {row['turns']:5d} turns  {row['success_rate']:6.1%} |{bar:<40}|"
                  f"  {eval_text(row.get('eval'))}")
    return 0


def summary_of(tally: Tally, task: Task) -> dict[str, Any]:
    out = tally.summary()
    out["task"] = task.name
    return out


async def evaluations() -> dict[int, dict[str, Any]]:
    """Per version, what `nextstate eval show` knows about it; {} when the stack cannot be read
    (no stack found, no evaluations, Redis not answering: the demo's own figures still stand)."""
    from services.ctl.common import settings_from
    from services.ctl.eval_records import gather

    try:
        settings = settings_from(argparse.Namespace(), announce=False)
        data = await asyncio.wait_for(gather(settings, settings.run, quiet=True), timeout=15.0)
    except Exception as exc:  # the summary is best-effort: say why and go on
        print(f"nextstate: evaluations not read ({type(exc).__name__}: {str(exc)[:160]})", file=sys.stderr)
        return {}
    return {int(row["version"]): row for row in data["versions"]}


def attach_evaluations(summary: dict[str, Any], evals: dict[int, dict[str, Any]]) -> None:
    for row in summary["by_version"]:
        found = evals.get(int(row["version"])) if str(row["version"]).isdigit() else None
        if found is not None:
            row["eval"] = {"decision": found.get("decision"),
                           "suites": {name: s.get("score") for name, s in found["suites"].items()}}


def eval_text(ev: dict[str, Any] | None) -> str:
    if not ev:
        return ""
    scores = " ".join(f"{name} {'-' if score is None else f'{score:.3g}'}"
                      for name, score in sorted(ev["suites"].items()))
    return f"{scores}  {ev.get('decision') or ''}".strip()

