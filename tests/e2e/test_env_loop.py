"""The closed loop of environments (track 2), as a user runs it: `nextstate up --envs 3` +
`nextstate envs run`, real processes only.

`nextstate up` starts its own Redis and SeaweedFS, the engine on the tiny random model,
collector, rule judge, buffer, trainer, watcher and 3 envs workers. The environment is
the deliberately easy `tests.support.vowel_env:VowelEnv`: one answer per episode (2
tokens), reward 1 when it starts with a vowel — which the random model does by chance
some of the time. Groups of 4 episodes per task with `group_norm` advantages train the
policy on outcome rewards alone (the judge's scores are ignored in `outcome` mode).
`nextstate envs run` is repeated (each a new set of groups) until enough versions were
trained, or the time budget is spent. Then, from the `outcomes` stream, each episode is
placed by the policy version that answered it: the success rate of the last episodes
(the newest versions) must clearly exceed that of the first ones (the base policy and
its first updates).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from shared.schemas import Outcome, PolicyLoaded, TrainBatch, Turn
from tests.support.servers import REPO
from tests.support.upstack import NEXTSTATE, UpStack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ENV = "tests.support.vowel_env:VowelEnv"
TARGET_VERSIONS = 90  # stop once this many versions were loaded ...
BUDGET_S = 150  # ... or after this long running episodes
EARLY, LATE = 100, 200  # episodes compared: the first (oldest versions) and the last (newest)
MARGIN = 0.30  # success must rise by at least this much (measured here: +40 points at 60 versions, +71 to +81 at 90)


def rate(outcomes: list[Outcome]) -> float:
    return sum(o.passed for o in outcomes) / len(outcomes)


def version_of(o: Outcome) -> int:
    """The version that gave the episode's answer (the first to answer in it)."""
    return o.policy_versions[0]


def test_environment_success_rises_as_versions_advance(tiny_model: Path, unique: str, tmp_path: Path) -> None:
    stack = UpStack(
        model=tiny_model, home=tmp_path / "home", run=f"envloop-{unique}", prefix=f"envloop-{unique}",
        args=["--lr", "2e-3", "--batch-size", "8", "--max-wait", "3", "--no-eval", "--envs", "3"],
        env={"NEXTSTATE_WATCHER__POLL_INTERVAL_S": "0.5", "NEXTSTATE_ENVS__MAX_TOKENS": "2",
             "NEXTSTATE_ENVS__MAX_STEPS": "1", "NEXTSTATE_BUFFER__GROUP_ADVANTAGE": "group_norm"},
    )
    env = {**os.environ, "NEXTSTATE_HOME": str(stack.home), "NEXTSTATE_RUN": stack.run,
           "NEXTSTATE_REDIS__PREFIX": stack.prefix}
    env.pop("NEXTSTATE_REDIS__URL", None)  # the CLI finds the stack's Redis in its record
    try:
        stack.start()
        r = stack.redis()
        started, runs, episodes = time.monotonic(), 0, 0
        while r.xlen(f"{stack.prefix}:policy") < TARGET_VERSIONS and time.monotonic() - started < BUDGET_S:
            out = subprocess.run(
                [NEXTSTATE, "envs", "run", ENV, "--tasks", "10", "--group", "4", "--seed", str(runs),
                 "--timeout", "60", "--retries", "1", "--json"],
                env=env, cwd=REPO, capture_output=True, text=True, timeout=240,
            )
            assert out.returncode == 0, out.stderr[-3000:] + stack.logs()
            summary = json.loads(out.stdout.strip().splitlines()[-1])
            if summary["failures"]:
                errors = {o.error for _, f in r.xrange(f"{stack.prefix}:outcomes")
                          if (o := Outcome.from_json(f["data"])).error}
                raise AssertionError(f"failed episodes: {errors}\n{stack.logs()}")
            assert summary["episodes"] == 40, summary
            runs, episodes = runs + 1, episodes + summary["episodes"]
        elapsed = time.monotonic() - started

        outcomes = [Outcome.from_json(f["data"]) for _, f in r.xrange(f"{stack.prefix}:outcomes")]
        loaded = [PolicyLoaded.from_json(f["data"]) for _, f in r.xrange(f"{stack.prefix}:policy")]
        assert len(outcomes) == episodes and all(o.error is None and o.steps == 1 for o in outcomes)
        assert len(loaded) >= 10, f"only {len(loaded)} versions loaded in {elapsed:.0f}s"
        # The policy that answered moved on: episodes ran on many versions, the newest among them.
        by_version = sorted(outcomes, key=version_of)  # stable: stream order within a version
        assert version_of(by_version[-1]) >= loaded[len(loaded) // 2].version
        # What trained were the episodes' turns, with their group_norm outcome advantages.
        samples = [s for _, f in r.xrange(f"{stack.prefix}:batches") for s in TrainBatch.from_json(f["data"]).samples]
        assert samples and all(s.session_id.startswith("env:") and not s.forced for s in samples)
        assert any(s.reward > 0 for s in samples) and any(s.reward < 0 for s in samples)
        turns = [Turn.from_json(f["data"]) for _, f in r.xrange(f"{stack.prefix}:turns", count=50)]
        assert all(t.policy_version == int(t.weight_version) for t in turns)
        assert r.xlen(f"{stack.prefix}:dead") == 0

        early, late = by_version[:EARLY], by_version[-LATE:]
        before, after = rate(early), rate(late)
        print(f"envs loop: {episodes} episodes in {runs} runs, {elapsed:.0f}s, {len(loaded)} versions loaded; "
              f"success of the first {len(early)} episodes (v{version_of(early[0])}-v{version_of(early[-1])}) "
              f"{before:.1%} -> the last {len(late)} (v{version_of(late[0])}-v{version_of(late[-1])}) {after:.1%}")
        assert after >= before + MARGIN, f"no clear improvement: {before:.1%} -> {after:.1%}"
    finally:
        rc = stack.stop(timeout=90)
    assert rc == 0, stack.logs()
