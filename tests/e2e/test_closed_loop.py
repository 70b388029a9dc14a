"""The closed loop, as a user runs it: `nextstate up` + `nextstate demo`, real processes only.

`nextstate up` starts SeaweedFS, the engine (tiny random model), collector, judge (rule
judge), buffer, trainer and watcher; Redis is this test session's own server, given
through NEXTSTATE_REDIS__URL (the "configured endpoint" path), so the test can read the
streams. `nextstate demo --task vowel` plays a user who praises answers that start with
a vowel and corrects the others, through the official openai SDK. Within a few minutes
on 2 cores the policy version must advance at least 3 times, new turns must carry the
new weight_version, and the rewarded behaviour must become measurably more frequent.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from shared.schemas import PolicyLoaded, Turn
from tests.support.servers import REPO, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NEXTSTATE = str(Path(sys.executable).parent / "nextstate")


def rate(rows: list[dict[str, float]]) -> float:
    turns = sum(r["turns"] for r in rows)
    return sum(r["turns"] * r["success_rate"] for r in rows) / turns


def test_policy_improves_from_live_traffic(tiny_model: Path, redis_url: str, unique: str, tmp_path: Path) -> None:
    prefix = f"e2e-{unique}"
    port = free_port()
    env = {
        **os.environ,
        "NEXTSTATE_HOME": str(tmp_path / "home"),
        "NEXTSTATE_RUN": f"e2e-{unique}",
        "NEXTSTATE_REDIS__URL": redis_url,
        "NEXTSTATE_REDIS__PREFIX": prefix,
        "NEXTSTATE_WATCHER__POLL_INTERVAL_S": "0.5",
    }
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen(
        [NEXTSTATE, "up", "--model", str(tiny_model), "--port", str(port), "--lr", "2e-3",
         "--batch-size", "8", "--max-wait", "3", "--no-eval"],
        env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        while "OpenAI endpoint" not in (tmp_path / "up.log").read_text(errors="replace"):
            assert up.poll() is None, (tmp_path / "up.log").read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, "the stack did not come up"
            time.sleep(0.5)
        # The rewarded behaviour: the first ~150 answers (the base policy and its first
        # updates) against the last ~300. The demo runs in rounds of 600 answers until the
        # late rate shows the improvement or the budget is spent: the engine answers 2-token
        # questions faster than a busy machine trains, so a fixed number of answers may end
        # before the trainer has caught up.
        def span(rs: list[dict[str, float]], n: int) -> list[dict[str, float]]:
            out: list[dict[str, float]] = []
            for row in rs:
                out.append(row)
                if sum(x["turns"] for x in out) >= n:
                    break
            return out

        budget = time.monotonic() + 300
        first: list[dict[str, float]] | None = None
        answers = rounds = 0
        while True:
            demo = subprocess.run(
                [NEXTSTATE, "demo", "--url", f"http://127.0.0.1:{port}/v1", "--task", "vowel",
                 "--turns", "600", "--minutes", "3", "--max-tokens", "2", "--concurrency", "4", "--json"],
                env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
            )
            assert demo.returncode == 0, demo.stderr[-2000:]
            summary = json.loads(demo.stdout.strip().splitlines()[-1])
            assert summary["errors"] == 0
            rows, rounds, answers = summary["by_version"], rounds + 1, answers + summary["turns"]
            first = first or rows
            early, late = span(first, 150), span(list(reversed(rows)), 300)
            before, after = rate(early), rate(late)
            if after >= before + 0.10 or time.monotonic() > budget:
                break

        r = redis.Redis.from_url(redis_url, decode_responses=True)
        loaded = [PolicyLoaded.from_json(f["data"]) for _, f in r.xrange(f"{prefix}:policy")]
        assert len(loaded) >= 3, f"only {len(loaded)} versions loaded"
        turns = [Turn.from_json(f["data"]) for _, f in r.xrange(f"{prefix}:turns")]
        served = {int(t.weight_version) for t in turns}
        assert max(served) >= loaded[2].version, "new turns do not carry the new weight_version"
        assert all(t.policy_version == int(t.weight_version) for t in turns)
        assert r.xlen(f"{prefix}:dead") == 0
        print(f"success: first {sum(x['turns'] for x in early)} answers {before:.1%} -> last "
              f"{sum(x['turns'] for x in late)} {after:.1%}; versions loaded {len(loaded)}; "
              f"{answers} answers in {rounds} demo rounds")
        assert after >= before + 0.10, f"no measurable improvement: {before:.1%} -> {after:.1%}"
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(90)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(10)
        log.close()
    assert up.returncode == 0, (tmp_path / "up.log").read_text(errors="replace")[-4000:]
