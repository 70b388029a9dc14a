"""`nextstate eval run --model PATH | --version RUN:V`: a model outside the run, evaluated
beside the run's versions.

    nextstate eval run --model /models/sft-ckpt --suite demo drift    # any HF folder of the policy's shape
    nextstate eval run --version other-run:12                         # a version of any run in the bucket
    nextstate eval run --model /models/x --label sft-lr3e-5 --samples 128 --no-wait

One evaluation job per suite goes on the evaluators' queue (shared/evaljobs.py
`enqueue_model_eval`; suites: `--suite`, else the gate's, else those the run was evaluated
on, else demo and drift). An evaluator serves the model on its evaluation engine (under a
weight version of its own; afterwards the engine serves what it served before), runs the
suite, and stores the `EvalResult` in the bucket beside the run's versions
(`evals/<run>/models/<label>/<suite>.json`, `model` = the label). Nothing else changes: the
result is never on `evals`, so no gate decides on it, and no lineage, promotion or served
version moves. `nextstate eval show` lists it under the run's versions and `eval plot` draws
it across each suite's curve.

The command waits for every suite (the job's state, kept by the evaluator in
`keys.model_eval(job id)`), printing each result as it comes, then the run's base, served
and newest versions on the same suites. A failed job prints the evaluator's error (e.g. the
engine refusing a model of another architecture); the exit code is then 1. `--no-wait`
only enqueues. The folder must be visible at PATH to the evaluator and its engine (the
same machine, or a shared volume); `--version RUN:V` needs nothing but the bucket (full
versions: a LoRA adapter version of another run is refused).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from services.ctl.common import redis_error, settings_from
from services.ctl.eval_records import DEFAULT_SUITES, collect, gate_summary, gather
from shared import checkpoints as ckpt
from shared.errors import NextstateError, NoCheckpoint, StoreError
from shared.keys import Keys
from shared.schemas import EvalResult
from shared.settings import Settings
from shared.store import Bucket
from shared.streams import Bus

POLL_S = 0.5


def add_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("--model", metavar="PATH",
                     help="evaluate this HF folder (the policy's architecture) beside the run; never gated")
    run.add_argument("--version", dest="source", metavar="RUN:V",
                     help="evaluate version V of run RUN from the bucket beside this run; never gated")
    run.add_argument("--label", help="the name its results are shown under (default: the folder's name, or RUN:vV)")
    run.add_argument("--no-wait", action="store_true", help="with --model/--version: enqueue, do not wait")


def parse_source(text: str) -> tuple[str, int]:
    name, sep, version = text.rpartition(":")
    if not sep or not name or not version.isdigit():
        raise NextstateError(f"--version {text!r}: give RUN:V, e.g. my-run:12")
    if int(version) == 0:
        raise NextstateError(f"--version {text}: v0 is the base model, never in the bucket: give --model with its folder")
    return name, int(version)


def check_source(settings: Settings, source: tuple[str, int]) -> None:
    try:
        with Bucket(settings.bucket.model_copy(update={"timeout": 5.0}), retries=1) as bucket:
            manifest = ckpt.read_manifest(bucket, ckpt.manifest_key(*source))
    except NoCheckpoint:
        raise NextstateError(f"run {source[0]} has no committed v{source[1]} in the bucket "
                             f"(NEXTSTATE_RUN={source[0]} nextstate rollback --list shows its versions)") from None
    except (StoreError, OSError) as exc:
        print(f"nextstate: could not check {source[0]} v{source[1]} in the bucket ({exc}); enqueuing anyway",
              file=sys.stderr)
        return
    if manifest.format != "full":
        raise NextstateError(f"{source[0]} v{source[1]} is a LoRA adapter version: only full versions of another "
                             "run are evaluated beside this one")


async def suites_for(settings: Settings, run: str) -> list[str]:
    """The gate's suites, else every suite the run's versions were evaluated on, else demo and drift."""
    async with Bus(settings) as bus:
        gate = gate_summary(await bus.redis.hgetall(bus.keys.gate_state))
        if gate and gate["config"].get("suites"):
            return [str(s) for s in gate["config"]["suites"]]
        data = await collect(bus, run, [])
    return sorted({s for row in data["versions"] for s in row["suites"]}) or list(DEFAULT_SUITES)


def run_model_cmd(args: argparse.Namespace) -> int:
    if args.version is not None:
        raise NextstateError("give VERSION, --model PATH or --version RUN:V (one of them)")
    if args.model is not None and args.source is not None:
        raise NextstateError("give --model PATH or --version RUN:V, not both")
    if args.samples is not None and args.samples < 1:
        raise NextstateError("--samples must be at least 1")
    settings = settings_from(args)
    run = args.run or settings.run
    model = source = None
    if args.model is not None:
        folder = Path(args.model).expanduser().resolve()
        if not (folder / "config.json").is_file():
            print(f"nextstate: {folder} is not an HF model folder here (no config.json); enqueuing anyway: "
                  "the evaluator must see it at that path", file=sys.stderr)
        model, label = str(folder), args.label or folder.name
    else:
        source = parse_source(args.source)
        check_source(settings, source)
        label = args.label or f"{source[0]}:v{source[1]}"
    from shared.evaljobs import enqueue_model_eval, rq_connection  # rq: only when enqueuing

    keys = Keys(settings.redis.prefix)
    nonce = f"{int(time.time()):x}{secrets.token_hex(3)}"
    try:
        suites = args.suite or asyncio.run(suites_for(settings, run))
        conn = rq_connection(settings.redis.url, socket_timeout=settings.redis.socket_timeout,
                             connect_timeout=settings.redis.connect_timeout)
        try:
            jobs = {}
            for suite in suites:
                jobs[suite] = enqueue_model_eval(conn, keys, run, label, suite, nonce=nonce, model=model,
                                                 source=source, samples=args.samples, timeout_s=args.timeout,
                                                 retries=args.retries)
                print(f"enqueued {jobs[suite]}: {suite} on {label}, beside run {run}", flush=True)
            if args.no_wait:
                print("its results appear in `nextstate eval show` (under the run's versions) once an "
                      "evaluator ran them")
                return 0
            deadline = time.monotonic() + args.timeout * (args.retries + 1) + 120
            results = wait(conn, keys, jobs, label, deadline)
        finally:
            conn.close()
        if results:
            print(beside(settings, run, label, results))
    except RedisError as exc:
        raise redis_error(exc, settings) from exc
    return 0 if len(results) == len(suites) else 1


def wait(conn: Any, keys: Keys, jobs: dict[str, str], label: str, deadline: float) -> dict[str, EvalResult]:
    """Each job's end, printed as it comes; the results of those that succeeded."""
    results: dict[str, EvalResult] = {}
    open_jobs = dict(jobs)
    while open_jobs:
        for suite, job in list(open_jobs.items()):
            state = {k.decode(): v.decode() for k, v in conn.hgetall(keys.model_eval(job)).items()}
            if state.get("state") == "done":
                r = EvalResult.from_json(state["result"])
                results[suite] = r
                print(f"{label}  {suite} {_score(r)}", flush=True)
                del open_jobs[suite]
            elif state.get("state") == "failed":
                print(f"{label}  {suite} failed: {state.get('error', '?')}", flush=True)
                del open_jobs[suite]
        if open_jobs and time.monotonic() > deadline:
            for suite, job in open_jobs.items():
                print(f"{label}  {suite}: no result in time (job {job}); is an evaluator running? "
                      "`nextstate status` shows the services", flush=True)
            break
        if open_jobs:
            time.sleep(POLL_S)
    return results


def _score(r: EvalResult) -> str:
    ci = f" [{r.ci_low:.4g}, {r.ci_high:.4g}]" if r.ci_low is not None and r.ci_high is not None else ""
    return f"{r.score:.4g}{ci} n={r.n}"


def beside(settings: Settings, run: str, label: str, results: dict[str, EvalResult]) -> str:
    """The model's scores beside the run's base, serving and newest versions, per suite."""
    data = asyncio.run(gather(settings, run, quiet=True))
    versions = {row["version"]: row for row in data["versions"]}
    serving = (data.get("gate") or {}).get("serving")
    picks = [(v, name) for v, name in ((0, "base"), (serving, "serving"), (max(versions, default=None), "newest"))
             if v is not None and v in versions]
    lines = [f"beside run {run}:"]
    for suite, r in sorted(results.items()):
        better = "higher" if r.higher_is_better else "lower"
        cells = [f"{label} {r.score:.4g}"]
        seen: set[int] = set()
        for v, name in picks:
            s = versions[v]["suites"].get(suite)
            if s is not None and v not in seen:
                seen.add(v)
                cells.append(f"v{v} ({name}) {s['score']:.4g}")
        lines.append(f"  {suite} ({better} is better): " + ", ".join(cells))
    return "\n".join(lines)
