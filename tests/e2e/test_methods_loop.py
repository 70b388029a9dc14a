"""`nextstate up --mode opd-topk`, `--mode oel` and `--mode combine` on the demo, real processes only.

The tiny random model serves; `nextstate demo --task vowel` corrects every answer that does
not start with a vowel ("Wrong, try again."). Without a judge model, `up` takes those
corrections as the hints (opd-topk) and as the sessions' lessons (oel). Each method must
train: versions committed whose `opd_topk` loss saw teacher top-K tokens, every teacher
sample carrying K = --topk rows, no dead letter and no service restarted. For oel, the
distilled turns came from replays of finished sessions, whose lessons are in the store.
Combine trains on both signals at once: the rule judge's reward and the correction as the
hint teacher's, on one sample, and the watcher serves the version it committed.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from shared.schemas import CheckpointPublished, PolicyLoaded, Replay, ScoredTurn, TrainBatch
from tests.support.servers import REPO
from tests.support.upstack import NEXTSTATE, UpStack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TOPK = 8


@pytest.mark.parametrize("mode", ["opd-topk", "oel"])
def test_the_method_trains_on_the_demo(mode: str, tiny_model: Path, tmp_path: Path, unique: str) -> None:
    run = f"m-{mode}-{unique}"[:40]
    stack = UpStack(tiny_model, tmp_path / "home", run, run, env={"NEXTSTATE_WATCHER__POLL_INTERVAL_S": "0.5"},
                    args=["--mode", mode, "--topk", str(TOPK), "--lr", "1e-3", "--batch-size", "8",
                          "--max-wait", "3", "--no-eval"]).start()  # fmt: skip
    try:
        env = {**os.environ, "NEXTSTATE_HOME": str(stack.home), "NEXTSTATE_RUN": run}
        demo = subprocess.run(
            [NEXTSTATE, "demo", "--url", stack.collector, "--task", "vowel", "--turns", "150", "--minutes", "4",
             "--max-tokens", "4", "--concurrency", "4", "--json", "--no-eval"],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=400,
        )  # fmt: skip
        assert demo.returncode == 0, demo.stderr[-2000:]
        summary = json.loads(demo.stdout.strip().splitlines()[-1])
        assert summary["errors"] == 0
        r = stack.redis()
        prefix = stack.prefix

        def trained() -> list[CheckpointPublished]:
            found = [CheckpointPublished.from_json(f["data"]) for _, f in r.xrange(f"{prefix}:checkpoints")]
            return [c for c in found if c.metrics.get("topk_tokens", 0) > 0]

        deadline = time.monotonic() + 240
        while len(trained()) < 2 and time.monotonic() < deadline:
            time.sleep(1)
        versions = trained()
        assert len(versions) >= 2, f"{len(versions)} versions trained on the teacher's top-K:\n{stack.logs()}"
        scored = [ScoredTurn.from_json(f["data"]) for _, f in r.xrange(f"{prefix}:scored")]
        taught = [s for s in scored if s.teacher_logprobs is not None]
        assert taught, "no turn was given a teacher"
        for s in taught:
            assert s.teacher_topk_ids is not None and {len(row) for row in s.teacher_topk_ids} == {TOPK}
            assert s.judge == ("experience" if mode == "oel" else "opd")
            assert (s.hint is None) == (mode == "oel") and (s.experience_ids is not None) == (mode == "oel")
        if mode == "oel":
            replays = [Replay.from_json(f["data"]) for _, f in r.xrange(f"{prefix}:replays")]
            assert {s.turn.session_id for s in taught} <= {p.session_id for p in replays}
            assert r.llen(f"{prefix}:experience:global") > 0
        assert r.xlen(f"{prefix}:dead") == 0
        states = {name: json.loads(v) for name, v in r.hgetall(f"{prefix}:services").items()}
        assert {name: s["restarts"] for name, s in states.items() if s["restarts"]} == {}
        print(json.dumps({"mode": mode, "answers": summary["turns"], "versions_trained": len(versions),
                          "taught": len(taught), "scored": len(scored),
                          "topk_kl": [round(c.metrics["topk_kl"], 4) for c in versions]}))
    finally:
        stack.stop()


def test_combine_trains_on_the_reward_and_the_teacher_at_once(tiny_model: Path, tmp_path: Path, unique: str) -> None:
    """The shortest run that goes round the loop once: a version trained on combine samples
    (a reward and teacher log-probs on the same sample), committed and served."""
    run = f"m-combine-{unique}"
    stack = UpStack(tiny_model, tmp_path / "home", run, run, env={"NEXTSTATE_WATCHER__POLL_INTERVAL_S": "0.5"},
                    args=["--mode", "combine", "--lr", "1e-3", "--batch-size", "8", "--max-wait", "3",
                          "--no-eval"]).start()  # fmt: skip
    try:
        env = {**os.environ, "NEXTSTATE_HOME": str(stack.home), "NEXTSTATE_RUN": run}
        demo = subprocess.run(
            [NEXTSTATE, "demo", "--url", stack.collector, "--task", "vowel", "--turns", "48", "--minutes", "3",
             "--max-tokens", "2", "--concurrency", "4", "--json", "--no-eval"],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert demo.returncode == 0, demo.stderr[-2000:]
        assert json.loads(demo.stdout.strip().splitlines()[-1])["errors"] == 0
        r = stack.redis()
        prefix = stack.prefix

        def served() -> list[PolicyLoaded]:  # a version the trainer committed, loaded by the watcher
            return [PolicyLoaded.from_json(f["data"]) for _, f in r.xrange(f"{prefix}:policy")]

        deadline = time.monotonic() + 180
        while not served() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert served(), f"no trained version served:\n{stack.logs()}"
        versions = [CheckpointPublished.from_json(f["data"]) for _, f in r.xrange(f"{prefix}:checkpoints")]
        assert versions and all(c.metrics["samples"] > c.metrics["skipped_samples"] for c in versions)
        scored = [ScoredTurn.from_json(f["data"]) for _, f in r.xrange(f"{prefix}:scored")]
        assert scored and all(s.mode == "combine" for s in scored)
        # The demo's corrections: a -1 from the rule judge and, on the same turn, the hint
        # teacher's log-probs; praise: a +1 alone.
        both = [s for s in scored if s.reward != 0 and s.teacher_logprobs is not None]
        assert both and all(s.hint for s in both), [(s.reward, s.hint) for s in scored]
        trained = [x for _, f in r.xrange(f"{prefix}:batches") for x in TrainBatch.from_json(f["data"]).samples]
        assert all(x.mode == "combine" for x in trained)
        assert any(x.reward != 0 and x.teacher_logprobs is not None for x in trained)  # both signals, one sample
        assert r.xlen(f"{prefix}:dead") == 0
        states = {name: json.loads(v) for name, v in r.hgetall(f"{prefix}:services").items()}
        assert {name: s["restarts"] for name, s in states.items() if s["restarts"]} == {}
        print(json.dumps({"mode": "combine", "scored": len(scored), "both_signals": len(both),
                          "versions": len(versions), "served": [p.version for p in served()]}))
    finally:
        stack.stop()
