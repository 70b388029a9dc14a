"""How good must a judge be for the loop to learn? Two measurements, each a real run.

`agreement`: judges on the demo's own turns. Our engine serves SmolLM2-135M-Instruct (the
default model). As policy it answers N of the demo's questions under the `short` task
(`nextstate demo`'s system prompt, temperature 1, 48 tokens); the demo user's ground truth
is the task's criterion (at most 12 words), and the next state is what the demo user
replies: praise, or the correction (with the next question, as the demo does two turns
in three). Then the same engine judges every turn, as `up --judge-model policy` would:

  rule             the rule judge (what `up` uses without a judge model)
  smollm2          SmolLM2 as the PRM, free text (prompt prm-v1; `--judge-model`'s defaults:
                   3 votes, 256 tokens)
  smollm2-verdict  the same with NEXTSTATE_JUDGE__VERDICT_GRAMMAR (the sglang backend, our
                   engine's /generate: each vote is \\boxed{1|0|-1} and nothing else)

Per judge: agreement (the reward's sign is the truth's; a 0 agrees with nothing), signal
(the mean of reward × truth, truth ±1: what a policy gradient with A = r follows; 1 for a
perfect judge, 0 for noise), readable votes, undecided turns, the commonest reward's
share (what the collapse alarm watches), seconds per judged turn.

`loop`: the closed loop with judges of known accuracy. `nextstate up` on the tiny test
model (the closed-loop test's setup: vowel task, lr 2e-3, batch 8, evaluation on, its
held-out `demo` suite on the vowel task) with the plugin judge `noisy_rule` below: the
rule judge's verdict, flipped with probability 1 − a (per turn, stable across
redeliveries). `nextstate demo --task vowel` runs for --turns answers; reported per
accuracy a: the demo's success rate of the base policy (v0's answers), over the first
150 answers and the last 300, versions trained, and the held-out `demo` score (48
questions at temperature 0) averaged over the first 10 and the last 10 versions evaluated.
Arms run one after the other (each a stack of its own).

    python bench/judge_quality.py agreement [--turns 60] [--votes 3] [--max-tokens 256]
    python bench/judge_quality.py loop [--accuracy 1 0.8 0.65 0.5] [--turns 900]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx

from services.judge.collapse import is_undecided, value_of
from services.judge.judges import RuleJudge
from services.judge.settings import DEFAULT_NEGATIVE, DEFAULT_POSITIVE
from services.judge.verdict import Verdict
from shared.schemas import Turn

SHORT_CORRECTION = "That's wrong for me: far too long. Answer again in one short sentence."
PRAISE = ["Perfect, thanks!", "Great, that's exactly what I needed, thanks.", "Thank you, perfect.",
          "Looks good, thanks!"]
_RULE = RuleJudge(list(DEFAULT_POSITIVE), list(DEFAULT_NEGATIVE))


def noisy_rule(turn: Turn) -> float:
    """A judge of accuracy BENCH_JUDGE_ACCURACY: the rule judge's verdict, flipped with
    probability 1 - a, decided by the turn's id (a redelivered turn gets the same)."""
    accuracy = float(os.environ.get("BENCH_JUDGE_ACCURACY", "1"))
    text = "\n".join(str(m.get("content") or "") for m in turn.next_state or [])
    verdict, _ = _RULE.score(text)
    draw = int(hashlib.sha256(turn.id.encode()).hexdigest()[:8], 16) / 2**32
    return float(verdict if draw < accuracy else -verdict)


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.1f}/{five:.1f}/{fifteen:.1f} on {os.cpu_count()} cores"


# -- agreement ---------------------------------------------------------------------------------
@dataclass
class Case:
    turn: Turn
    truth: int  # +1: the answer met the task's criterion (the demo user praised it), else -1


@dataclass
class Arm:
    name: str
    verdicts: list[Verdict]
    truths: list[int]
    seconds: float
    scale: str = "label"

    def row(self) -> dict[str, Any]:
        n = len(self.verdicts)
        rewards = [v.reward for v in self.verdicts]
        votes = [vote for v in self.verdicts for vote in v.votes]
        values = Counter(value_of(r) for r in rewards)
        top, top_n = values.most_common(1)[0]
        return {
            "judge": self.name, "turns": n,
            "agreement": sum((r > 0) == (t > 0) and r != 0 for r, t in zip(rewards, self.truths, strict=True)) / n,
            "signal": sum(r * t for r, t in zip(rewards, self.truths, strict=True)) / n,
            "readable_votes": sum(v.score is not None for v in votes) / max(len(votes), 1),
            "undecided": sum(is_undecided(v.votes, "label", None) for v in self.verdicts) / n,
            "top_value": top, "top_share": top_n / n,
            "s_per_turn": self.seconds / n,
        }


async def policy_turns(url: str, token: str, n: int, seed: int) -> list[Case]:
    """The demo's turns: SmolLM2 answers demo questions under the `short` task; the truth
    and the demo user's reply follow from the task's criterion."""
    from shared.demo_tasks import QUESTIONS, TASKS

    task, rng = TASKS["short"], random.Random(seed)
    questions = [rng.choice(QUESTIONS) for _ in range(n)]
    sem = asyncio.Semaphore(4)

    async def one(i: int, client: httpx.AsyncClient) -> Case:
        messages = [{"role": "system", "content": task.system}, {"role": "user", "content": questions[i]}]
        async with sem:
            resp = await client.post("/v1/chat/completions", json={
                "model": "policy", "messages": messages, "max_tokens": 48, "temperature": 1.0, "seed": seed + i})
        resp.raise_for_status()
        answer = resp.json()["choices"][0]["message"]["content"] or ""
        ok = task.ok(answer)
        feedback = rng.choice(PRAISE) if ok else SHORT_CORRECTION
        reply = f"{feedback} Next: {rng.choice(QUESTIONS)}" if i % 3 != 2 else feedback
        turn = Turn(session_id=f"bench-{i}", turn_index=0, messages=messages,
                    response={"role": "assistant", "content": answer}, next_state=[{"role": "user", "content": reply}],
                    prompt_ids=[1], response_ids=[2], response_logprobs=[0.0])
        return Case(turn, 1 if ok else -1)

    async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {token}"}, timeout=300) as client:
        return list(await asyncio.gather(*(one(i, client) for i in range(n))))


async def judge_all(name: str, judge: Callable[[Turn], Awaitable[Verdict]], cases: Sequence[Case],
                    concurrency: int) -> Arm:
    sem = asyncio.Semaphore(concurrency)

    async def one(c: Case) -> Verdict:
        async with sem:
            return await judge(c.turn)

    started = time.monotonic()
    verdicts = list(await asyncio.gather(*(one(c) for c in cases)))
    return Arm(name, verdicts, [c.truth for c in cases], time.monotonic() - started)


async def agreement(args: argparse.Namespace) -> int:
    from services.ctl.models import ensure_default_model
    from services.judge.backend import make_backend
    from services.judge.judges import PRMJudge
    from services.judge.settings import JudgeConfig
    from tests.support.servers import ServiceProcess, free_port

    model = ensure_default_model()
    token, port = secrets.token_urlsafe(24), free_port()
    engine = ServiceProcess("engine", {"NEXTSTATE_INTERNAL__TOKEN": token, "NEXTSTATE_ENGINE__MODEL": str(model),
                                       "NEXTSTATE_ENGINE__PORT": str(port), "NEXTSTATE_ENGINE__MAX_RUNNING": "16"})
    url = f"http://127.0.0.1:{port}"
    print(f"# {load()} at the start")
    engine.start().wait_http(f"{url}/health", timeout=300)
    try:
        cases = await policy_turns(url, token, args.turns, args.seed)
        print(f"# {len(cases)} demo turns from SmolLM2, {sum(c.truth > 0 for c in cases)} meet the `short` "
              f"criterion; {load()}")
        arms = [await judge_all("rule", _RULE.judge, cases, 8)]
        common = {"url": url, "model": "judge", "votes": args.votes, "max_tokens": args.max_tokens,
                  "timeout_s": 600, "api_key": token}
        free = JudgeConfig(**common)  # type: ignore[arg-type]
        verdict = JudgeConfig(**{**common, "backend": "sglang", "judge_tokenizer": str(model),  # type: ignore[arg-type]
                                 "verdict_grammar": True, "max_tokens": 8})
        for name, cfg in (("smollm2-verdict", verdict), ("smollm2", free)):
            async with make_backend(cfg) as backend:
                arms.append(await judge_all(name, PRMJudge(backend, cfg).judge, cases, args.concurrency))
            print(f"# {name} done; {load()}")
    finally:
        engine.stop()
    rows = [a.row() for a in arms]
    print(f"\n{'judge':<16} {'agreement':>9} {'signal':>7} {'readable':>8} {'undecided':>9} "
          f"{'commonest':>14} {'s/turn':>7}")
    for r in rows:
        print(f"{r['judge']:<16} {r['agreement']:>9.0%} {r['signal']:>7.2f} {r['readable_votes']:>8.0%} "
              f"{r['undecided']:>9.0%} {r['top_value'] + ' ' + format(r['top_share'], '.0%'):>14} "
              f"{r['s_per_turn']:>7.2f}")
    print(f"\n# {load()} at the end")
    print(f"# python bench/judge_quality.py agreement --turns {args.turns} --votes {args.votes} "
          f"--max-tokens {args.max_tokens} --seed {args.seed}")
    if args.json:
        print(json.dumps({"turns": len(cases), "rows": rows}))
    return 0


# -- loop --------------------------------------------------------------------------------------
def demo_rate(rows: list[dict[str, Any]], first: bool, n: int) -> tuple[float, int]:
    """The success rate over the first (or last) n answers of the demo's per-version rows."""
    taken: list[dict[str, Any]] = []
    for row in rows if first else reversed(rows):
        taken.append(row)
        if sum(r["turns"] for r in taken) >= n:
            break
    turns = sum(r["turns"] for r in taken)
    return sum(r["turns"] * r["success_rate"] for r in taken) / max(turns, 1), turns


def loop_arm(model: Path, accuracy: float, turns: int, minutes: float, home: Path) -> dict[str, Any]:
    from shared.schemas import EvalResult
    from tests.support.upstack import UpStack

    run = f"jq-{str(accuracy).replace('.', '')}-{secrets.token_hex(3)}"
    stack = UpStack(model, home / run, run, run, args=["--lr", "2e-3", "--batch-size", "8", "--max-wait", "3",
                                                         "--judge", "bench.judge_quality:noisy_rule"],
                    env={"BENCH_JUDGE_ACCURACY": str(accuracy), "NEXTSTATE_EVAL__DEMO_TASK": "vowel",
                         "NEXTSTATE_EVAL__SAMPLES": "48", "NEXTSTATE_WATCHER__POLL_INTERVAL_S": "0.5",
                         "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    stack.start()
    try:
        demo = subprocess.run(
            [str(Path(sys.executable).parent / "nextstate"), "demo", "--url", stack.collector, "--task", "vowel",
             "--turns", str(turns), "--minutes", str(minutes), "--max-tokens", "2", "--concurrency", "4",
             "--json", "--no-eval"], cwd=REPO, capture_output=True, text=True, timeout=minutes * 60 + 120,
            env={**os.environ, "NEXTSTATE_HOME": str(stack.home), "NEXTSTATE_RUN": run})
        if demo.returncode != 0:
            raise RuntimeError(demo.stderr[-2000:])
        summary = json.loads(demo.stdout.strip().splitlines()[-1])
        r = stack.redis()
        trained = int(r.get(f"{run}:trainer-version") or 0)
        # the held-out demo suite: wait (bounded) for the newest trained version's result
        deadline = time.monotonic() + 300
        while True:
            results = [EvalResult.from_json(f["data"]) for _, f in r.xrange(f"{run}:evals")]
            demo_scores = {x.version: x.score for x in results if x.suite == "demo"}
            if (trained and max(demo_scores, default=-1) >= trained) or time.monotonic() > deadline:
                break
            time.sleep(2)
    finally:
        stack.stop()
    rows = summary["by_version"]
    base = next((row for row in rows if row["version"] == "0"), {"turns": 0, "success_rate": 0.0})
    early, n_early = demo_rate(rows, True, 150)
    late, n_late = demo_rate(rows, False, 300)
    curve = [demo_scores[v] for v in sorted(demo_scores)]
    return {"accuracy": accuracy, "answers": summary["turns"], "base": base["success_rate"], "n_base": base["turns"],
            "early": early, "n_early": n_early, "late": late, "n_late": n_late, "versions": trained,
            "evaluated": len(curve), "held_out_first10": statistics.mean(curve[:10]) if curve else None,
            "held_out_last10": statistics.mean(curve[-10:]) if curve else None,
            "held_out": {str(v): demo_scores[v] for v in sorted(demo_scores)}}


def loop(args: argparse.Namespace) -> int:
    from tests.support.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="judge-quality-"))
    model = build_tiny_model(work / "tiny")
    rows = []
    for a in args.accuracy:
        print(f"# accuracy {a}: {load()}", flush=True)
        rows.append(loop_arm(model, a, args.turns, args.minutes, work))
        print(f"#   {json.dumps(rows[-1])}", flush=True)
    print(f"\n{'accuracy':>8} {'answers':>7} {'v0 (n)':>10} {'first 150':>9} {'last 300':>9} {'versions':>8} "
          f"{'held-out demo, first 10 -> last 10 evaluated':>45}")
    for r in rows:
        held = ("-" if r["held_out_first10"] is None else
                f"{r['held_out_first10']:.2f} -> {r['held_out_last10']:.2f} ({r['evaluated']} versions)")
        print(f"{r['accuracy']:>8.2f} {r['answers']:>7} {r['base']:>4.0%} ({r['n_base']:>3}) {r['early']:>9.0%} "
              f"{r['late']:>9.0%} {r['versions']:>8} {held:>45}")
    print(f"\n# {load()} at the end")
    print(f"# python bench/judge_quality.py loop --accuracy {' '.join(map(str, args.accuracy))} "
          f"--turns {args.turns} --minutes {args.minutes}")
    if args.json:
        print(json.dumps(rows))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("agreement", help="judges against the demo user's ground truth")
    a.add_argument("--turns", type=int, default=60)
    a.add_argument("--votes", type=int, default=3)
    a.add_argument("--max-tokens", type=int, default=256, help="the free-text judge's tokens per vote")
    a.add_argument("--concurrency", type=int, default=8, help="turns judged at once (up --judge-model's)")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--json", action="store_true")
    lp = sub.add_parser("loop", help="the closed loop with judges of known accuracy")
    lp.add_argument("--accuracy", type=float, nargs="+", default=[1.0, 0.8, 0.65, 0.5])
    lp.add_argument("--turns", type=int, default=900, help="demo answers per arm")
    lp.add_argument("--minutes", type=float, default=6.0, help="at most this long per arm's demo")
    lp.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.what == "agreement":
        return asyncio.run(agreement(args))
    return loop(args)


if __name__ == "__main__":
    sys.exit(main())
