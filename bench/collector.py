"""The collector's own cost: client -> collector -> engine against client -> engine directly.

Both arms drive the same fixed-latency stand-in engine (tests/support/standin_engine.py,
SGLang's `/generate` over real HTTP), so the difference is what the proxy adds:
templating, tokenization, pairing and capture in Redis (on: a private redis-server),
response building. The load generator runs in its own process (the three processes
and Redis share this machine's cores) with one pooled httpx client and N concurrent
agents, each holding multi-turn conversations (`--turns` requests, the last one with
`X-Session-Done: 1`, so pending turns are stored, closed and emitted and prompts are
tokenized incrementally). The direct arm sends `/generate` with prompts of the same
lengths as token ids. For each concurrency: completions/s, latency p50/p99 per arm,
the added p50/p99, the turns the collector emitted per second, and the collector
process's CPU time per completion (robust to other load on the machine: 1000 / that
is what one core serves).

The stand-in answers after 50 ms by default (a short completion on a real engine): at
concurrency 1 and 16 the collector is not saturated, so the added latency is its own
cost; at 64 the offered load (~1,280/s) is more than one collector process serves on
this machine, so that row measures its throughput.

    python bench/collector.py [--concurrency 1,16,64] [--seconds 6] [--latency-ms 50]
                              [--apis 1,16] [--mixed 16] [--mixed-seconds 60]
                              [--profile out.prof [--profile-api responses]]
                              (--profile: cProfile of the collector at 16, driven by chat or the API named)

`--apis`: at these concurrencies the same conversations also go through the Responses API
(history resent as items, `store` at its default, true: the response and its conversation
written to Redis with the pending turn; and `resp/nostore`: store false) and the
Anthropic Messages API (content blocks), each against the stand-in alone and
against chat completions, the arms one after another, interleaved over `--rounds`, with
the collector's CPU per request, the load generator's (`client cpu`: building and parsing
each API's bodies, on the same cores) and Redis round trips per request (`redis rt/req`:
what Redis read, which no other load on the machine changes).

`--mixed 16` (the default): the four APIs side by side, 4 agents each (16 on the
collector) beside 4 on the stand-in alone, for `--mixed-seconds`. On a shared host the
same CPU work takes up to twice as long in bursts (the last line prints how much a fixed
loop varied between runs); arms run one after another each meet their own bursts, and
at concurrency 16, where the collector's event loop is busy, a burst moves p50 by
several ms. Side by side, every burst hits every API alike: that table is the
comparison of the APIs at 16; at 1 the sequential arms compare well.

Targets on this machine: added p50 <= 3 ms at concurrency 16; >= 500 captured
completions/s per collector process; each API's added p50/p99 within 1 ms of chat's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.servers import REPO, RedisServer, free_port, stop_process, wait_until

PROBES: list[float] = []  # host_probe() between runs
# --profile-api names -> load generator arms
ARMS = {"chat": "collector", "responses": "responses", "resp/nostore": "responses-nostore",
        "messages": "messages"}  # fmt: skip
WORDS = ("please look at the failing test in parser module and fix the import error then run "
         "the build again and tell me what changed in the output thanks").split()  # fmt: skip


# -- the load generator (a separate process) ------------------------------------------------


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def assistant_turn(api: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """What an agent of this API appends to its history from the answer (output items for
    responses, as the Agents SDK does; the content blocks for messages)."""
    if api.startswith("responses"):
        return list(body["output"])
    if api == "messages":
        return [{"role": "assistant", "content": body["content"]}]
    return [body["choices"][0]["message"]]


def request(api: str, system: str, history: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The API's path and body for a conversation (a system prompt, then `history`)."""
    if api.startswith("responses"):  # store at OpenAI's default (true), as the Agents SDK sends it
        store = {"store": False} if api == "responses-nostore" else {}
        return "/v1/responses", {"model": "m", "instructions": system, "input": history,
                                 "max_output_tokens": 32, **store}  # fmt: skip
    if api == "messages":
        return "/v1/messages", {"model": "m", "system": system, "messages": history, "max_tokens": 32}
    return "/v1/chat/completions", {"model": "m", "max_tokens": 32,
                                    "messages": [{"role": "system", "content": system}, *history]}  # fmt: skip


async def agent(arm: str, url: str, client: Any, rng: random.Random, turns: int,
                stop_at: float, lat: list[float], prefix_ids: list[int]) -> None:  # fmt: skip
    while time.perf_counter() < stop_at:
        system = words(rng, 40)
        history: list[dict[str, Any]] = [{"role": "user", "content": words(rng, 30)}]
        for t in range(turns):
            last = t == turns - 1
            if arm != "direct":
                path, body = request(arm, system, history)
                headers = {"content-type": "application/json", **({"x-session-done": "1"} if last else {})}
                t0 = time.perf_counter()
                r = await client.post(url + path, content=orjson.dumps(body), headers=headers)
                dt = time.perf_counter() - t0
                r.raise_for_status()
                history = [*history, *assistant_turn(arm, orjson.loads(r.content)),
                           {"role": "user", "content": words(rng, rng.randint(5, 30))}]  # fmt: skip
            else:
                n = 90 + t * 45  # about the collector's prompt length at this turn
                body = {"input_ids": (prefix_ids * (n // len(prefix_ids) + 1))[:n],
                        "sampling_params": {"max_new_tokens": 32, "temperature": 1.0},
                        "return_logprob": True, "stream": False}  # fmt: skip
                t0 = time.perf_counter()
                r = await client.post(url + "/generate", content=orjson.dumps(body),
                                      headers={"content-type": "application/json"})  # fmt: skip
                dt = time.perf_counter() - t0
                r.raise_for_status()
                orjson.loads(r.content)
            if time.perf_counter() < stop_at:
                lat.append(dt)
            else:
                return


async def loadgen(arm: str, url: str, concurrency: int, seconds: float, turns: int) -> dict[str, Any]:
    import httpx

    from services.collector.engine_transport import EngineTransport

    # httpx's default pool costs the client ~5 ms of CPU per request at 64 connections
    # (it scans and polls every pooled socket per request): the lean transport keeps the
    # load generator from being the bottleneck. The same client drives both arms.
    async with httpx.AsyncClient(timeout=30, transport=EngineTransport(concurrency)) as client:
        # Warm up the connections (not measured).
        warm: list[float] = []
        await asyncio.gather(*(agent(arm, url, client, random.Random(-i - 1), 2, time.perf_counter() + 0.5,
                                     warm, [260, 447, 274]) for i in range(concurrency)))  # fmt: skip
        lat: list[float] = []
        cpu0 = time.process_time()
        start = time.perf_counter()
        stop_at = start + seconds
        await asyncio.gather(*(agent(arm, url, client, random.Random(i), turns, stop_at, lat,
                                     [260, 447, 274, 318, 474]) for i in range(concurrency)))  # fmt: skip
        elapsed = time.perf_counter() - start
        client_cpu = time.process_time() - cpu0
    lat.sort()
    p50, p99 = quantiles(lat)
    return {"n": len(lat), "warm": len(warm), "rps": len(lat) / elapsed, "p50": p50, "p99": p99,
            "mean": statistics.fmean(lat), "lat": lat, "client_cpu": client_cpu}  # fmt: skip


def run_mixed(urls: dict[str, str], per: int, seconds: float, turns: int) -> dict[str, dict[str, Any]]:
    """Every arm's load generator at the same time, `per` agents each (with every latency):
    a burst of other load on the machine hits all the arms alike."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(urls)) as pool:
        futures = {arm: pool.submit(run_loadgen, arm, url, per, seconds, turns, True)
                   for arm, url in urls.items()}  # fmt: skip
        return {arm: f.result() for arm, f in futures.items()}


def mixed_table(c: int, urls: dict[str, str], seconds: float, rounds: int, turns: int) -> None:
    """`--mixed`: the APIs (and the stand-in alone) side by side, c/4 agents each."""
    lat: dict[str, list[float]] = {arm: [] for arm in urls}
    p50s: dict[str, list[float]] = {arm: [] for arm in urls}
    for _ in range(rounds):
        PROBES.append(host_probe())
        for arm, res in run_mixed(urls, max(1, c // 4), seconds / rounds, turns).items():
            lat[arm] += res["lat"]
            p50s[arm].append(res["p50"])
    q = {arm: quantiles(v) for arm, v in lat.items()}
    for arm in list(urls)[1:]:
        added = [(q[arm][k] - q["direct"][k]) * 1e3 for k in (0, 1)]
        vs = [(q[arm][k] - q["collector"][k]) * 1e3 for k in (0, 1)]
        paired = statistics.median((p - chat) * 1e3 for p, chat in zip(p50s[arm], p50s["collector"], strict=True))
        name = {"collector": "chat", "responses-nostore": "resp/nostore"}.get(arm, arm)
        print(f"{c:>4} {name:>12} | {len(lat[arm]) / seconds:>6.0f} {q[arm][0] * 1e3:>7.2f} "
              f"{q[arm][1] * 1e3:>7.2f} | {added[0]:>9.2f} {added[1]:>9.2f} | {vs[0]:>11.2f} "
              f"{vs[1]:>11.2f} | {paired:>13.2f}", flush=True)  # fmt: skip


def host_probe() -> float:
    """CPU seconds of a fixed pure-Python loop: on a shared host the same work takes up to
    twice as long in bursts (other tenants), which no sequential comparison survives."""
    t0 = time.process_time()
    total = 0
    for i in range(1_000_000):
        total += i
    return time.process_time() - t0


def quantiles(lat: list[float]) -> tuple[float, float]:
    """p50 and p99."""
    lat = sorted(lat)
    return lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]


def run_loadgen(arm: str, url: str, concurrency: int, seconds: float, turns: int,
                keep: bool = False) -> dict[str, Any]:  # fmt: skip
    """One load generator run; `keep`: with every latency (`lat`)."""
    out = subprocess.run(
        [sys.executable, __file__, "--loadgen", arm, "--url", url, "--concurrency", str(concurrency),
         "--seconds", str(seconds), "--turns", str(turns)],
        cwd=REPO, check=True, capture_output=True, text=True,
    )  # fmt: skip
    res = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    if not keep:
        del res["lat"]
    return res


# -- the harness ---------------------------------------------------------------------------------


def start(argv: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen[bytes]:
    out = open(log, "wb") if log else subprocess.DEVNULL
    return subprocess.Popen(argv, cwd=REPO, env={**os.environ, **(env or {})}, stdout=out,
                            stderr=subprocess.STDOUT)  # fmt: skip


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_reads(r: Any) -> int:
    """Requests Redis has read from its clients so far: a pipeline is one, so this counts
    round trips (the background sweeper's too, about one a second)."""
    return int(r.info("stats")["total_reads_processed"])


def ready(url: str) -> bool:
    import httpx

    return httpx.get(url, timeout=1).status_code == 200


def profiled_collector(out: str) -> None:
    """The collector's entrypoint under cProfile, timing CPU (not wall) time."""
    import cProfile

    from services.collector.__main__ import main as collector_main

    prof = cProfile.Profile(time.process_time)
    prof.enable()
    try:
        collector_main([])
    finally:
        prof.disable()
        prof.dump_stats(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--latency-ms", type=float, default=50.0)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--profile", help="also run the collector under cProfile at concurrency 16")
    p.add_argument("--profile-api", default="chat", choices=list(ARMS),
                   help="--profile: the API whose requests drive the profiled collector")  # fmt: skip
    p.add_argument("--apis", default="1,16",
                   help="concurrencies at which the Responses and Messages APIs are measured "
                        "beside chat completions (empty: none)")  # fmt: skip
    p.add_argument("--mixed", default="16",
                   help="collector concurrencies at which the four APIs also run at the same time, "
                        "a quarter of the agents each, beside the stand-in alone (as many again "
                        "as one API); empty: none")  # fmt: skip
    p.add_argument("--mixed-seconds", type=float, default=60.0,
                   help="--mixed: seconds per concurrency (p99 needs a few thousand requests per API)")
    p.add_argument("--rounds", type=int, default=3,
                   help="--apis: each arm's --seconds split over this many interleaved runs")
    p.add_argument("--loadgen", choices=["direct", "collector", "responses", "responses-nostore", "messages"],
                   help=argparse.SUPPRESS)  # fmt: skip
    p.add_argument("--profiled-collector", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.profiled_collector:
        profiled_collector(a.profiled_collector)
        return
    if a.loadgen:
        import uvloop

        res = uvloop.run(loadgen(a.loadgen, a.url, int(a.concurrency), a.seconds, a.turns))
        print(json.dumps(res))
        return

    from tests.support.tiny_model import build_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="bench-collector-"))
    build_tokenizer(tmp)
    redis_server = RedisServer().start()
    engine_port, port = free_port(), free_port()
    engine_url, url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{port}"
    standin = start([sys.executable, "-m", "tests.support.standin_engine", "--port", str(engine_port),
                     "--latency-ms", str(a.latency_ms), "--tokenizer", str(tmp)])  # fmt: skip
    env = {"NEXTSTATE_ENV": "dev", "NEXTSTATE_REDIS__URL": redis_server.url,
           "NEXTSTATE_REDIS__PREFIX": "bench", "NEXTSTATE_LOG__LEVEL": "WARNING",
           "NEXTSTATE_STREAMS__MAXLEN": "10000000", "NEXTSTATE_COLLECTOR__ENGINE_URL": engine_url,
           "NEXTSTATE_COLLECTOR__PORT": str(port),
           "NEXTSTATE_COLLECTOR__SPOOL_PATH": str(tmp / "spool.jsonl")}  # fmt: skip
    procs = [standin]
    try:
        wait_until(lambda: ready(engine_url + "/health"), 30, "stand-in engine")
        collector = start([sys.executable, "-m", "services.collector"], env, tmp / "collector.log")
        procs.append(collector)
        wait_until(lambda: ready(url + "/readyz"), 90, "collector")
        import redis

        r = redis.Redis.from_url(redis_server.url)
        print(f"stand-in latency {a.latency_ms} ms, {a.turns}-turn conversations, {a.seconds} s per "
              f"arm; load generator in its own process; {os.cpu_count()} cores shared by all")  # fmt: skip
        print(f"{'conc':>4} | {'direct/s':>8} {'p50 ms':>7} {'p99 ms':>7} | {'proxy/s':>8} {'p50 ms':>7} "
              f"{'p99 ms':>7} | {'added p50':>9} {'added p99':>9} | {'turns/s':>7} {'cpu ms/req':>10}")  # fmt: skip
        for c in [int(x) for x in a.concurrency.split(",") if x]:
            direct = run_loadgen("direct", engine_url, c, a.seconds, a.turns)
            before, cpu0 = r.xlen("bench:turns"), cpu_seconds(collector.pid)
            t0 = time.perf_counter()
            proxy = run_loadgen("collector", url, c, a.seconds, a.turns)
            elapsed = time.perf_counter() - t0
            emitted = (r.xlen("bench:turns") - before) / elapsed
            # The collector's own CPU per completion (warm-up requests included in both).
            cpu_ms = (cpu_seconds(collector.pid) - cpu0) * 1e3 / (proxy["n"] + proxy["warm"])
            print(f"{c:>4} | {direct['rps']:>8.0f} {direct['p50'] * 1e3:>7.2f} {direct['p99'] * 1e3:>7.2f} | "
                  f"{proxy['rps']:>8.0f} {proxy['p50'] * 1e3:>7.2f} {proxy['p99'] * 1e3:>7.2f} | "
                  f"{(proxy['p50'] - direct['p50']) * 1e3:>9.2f} {(proxy['p99'] - direct['p99']) * 1e3:>9.2f} | "
                  f"{emitted:>7.0f} {cpu_ms:>10.2f}", flush=True)  # fmt: skip
        if a.apis:
            print(f"\nper API, same collector, arms interleaved over {a.rounds} rounds (their order "
                  "rotating); added = p - "
                  "direct p (the stand-in alone); vs chat = added - chat's added, in this run; "
                  "round vs chat: the median over rounds of p50 - chat's p50 in the same round "
                  "(robust to a burst of other load that hits one arm's run)")  # fmt: skip
            print(f"{'conc':>4} {'api':>12} | {'req/s':>6} {'p50 ms':>7} {'p99 ms':>7} | "
                  f"{'added p50':>9} {'added p99':>9} | {'vs chat p50':>11} {'vs chat p99':>11} | "
                  f"{'round vs chat':>13} | {'cpu ms/req':>10} {'client cpu':>10} {'redis rt/req':>12}")  # fmt: skip
            arms = ("direct", "collector", "responses", "responses-nostore", "messages")
            for c in [int(x) for x in a.apis.split(",")]:
                lat: dict[str, list[float]] = {arm: [] for arm in arms}
                cpu = dict.fromkeys(arms, 0.0)
                served = dict.fromkeys(arms, 0)
                client = dict.fromkeys(arms, 0.0)
                rounds: dict[str, list[float]] = {arm: [] for arm in arms}  # per-round p50
                reads = dict.fromkeys(arms, 0)
                for k in range(a.rounds):
                    for arm in arms[k % len(arms):] + arms[: k % len(arms)]:  # each arm leads in turn
                        PROBES.append(host_probe())
                        cpu0, reads0 = cpu_seconds(collector.pid), redis_reads(r)
                        res = run_loadgen(arm, engine_url if arm == "direct" else url, c,
                                          a.seconds / a.rounds, a.turns, keep=True)  # fmt: skip
                        cpu[arm] += cpu_seconds(collector.pid) - cpu0
                        reads[arm] += redis_reads(r) - reads0
                        served[arm] += res["n"] + res["warm"]
                        lat[arm] += res["lat"]
                        rounds[arm].append(res["p50"])
                        client[arm] += res["client_cpu"]
                q = {arm: quantiles(v) for arm, v in lat.items()}
                for arm in arms[1:]:
                    added = [(q[arm][k] - q["direct"][k]) * 1e3 for k in (0, 1)]
                    vs = [(q[arm][k] - q["collector"][k]) * 1e3 for k in (0, 1)]
                    paired = statistics.median(
                        (p - chat) * 1e3 for p, chat in zip(rounds[arm], rounds["collector"], strict=True))
                    name = {"collector": "chat", "responses-nostore": "resp/nostore"}.get(arm, arm)
                    print(f"{c:>4} {name:>12} | "
                          f"{len(lat[arm]) / a.seconds:>6.0f} {q[arm][0] * 1e3:>7.2f} "
                          f"{q[arm][1] * 1e3:>7.2f} | {added[0]:>9.2f} {added[1]:>9.2f} | "
                          f"{vs[0]:>11.2f} {vs[1]:>11.2f} | {paired:>13.2f} | "
                          f"{cpu[arm] * 1e3 / served[arm]:>10.2f} "
                          f"{client[arm] * 1e3 / len(lat[arm]):>10.2f} "
                          f"{reads[arm] / served[arm]:>12.2f}", flush=True)  # fmt: skip
        if a.mixed:
            print(f"\nthe APIs at the same time (and the stand-in alone), c/4 agents each, over "
                  f"{a.rounds} rounds: one burst of other load hits every arm alike")  # fmt: skip
            print(f"{'conc':>4} {'api':>12} | {'req/s':>6} {'p50 ms':>7} {'p99 ms':>7} | "
                  f"{'added p50':>9} {'added p99':>9} | {'vs chat p50':>11} {'vs chat p99':>11} | "
                  f"{'round vs chat':>13}")  # fmt: skip
            urls = {"direct": engine_url, **dict.fromkeys(ARMS.values(), url)}
            for c in [int(x) for x in a.mixed.split(",") if x]:
                mixed_table(c, urls, a.mixed_seconds, a.rounds, a.turns)
        if PROBES:
            print(f"\nhost steadiness: a fixed loop between runs took {min(PROBES) * 1e3:.0f} to "
                  f"{max(PROBES) * 1e3:.0f} ms of CPU ({max(PROBES) / min(PROBES):.2f}x): runs one "
                  "after another meet different speeds; side by side they meet the same")  # fmt: skip
        r.close()
        if a.profile:
            stop_process(collector)
            prof = start([sys.executable, __file__, "--profiled-collector", a.profile],
                         env, tmp / "collector-prof.log")  # fmt: skip
            procs.append(prof)
            wait_until(lambda: ready(url + "/readyz"), 90, "profiled collector")
            run_loadgen(ARMS[a.profile_api], url, 16, a.seconds, a.turns)
            stop_process(prof, timeout=30)
            print(f"profile written to {a.profile}")
    finally:
        for proc in reversed(procs):
            stop_process(proc)
        redis_server.close()


if __name__ == "__main__":
    main()
