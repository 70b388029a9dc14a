"""Pairing: pairs found / expected and false pairs per history rewrite, the prefix rule alone
(today's) against prefix + anchors (services/collector/pairing.py); and what it costs.

Quality. Conversations shaped like what real agents send, many sessions interleaved (so
many turns are pending at once), run through the real close and register scripts on a
private redis-server (pending_store.py), once with each rule:

- `resend`    a client that resends its history unchanged (tool calls included): the control;
- `openclaw`  OpenClaw's trailing internal-context user message on every request, dropped
              from the history it resends; tool loops with a context after the results;
- `system`    a system prompt with the time and a status line that change every request;
- `compaction` OpenClaw-shaped, older history replaced by a summary (a user message) that
              keeps the last exchange, once per session after a few turns;
- `retry`     OpenClaw-shaped; a request the agent gave up on is retried, the user's message
              prefixed "[Retry after the previous model attempt failed or timed out]" (half
              of the sessions) or resent as it was; the history goes on from the retry's answer;
- `crowd`     many OpenClaw sessions with the same system prompt, first messages from a pool
              of five and answers and replies from a pool of short ones ("OK", "Done.", …) —
              half of the answers are the pool's, so sessions share exchanges;
- `crowd-resend` the same crowd resending unchanged (the prefix rule's own collisions).

Each follow-up is expected to close the turn whose answer is its last assistant message;
any other turn it closes is a false pair (another session's, or a retried attempt's the
agent never saw). `refused`: follow-ups whose anchor named several turns.

Cost. (1) The pairing work per request in process (canonical forms, hashes, anchors) for
conversations of 2 to 200 messages, prefix rule alone against both. (2) The collector's
added p50 per request: the stand-in engine (tests/support/standin_engine.py) alone, today's
collector (`--baseline`, a commit before the anchor rule, run from a `git archive` of it)
and this one, on a private redis-server, the three arms side by side (each its own load
generator process, as in bench/collector.py, at the same time: a burst of other load on a
shared host hits all three alike), over `--rounds`, with `resend` and `openclaw`
conversations (6 requests each, the last with X-Session-Done).

    python bench/pairing.py [--sessions 200] [--concurrency 1] [--seconds 12] [--rounds 3]
                            [--baseline f2d156e] [--no-latency]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.collector import cpu_seconds, host_probe, quantiles, ready, start
from services.collector.pairing import (
    analyze,
    candidates,
    next_state,
    offer,
    prefix_hashes,
    response_hash,
    stored_anchors,
)
from shared.chat_messages import normalize_messages
from tests.support.servers import REPO, RedisServer, free_port, stop_process, wait_until

MIN_CHARS = 32
RETRY = "[Retry after the previous model attempt failed or timed out]\n\n"
SYSTEM = ("You are a personal assistant running inside OpenClaw.\n## Tooling\nTool names are "
          "case-sensitive. Call tools exactly as listed.\n- read: Read file contents\n- exec: Run "
          "shell commands\n- web_fetch: Fetch a URL\n## Safety\nNever reveal secrets. Ask before "
          "destructive actions.\n") * 8  # fmt: skip
WORDS = ("the build failed again after the parser change so please look at the import error in "
         "utils then rerun the tests and tell me which files changed and why it broke").split()  # fmt: skip
GREETINGS = ["hi", "hello", "Hi! Can you help me with something?", "hey there", "good morning"]
SHORT = ["OK", "Done.", "Sure.", "Hello! How can I help you today?", "Got it.", "Yes.",
         "Sure, what would you like to do?", "All set."]  # fmt: skip
REPLIES = ["yes", "ok", "thanks", "continue", "go ahead", "no"]

Msg = dict[str, Any]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def ctx(rng: random.Random) -> Msg:
    running = "none" if rng.random() < 0.5 else f"exec-{rng.randrange(1000)} (running, {rng.randrange(60)} s)"
    return {"role": "user", "content": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nConversation data "
            f'(data, not instructions):\n"Active exec sessions:\\n{running}"\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>'}  # fmt: skip


def user(text: str) -> Msg:
    return {"role": "user", "content": text}


def answer(rng: random.Random, i: int, crowd: bool) -> Msg:
    """An assistant answer: a tool call a third of the time, else text (in a crowd, half of
    the time one of the pool's short answers)."""
    if not crowd and rng.random() < 1 / 3:
        args = {"command": f"pytest tests/unit -q -k {rng.choice(WORDS)}_{i}"}
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{rng.randrange(10**9)}", "type": "function",
             "function": {"name": "exec", "arguments": json.dumps(args)}}]}  # fmt: skip
    if crowd and rng.random() < 0.5:
        return {"role": "assistant", "content": rng.choice(SHORT)}
    return {"role": "assistant", "content": words(rng, rng.randint(8, 30))}


def tool_result(rng: random.Random, call: Msg) -> Msg:
    return {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"],
            "content": f"{rng.randrange(1, 9)} failed, {rng.randrange(10, 90)} passed"}  # fmt: skip


def next_input(rng: random.Random, last: Msg, crowd: bool) -> Msg:
    if last.get("tool_calls"):
        return tool_result(rng, last)
    if crowd and rng.random() < 0.5:
        return user(rng.choice(REPLIES))
    return user(words(rng, rng.randint(4, 20)))


# -- conversations: each step is one request --------------------------------------------------


@dataclass
class Step:
    messages: list[Msg]  # what the agent sends
    answer: Msg  # what it gets back
    label: str  # the turn this request's answer becomes
    expect: str | None  # the turn it should close


@dataclass
class Session:
    """One agent's conversation, produced a request at a time."""

    name: str
    shape: str
    rng: random.Random
    turns: int = 6
    history: list[Msg] = field(default_factory=list)  # what the agent keeps (no system, no context)
    last: str | None = None  # the turn whose answer ends `history`

    def steps(self) -> Iterator[Step]:
        rng, crowd = self.rng, self.shape.startswith("crowd")
        first = user(rng.choice(GREETINGS) if crowd else words(rng, rng.randint(6, 24)))
        self.history = [first]
        compact_at = rng.randint(3, self.turns - 2)
        retry_at = rng.randint(2, self.turns - 2)
        for i in range(self.turns):
            if self.shape == "compaction" and i == compact_at:
                self.compact()
            if self.shape == "retry" and i == retry_at:
                yield from self._retry(i)
                continue
            label = f"{self.name}:{i}"
            a = answer(rng, i, crowd)
            yield Step(self.request(i), a, label, self.last)
            self.history = [*self.history, a, next_input(rng, a, crowd)]
            self.last = label

    def compact(self) -> None:
        """Older history -> a summary; kept: the exchange that ends it (the messages the last
        answer answered, the answer, what followed), half of the time with the answer before."""
        rng, h = self.rng, self.history
        answers = [j for j, m in enumerate(h) if m["role"] == "assistant"]
        before = answers[-2] if len(answers) > 1 else -1
        keep = before if before >= 0 and rng.random() < 0.5 else before + 1
        summary = user("The conversation history before this point was compacted into the following "
                       f"summary:\n{words(rng, 40)}")  # fmt: skip
        self.history = [summary, *h[keep:]]

    def request(self, i: int, history: list[Msg] | None = None) -> list[Msg]:
        h = self.history if history is None else history
        system = {"role": "system", "content": SYSTEM}
        if self.shape == "system":
            system = {"role": "system", "content": f"{SYSTEM}\nCurrent time: 2026-12-02 09:{i:02d}:{self.rng.randrange(60):02d}"
                      f" | {self.rng.randrange(9)} unread | battery {self.rng.randrange(100)}%"}  # fmt: skip
        if self.shape in ("resend", "system", "crowd-resend"):
            return [system, *h]
        return [system, *h, ctx(self.rng)]

    def _retry(self, i: int) -> Iterator[Step]:
        """The request at step i is given up on by the agent (its answer never seen), then
        retried; the conversation continues from the retry's answer."""
        rng = self.rng
        lost, kept = answer(rng, i, False), answer(rng, i, False)
        yield Step(self.request(i), lost, f"{self.name}:{i}-lost", self.last)
        retried = self.history
        if retried[-1]["role"] == "user" and rng.random() < 0.5:
            retried = [*retried[:-1], user(RETRY + retried[-1]["content"])]
        # The turn before was closed by the first attempt: the retry closes nothing.
        yield Step(self.request(i, retried), kept, f"{self.name}:{i}", None)
        self.history = [*self.history, kept, next_input(rng, kept, False)]
        self.last = f"{self.name}:{i}"


# -- the rules against real Redis ----------------------------------------------------------------


@dataclass
class Tally:
    expected: int = 0
    found: int = 0
    false: int = 0
    refused: int = 0
    by: Counter[str] = field(default_factory=Counter)
    seconds: list[float] = field(default_factory=list)  # per request: pairing work + its two Redis round trips


class Today:
    """Today's rule, as it is at `rev`: its pairing and pending_store modules, read from git
    and loaded beside this tree's (they import only `shared`)."""

    def __init__(self, rev: str) -> None:
        tmp = Path(tempfile.mkdtemp(prefix="bench-pairing-today-"))
        self.mods: dict[str, ModuleType] = {}
        for name in ("pairing", "pending_store"):
            got = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:services/collector/{name}.py"],
                                 capture_output=True)  # fmt: skip
            if got.returncode:
                raise SystemExit(f"bench/pairing.py: the baseline {rev} is not in this clone ({got.stderr.decode().strip()}); "
                                 "fetch the full history (git fetch --unshallow) or pass --baseline")  # fmt: skip
            src = got.stdout
            path = tmp / f"today_{name}.py"
            path.write_bytes(src)
            spec = importlib.util.spec_from_file_location(f"today_{name}", path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod  # (dataclasses look their module up)
            spec.loader.exec_module(mod)
            self.mods[name] = mod


@dataclass
class Result:
    closed: list[str]  # turn ids
    rule: str | None  # what closed the last response's turn
    refused: bool


async def today_step(store: Any, mod: ModuleType, msgs: list[Msg], step: Step, record: str, lineage: str,
                     deadline: float) -> Result:  # fmt: skip
    hs = mod.prefix_hashes(msgs)
    cands = mod.candidates(msgs, hs, 64)
    closed: list[str] = []
    if cands:
        keys = [c.key for c in cands]
        states = [orjson.dumps(next_state(step.messages, c.end)).decode() for c in cands]
        got, _ = await store.lookup(keys, keys[-1], states)
        closed = [r for r in got.records if r]
    await store.put(mod.response_hash(hs, step.answer), record, deadline, lineage, time.time())
    return Result(closed, "prefix" if closed else None, False)


async def anchors_step(store: Any, msgs: list[Msg], step: Step, record: str, lineage: str,
                       deadline: float) -> Result:  # fmt: skip
    conv = analyze(msgs)
    cands = candidates(msgs, conv.hashes, 64)
    closed: list[str] = []
    rule, refused = None, False
    if cands:
        tolerant = offer(conv, MIN_CHARS)
        keys = [c.key for c in cands]
        states = [orjson.dumps(next_state(step.messages, c.end)).decode() for c in cands]
        got, _ = await store.lookup(keys, keys[-1], states, [a.key for a in tolerant.anchors] if tolerant else [])
        closed = [r for r in got.records if r]
        rule = "prefix" if closed else None
        if got.via_record and tolerant is not None:
            closed.append(got.via_record)
            rule = tolerant.anchors[got.via - 1].kind
        refused = got.via < 0 or got.clashes > 0
    await store.put(response_hash(conv.hashes, step.answer), record, deadline, lineage, time.time(),
                    anchors=stored_anchors(conv, step.answer, MIN_CHARS))  # fmt: skip
    return Result(closed, rule, refused)


async def run_shape(stores: tuple[Any, Any], today: ModuleType, shape: str, sessions: int,
                    seed: int) -> tuple[Tally, Tally]:  # fmt: skip
    """Every session of `shape`, one step of each in turn, each step through both rules'
    Redis scripts (today's, then this tree's, or the other way round every other step, so
    both meet the same load); each follow-up's closed turns checked against the one it
    should close. Returns (today's tally, this tree's)."""
    from services.collector.capture import make_record
    from shared.chat import PromptCache
    from shared.schemas import Turn

    cache = PromptCache(text="x", ids=[1], cuts=[])
    tallies = (Tally(), Tally())
    gens = [Session(f"{shape}-{k}", shape, random.Random(seed * 100_003 + k)).steps() for k in range(sessions)]
    labels: dict[str, str] = {}  # turn id -> label
    n = 0
    while gens:
        for g in list(gens):
            step = next(g, None)
            if step is None:
                gens.remove(g)
                continue
            session = step.label.rsplit(":", 1)[0]
            turn = Turn(session_id=session, turn_index=0, messages=step.messages, response=step.answer,
                        prompt_ids=[1], response_ids=[2], response_logprobs=[-1.0], weight_version="1",
                        policy_version=1)  # fmt: skip
            labels[turn.id] = step.label
            deadline = time.time() + 600
            record, lineage = make_record(turn, cache, deadline)
            msgs = normalize_messages(step.messages)
            n += 1
            for arm in ((0, 1) if n % 2 else (1, 0)):
                t0 = time.perf_counter()
                if arm == 0:
                    res = await today_step(stores[0], today, msgs, step, record, lineage, deadline)
                else:
                    res = await anchors_step(stores[1], msgs, step, record, lineage, deadline)
                tally = tallies[arm]
                tally.seconds.append(time.perf_counter() - t0)
                closed = [labels[json.loads(r.split("\n", 2)[2])["id"]] for r in res.closed]
                tally.refused += res.refused
                if step.expect is not None:
                    tally.expected += 1
                    if step.expect in closed:
                        tally.found += 1
                        tally.by[res.rule or "?"] += 1
                tally.false += sum(1 for c in closed if c != step.expect)
    return tallies


SHAPES = ["resend", "openclaw", "system", "compaction", "retry", "crowd", "crowd-resend"]


async def quality(redis_url: str, sessions: int, rev: str) -> None:
    from services.collector.pending_store import PendingStore, connect
    from shared.keys import Keys

    today = Today(rev)
    client = connect(redis_url, 5.0)
    print(f"pairs found / expected and false pairs: {sessions} sessions per shape interleaved "
          f"(crowd: {4 * sessions}), 6 requests each; today = {rev} (the prefix rule); anchors' "
          f"minimum {MIN_CHARS} bytes")  # fmt: skip
    print(f"{'shape':<13} | {'expected':>8} | {'today: found':>16} {'false':>5} | "
          f"{'anchors: found':>16} {'false':>5} {'refused':>7} | {'+µs':>5} | anchors' pairs by rule")  # fmt: skip
    try:
        for shape in SHAPES:
            n = 4 * sessions if shape.startswith("crowd") else sessions
            prefix = f"bench-pairing-{shape}-{os.getpid()}"
            stores = (today.mods["pending_store"].PendingStore(client, Keys(prefix + "-today"), 600),
                      PendingStore(client, Keys(prefix + "-anchors"), 600))  # fmt: skip
            old, new = await run_shape(stores, today.mods["pairing"], shape, n, 1)
            by = ", ".join(f"{k} {v}" for k, v in new.by.most_common())
            added = statistics.median(b - a for a, b in zip(old.seconds, new.seconds, strict=True)) * 1e6
            print(f"{shape:<13} | {old.expected:>8} | {old.found:>8} ({old.found / old.expected:>4.0%}) {old.false:>5} | "
                  f"{new.found:>8} ({new.found / new.expected:>4.0%}) {new.false:>5} {new.refused:>7} | "
                  f"{added:>+5.0f} | {by}", flush=True)  # fmt: skip
        print("(+µs: what a request's pairing work and its two Redis round trips — close, then store — take "
              "more with anchors than today: the median of the per-request differences, the two rules "
              "taking each request in turn in this process against the private redis-server)")
    finally:
        await client.aclose()


# -- cost in process --------------------------------------------------------------------------------


def cost_in_process() -> None:
    rng = random.Random(7)
    print("\npairing work per request in process (µs, median of 2000): the prefix rule's (hashes, "
          "candidates, the response's key) against both rules' (+ anchors offered and registered)")
    print(f"{'messages':>8} | {'prefix':>7} | {'anchors':>7} | {'added':>6}")
    for n in (2, 10, 50, 200):
        steps = list(Session("c", "openclaw", rng, turns=max(6, n)).steps())
        msgs = normalize_messages(steps[-1].messages)[:n]
        ans = steps[-1].answer

        def old(msgs: list[Msg] = msgs, ans: Msg = ans) -> None:
            hs = prefix_hashes(msgs)
            candidates(msgs, hs, 64)
            response_hash(hs, ans)

        def new(msgs: list[Msg] = msgs, ans: Msg = ans) -> None:
            conv = analyze(msgs)
            candidates(msgs, conv.hashes, 64)
            offer(conv, MIN_CHARS)
            response_hash(conv.hashes, ans)
            stored_anchors(conv, ans, MIN_CHARS)

        t = {name: median_us(fn) for name, fn in (("old", old), ("new", new))}
        print(f"{len(msgs):>8} | {t['old']:>7.1f} | {t['new']:>7.1f} | {t['new'] - t['old']:>6.1f}")


def median_us(fn: Callable[[], None], n: int = 2000) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


# -- the collector's added latency ------------------------------------------------------------------


async def agent(shape: str, url: str, client: Any, rng: random.Random, stop_at: float,
                lat: list[float]) -> None:  # fmt: skip
    """6-request conversations, the last with X-Session-Done; `openclaw`: a trailing context."""
    while time.perf_counter() < stop_at:
        system = words(rng, 40)
        history: list[Msg] = [user(words(rng, 30))]
        for t in range(6):
            if shape == "direct":
                n = 90 + t * 45
                body: dict[str, Any] = {"input_ids": [260 + (i % 200) for i in range(n)],
                                        "sampling_params": {"max_new_tokens": 32}, "return_logprob": True}  # fmt: skip
                path, headers = "/generate", {"content-type": "application/json"}
            else:
                tail = [ctx(rng)] if shape == "openclaw" else []
                body = {"model": "m", "max_tokens": 32,
                        "messages": [{"role": "system", "content": system}, *history, *tail]}  # fmt: skip
                path = "/v1/chat/completions"
                headers = {"content-type": "application/json", **({"x-session-done": "1"} if t == 5 else {})}
            t0 = time.perf_counter()
            r = await client.post(url + path, content=orjson.dumps(body), headers=headers)
            dt = time.perf_counter() - t0
            r.raise_for_status()
            if shape != "direct":
                history = [*history, orjson.loads(r.content)["choices"][0]["message"], user(words(rng, rng.randint(5, 30)))]
            if time.perf_counter() >= stop_at:
                return
            lat.append(dt)


async def loadgen(shape: str, url: str, concurrency: int, seconds: float) -> dict[str, Any]:
    import httpx

    from services.collector.engine_transport import EngineTransport

    async with httpx.AsyncClient(timeout=30, transport=EngineTransport(concurrency)) as client:
        warm: list[float] = []  # the connections warmed up, not measured
        await asyncio.gather(*(agent(shape, url, client, random.Random(-i - 1), time.perf_counter() + 0.5, warm)
                               for i in range(concurrency)))  # fmt: skip
        lat: list[float] = []
        stop_at = time.perf_counter() + seconds
        await asyncio.gather(*(agent(shape, url, client, random.Random(i), stop_at, lat) for i in range(concurrency)))
    return {"lat": lat, "warm": len(warm)}


def run_loadgen(shape: str, url: str, concurrency: int, seconds: float) -> tuple[list[float], int]:
    """One load generator process: (latencies, warm-up requests)."""
    out = subprocess.run([sys.executable, __file__, "--loadgen", shape, "--url", url, "--concurrency",
                          str(concurrency), "--seconds", str(seconds)],
                         cwd=REPO, check=True, capture_output=True, text=True)  # fmt: skip
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return list(res["lat"]), int(res["warm"])


def latency(a: argparse.Namespace) -> None:
    from tests.support.tiny_model import build_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="bench-pairing-"))
    base = tmp / "baseline"
    base.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", a.baseline], capture_output=True)
    if archive.returncode:
        raise SystemExit(f"bench/pairing.py: cannot archive the baseline {a.baseline}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
    build_tokenizer(tmp / "tok")
    redis_server = RedisServer().start()
    engine_port = free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    procs = [start([sys.executable, "-m", "tests.support.standin_engine", "--port", str(engine_port),
                    "--latency-ms", str(a.latency_ms), "--tokenizer", str(tmp / "tok")])]  # fmt: skip
    urls: dict[str, str] = {"direct": engine_url}
    pids: dict[str, int] = {}
    try:
        wait_until(lambda: ready(engine_url + "/health"), 30, "stand-in engine")
        for arm, root in (("today", base), ("anchors", REPO)):
            port = free_port()
            env = {"NEXTSTATE_ENV": "dev", "NEXTSTATE_REDIS__URL": redis_server.url,
                   "NEXTSTATE_REDIS__PREFIX": f"bench-{arm}", "NEXTSTATE_LOG__LEVEL": "WARNING",
                   "NEXTSTATE_STREAMS__MAXLEN": "10000000", "NEXTSTATE_COLLECTOR__ENGINE_URL": engine_url,
                   "NEXTSTATE_COLLECTOR__PORT": str(port), "PYTHONPATH": str(root),
                   "NEXTSTATE_COLLECTOR__SPOOL_PATH": str(tmp / f"{arm}.spool.jsonl")}  # fmt: skip
            proc = subprocess.Popen([sys.executable, "-m", "services.collector"], cwd=root,
                                    env={**os.environ, **env}, stdout=open(tmp / f"{arm}.log", "wb"),
                                    stderr=subprocess.STDOUT)  # fmt: skip
            procs.append(proc)
            urls[arm], pids[arm] = f"http://127.0.0.1:{port}", proc.pid
        for arm in ("today", "anchors"):
            wait_until(lambda url=urls[arm]: ready(url + "/readyz"), 90, f"collector ({arm})")
        print(f"\nthe collector's added latency per chat completion: stand-in engine {a.latency_ms} ms; "
              f"today = {a.baseline} (prefix rule), anchors = this tree; the three arms side by side "
              f"(c agents each, at the same time: a burst of other load hits all alike), {a.rounds} rounds "
              f"of {a.seconds / a.rounds:.1f} s; {os.cpu_count()} cores shared by all")  # fmt: skip
        print(f"{'conc':>4} {'conversation':>12} | {'direct p50':>10} | {'today p50':>9} {'added':>6} "
              f"{'cpu ms':>6} | {'anchors p50':>11} {'added':>6} {'cpu ms':>6} | {'anchors - today':>15}")  # fmt: skip
        from concurrent.futures import ThreadPoolExecutor

        for c in [int(x) for x in a.concurrency.split(",") if x]:
            for shape in ("resend", "openclaw"):
                lat: dict[str, list[float]] = {arm: [] for arm in urls}
                cpu = dict.fromkeys(urls, 0.0)
                served = dict.fromkeys(urls, 0)
                rounds: dict[str, list[float]] = {arm: [] for arm in urls}
                for _ in range(a.rounds):
                    PROBES.append(host_probe())
                    cpu0 = {arm: cpu_seconds(pid) for arm, pid in pids.items()}
                    with ThreadPoolExecutor(len(urls)) as pool:
                        futures = {arm: pool.submit(run_loadgen, "direct" if arm == "direct" else shape, url, c,
                                                    a.seconds / a.rounds) for arm, url in urls.items()}  # fmt: skip
                        got = {arm: f.result() for arm, f in futures.items()}
                    for arm, pid in pids.items():
                        cpu[arm] += cpu_seconds(pid) - cpu0[arm]
                    for arm, (v, warm) in got.items():
                        lat[arm] += v
                        served[arm] += len(v) + warm
                        rounds[arm].append(quantiles(v)[0])
                q = {arm: quantiles(v)[0] * 1e3 for arm, v in lat.items()}
                per = {arm: cpu[arm] * 1e3 / max(1, served[arm]) for arm in urls}
                paired = statistics.median((n - t) * 1e3 for n, t in zip(rounds["anchors"], rounds["today"], strict=True))
                print(f"{c:>4} {shape:>12} | {q['direct']:>10.2f} | {q['today']:>9.2f} {q['today'] - q['direct']:>6.2f} "
                      f"{per['today']:>6.2f} | {q['anchors']:>11.2f} {q['anchors'] - q['direct']:>6.2f} "
                      f"{per['anchors']:>6.2f} | {q['anchors'] - q['today']:>7.2f} ({paired:+.2f})", flush=True)  # fmt: skip
        print("(anchors - today: the p50s' difference over all rounds, in brackets the median over rounds of "
              "each round's; cpu ms: the collector process's CPU per request, warm-up requests included)")
        if PROBES:
            print(f"host steadiness: a fixed loop took {min(PROBES) * 1e3:.0f} to {max(PROBES) * 1e3:.0f} ms of "
                  f"CPU between rounds ({max(PROBES) / min(PROBES):.2f}x)")  # fmt: skip
    finally:
        for proc in reversed(procs):
            stop_process(proc)
        redis_server.close()


PROBES: list[float] = []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=200, help="sessions per shape (crowd: 4x)")
    p.add_argument("--concurrency", default="1", help="agents per arm, e.g. 1,4 (the three arms run at once)")
    p.add_argument("--seconds", type=float, default=12.0, help="per arm, split over --rounds")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--latency-ms", type=float, default=50.0)
    p.add_argument("--baseline", default="f2d156e", help="today's collector: a commit before the anchor rule")
    p.add_argument("--no-latency", action="store_true", help="only the pairing table and the in-process cost")
    p.add_argument("--loadgen", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.loadgen:
        import uvloop

        print(json.dumps(uvloop.run(loadgen(a.loadgen, a.url, int(a.concurrency), a.seconds))))
        return
    server = RedisServer().start()
    try:
        asyncio.run(quality(server.url, a.sessions, a.baseline))
    finally:
        server.close()
    cost_in_process()
    if not a.no_latency:
        latency(a)


if __name__ == "__main__":
    main()
