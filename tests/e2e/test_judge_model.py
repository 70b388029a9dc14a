"""A real model judges the PRM path: `nextstate up --judge-model policy` on SmolLM2-135M-Instruct.

The stack serves SmolLM2 to the users and, on an engine of its own (`judge-model`), to the
judge. A user (the official openai client, through the collector) asks, gets answers,
praises one session and corrects the other. What is checked is the mechanics, not the
quality (SmolLM2 is far too weak to judge: `bench/judge_quality.py`):

- the judge-model engine refuses its internal endpoints without the internal token;
- the prompts: m calls per judged turn reached the judge-model engine, with exactly the
  tokens of the PRM prompt over that turn and its next state (the engine's prompt-token
  count), none of them the serving engine, which saw only the users' requests;
- m votes per turn, each the model's raw answer, its score what the parser reads in it;
- the reward is the majority of the readable votes; unreadable ones are dropped, kept on
  the message with `score: null`, and counted in the judge's metrics;
- the collapse window counts the judged turns;
- the same turns under NEXTSTATE_JUDGE__VERDICT_GRAMMAR (the judge's /generate with a
  three-label grammar, on the same engine): every vote readable, the reward their majority.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from services.engine.model import load_tokenizer
from services.judge.backend import make_backend
from services.judge.collapse import is_undecided
from services.judge.judges import PRMJudge
from services.judge.parsing import majority, parse_score
from services.judge.prompts import PRM_PROMPTS, judge_messages
from services.judge.settings import JudgeConfig
from services.judge.verdict import Verdict, render_for_judge
from shared.demo_tasks import TASKS
from shared.schemas import ScoredTurn
from tests.support.servers import REPO
from tests.support.upstack import UpStack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

VOTES, MAX_TOKENS = 3, 24


def wait(cond: Callable[[], Any], timeout: float, what: str, stack: UpStack) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}:\n{stack.logs()}")


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (unlabelled samples too)."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def session(client: OpenAI, praise: bool) -> int:
    """The demo's user: two questions, feedback on each; returns the requests it made."""
    task = TASKS["short"]
    messages: list[Any] = [{"role": "system", "content": task.system},
                           {"role": "user", "content": "What is the capital of France?"}]
    feedback = "Perfect, thanks!" if praise else task.correction
    for reply in (f"{feedback} Next: What do bees make?", feedback):
        answer = client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content or ""},
                     {"role": "user", "content": reply}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=1,
                                   extra_headers={"X-Session-Done": "1"})
    return 3


def test_a_real_model_judges_the_prm_path(smollm2: Path, tmp_path: Path, unique: str) -> None:
    started = time.monotonic()
    stack = UpStack(smollm2, tmp_path / "home", f"judge-{unique}", f"jm-{unique}",
                    args=["--no-train", "--judge-model", "policy"],
                    env={"NEXTSTATE_JUDGE__VOTES": str(VOTES), "NEXTSTATE_JUDGE__MAX_TOKENS": str(MAX_TOKENS)})
    stack.start()
    up_s = time.monotonic() - started
    try:
        services = stack.record()["services"]
        engine, judge_engine = (services[n]["url"] for n in ("engine", "judge-model"))
        auth = stack.internal_headers()
        with httpx.Client(timeout=60) as http:
            assert http.get(f"{judge_engine}/health").status_code == 200  # the open probe
            assert http.get(f"{judge_engine}/v1/models").status_code == 401
            assert http.post(f"{judge_engine}/v1/chat/completions", json={
                "model": "judge", "messages": [{"role": "user", "content": "hi"}]}).status_code == 401
            assert http.get(f"{judge_engine}/metrics").status_code == 401
            models = http.get(f"{judge_engine}/v1/models", headers=auth)
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "judge"

        client = OpenAI(base_url=stack.collector, api_key="local", timeout=120, max_retries=0)
        requests = session(client, praise=True) + session(client, praise=False)
        r = stack.redis()
        prefix = stack.prefix

        def all_scored() -> list[ScoredTurn] | None:
            groups = r.xinfo_groups(f"{prefix}:turns") if r.exists(f"{prefix}:turns") else []
            if r.xlen(f"{prefix}:turns") < requests or not groups:
                return None
            if int(groups[0]["pending"]) or groups[0]["lag"]:
                return None
            return [ScoredTurn.from_json(f["data"]) for _, f in r.xrange(f"{prefix}:scored")]

        out = wait(all_scored, 300, "every turn judged", stack)
        judged = [s for s in out if s.judged]
        assert len(judged) == 4 and len(out) == requests  # 2 answers with a next state per session
        assert r.xlen(f"{prefix}:dead") == 0

        tokenizer = load_tokenizer(str(smollm2))
        cfg = JudgeConfig()  # the rendering bounds the judge ran with (defaults)
        prompt_tokens = unparsable = 0
        for s in judged:
            assert (s.judge, s.judge_model, s.prompt_version) == ("prm", "judge", "prm-v1")
            assert len(s.votes) == VOTES
            for v in s.votes:
                assert v.error is None and v.text, v  # every call answered, with the model's own text
                assert v.score == parse_score(v.text, "label"), v.text
            scores = [v.score for v in s.votes]
            unparsable += scores.count(None)
            assert s.reward == majority(scores)  # unreadable votes dropped, the rest's majority
            messages = judge_messages(PRM_PROMPTS["prm-v1"], render_for_judge(s.turn, cfg))
            assert s.turn.next_state and s.turn.next_state[0]["content"] in messages[1]["content"]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt_tokens += VOTES * len(tokenizer.encode(str(text), add_special_tokens=False))

        judge = stack.record()["services"]["judge-0"]["url"]  # started once the judge model answered
        with httpx.Client(timeout=30, headers=auth) as http:
            judging = http.get(f"{judge_engine}/metrics").text
            serving = http.get(f"{engine}/metrics").text
            judge_metrics = http.get(f"{judge}/metrics").text
        # The prompts: m calls per judged turn on the judge-model engine, each exactly the PRM
        # prompt over its turn; the serving engine saw the users' requests and nothing else.
        assert metric(judging, "nextstate_engine_requests_total") == VOTES * len(judged)
        assert metric(judging, "nextstate_engine_prompt_tokens_total") == prompt_tokens
        assert metric(judging, "nextstate_engine_generated_tokens_total") <= VOTES * len(judged) * MAX_TOKENS
        assert metric(serving, "nextstate_engine_requests_total") == requests
        # Unreadable votes: on the message (score null) and in the judge's metrics.
        assert metric(judge_metrics, "nextstate_judge_parse_failures_total", kind="prm") == unparsable
        assert metric(judge_metrics, "nextstate_judge_votes_total", kind="prm", outcome="unparsable") == unparsable
        assert metric(judge_metrics, "nextstate_judge_turns_total", outcome="scored") == len(judged)

        env = {k: v for k, v in os.environ.items() if not k.startswith("NEXTSTATE_")}
        shown = subprocess.run([sys.executable, "-m", "services.ctl", "status", "--json", "--window", "0"],
                               cwd=REPO, capture_output=True, text=True, timeout=60,
                               env={**env, "NEXTSTATE_HOME": str(stack.home), "NEXTSTATE_RUN": stack.run})
        assert shown.returncode == 0, shown.stderr
        rewards = json.loads(shown.stdout)["rewards"]
        assert rewards["turns"] == len(judged)
        undecided = sum(is_undecided(s.votes, "label", None) for s in judged)
        assert rewards["undecided"] == pytest.approx(undecided / len(judged), abs=1e-3)

        # The same turns, judged with NEXTSTATE_JUDGE__VERDICT_GRAMMAR on the same engine (our
        # /generate, the judge's own chat template): every vote readable, the reward their majority.
        token = stack.secrets()["internal_token"]
        vcfg = JudgeConfig(backend="sglang", url=judge_engine, judge_tokenizer=str(smollm2), verdict_grammar=True,
                           votes=VOTES, max_tokens=8, api_key=token)  # type: ignore[arg-type]

        async def constrained() -> list[Verdict]:
            async with make_backend(vcfg) as backend:
                judge = PRMJudge(backend, vcfg)
                return [await judge.judge(s.turn) for s in judged]

        verdicts = asyncio.run(constrained())
        for verdict in verdicts:
            scores = [v.score for v in verdict.votes]
            assert len(scores) == VOTES and None not in scores, verdict.votes
            assert all(v.text == f"\\boxed{{{v.score:g}}}" for v in verdict.votes), verdict.votes
            assert verdict.reward == majority(scores) and verdict.prompt_version == "prm-verdict-v1"
        print(f"SmolLM2 as the judge: {unparsable} of {VOTES * len(judged)} free-text votes unreadable at "
              f"max_tokens {MAX_TOKENS}, rewards {[s.reward for s in judged]}; under the verdict grammar "
              f"{[[v.score for v in x.votes] for x in verdicts]} -> {[x.reward for x in verdicts]}; up in "
              f"{up_s:.0f}s, {time.monotonic() - started:.0f}s in all")
    finally:
        assert stack.stop() == 0, stack.logs()
