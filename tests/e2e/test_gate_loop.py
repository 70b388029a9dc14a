"""Every version earns its place: `nextstate up --gate` with traffic, the real evaluator.

`nextstate up --gate` on a tiny model starts, beside the loop, the evaluation engine and
the evaluator; agents talk to the collector all along. The model is the tiny test model
steered so that most of its answers start with a vowel (tests/support/steered.py): the
demo suite's `vowel` task has something to lose. The base is evaluated first; versions
the trainer commits are evaluated (demo criterion and drift from the base) and promoted
by the watcher's gate, each compared with the best on the same held-out tasks. Then a
version that never starts with a vowel is published the way the trainer publishes
(files, manifest, LATEST, a `checkpoints` announcement): the evaluator scores it, the
gate refuses it on its *score* (McNemar against the best on the same tasks), and the
engine never serves it while the agents keep getting answers. `nextstate eval show
--json` lists the scored versions with their decisions and tests; `nextstate eval plot`
draws the learning curve from the base on.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from shared import checkpoints as ckpt
from shared.keys import Keys
from shared.schemas import CheckpointPublished, EvalResult, Promotion
from shared.settings import BucketSettings
from shared.store import Bucket
from tests.support.load import Load
from tests.support.steered import CONSONANTS, VOWELS, steer
from tests.support.upstack import NEXTSTATE, UpStack
from tests.support.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SETTINGS = {
    "NEXTSTATE_WATCHER__POLL_INTERVAL_S": "0.5",
    "NEXTSTATE_EVAL__SAMPLES": "12",
    "NEXTSTATE_EVAL__MAX_TOKENS": "4",
    "NEXTSTATE_EVAL__DEMO_TASK": "vowel",  # the tiny model's demo task
    # Lenient for honest versions of a tiny random model trained hard: only the score
    # (the paired test, at its default alpha) is to refuse the bad version.
    "NEXTSTATE_GATE__DRIFT_MAX": "1000",
    "NEXTSTATE_TRAINER__KEEP_VERSIONS": "1000",
    "NEXTSTATE_GATE__WAIT_S": "240",
}



def read(r: redis.Redis, key: str, model: Any) -> list[Any]:
    return [model.from_json(f["data"]) for _, f in r.xrange(key)]


async def test_a_version_worse_on_the_same_tasks_is_refused_and_never_served(
    tiny_model: Path, tmp_path: Path, unique: str
) -> None:
    model = steer(tiny_model, tmp_path / "model", VOWELS, 2.0)  # ~98 % of answers start with a vowel
    stack = UpStack(model, tmp_path / "home", run=f"gate-{unique}", prefix=f"g-{unique}",
                    args=["--gate", "--lr", "2e-3", "--batch-size", "8", "--max-wait", "3"], env=SETTINGS)
    await asyncio.to_thread(stack.start)
    keys = Keys(stack.prefix)
    load = Load(stack.collector, agents=3, turns=3).start()
    served_versions: list[int] = []
    try:
        def promoted() -> list[Promotion]:
            with stack.redis() as r:
                return [p for p in read(r, keys.promotions, Promotion) if p.decision == "promoted"]

        first = (await until(promoted, 300, "a version evaluated and promoted"))[0]

        def serving() -> int | None:
            v = stack.engine_version()
            if v is not None and v.isdigit():
                served_versions.append(int(v))
                return int(v)
            return None

        await until(lambda: (serving() or 0) >= first.version, 60, "the promoted version served")

        # A version that never starts with a vowel, published as the trainer would, above
        # every number in use.
        env = stack.bucket_env()
        settings = BucketSettings(endpoint=env["NEXTSTATE_BUCKET__ENDPOINT"], name=env["NEXTSTATE_BUCKET__NAME"],
                                  access_key=env["NEXTSTATE_BUCKET__ACCESS_KEY"],
                                  secret_key=env["NEXTSTATE_BUCKET__SECRET_KEY"])
        worse = steer(tiny_model, tmp_path / "consonant", CONSONANTS)
        with Bucket(settings) as bucket:
            bad = max(ckpt.all_versions(bucket, stack.run)) + 100_000  # far above the trainer's numbers
            ckpt.publish_checkpoint(bucket, stack.run, bad, worse, base_model=str(model))
        with stack.redis() as r:
            r.xadd(keys.checkpoints, {"data": CheckpointPublished(
                run=stack.run, version=bad, manifest=ckpt.manifest_key(stack.run, bad)).to_json()})
        t0 = time.time()

        def refused() -> Promotion | None:
            with stack.redis() as r:
                return next((p for p in read(r, keys.promotions, Promotion)
                             if p.version == bad and p.decision == "refused"), None)

        async def watch_engine() -> None:
            while not refused():
                serving()
                await asyncio.sleep(0.1)

        decision, _ = await asyncio.gather(until(refused, 300, "the gate's decision on it"), watch_engine())
        refused_at = time.time()

        def checked_at() -> float:
            with stack.redis() as r:
                return float(r.hget(keys.watcher_state, "checked_at") or 0)

        # And afterwards: two watcher passes (each asks the engine, then records checked_at in
        # watcher-state), the second begun after the refusal was on the stream.
        after = await until(lambda: (c := checked_at()) > refused_at and c, 60, "a watcher pass after it")
        await until(lambda: checked_at() > after, 60, "a second watcher pass after it")
        serving()
        with stack.redis() as r:
            assert r.hget(keys.watcher_state, "target_version") != str(bad)
        assert bad not in served_versions, "the worse version was served"
        # Refused on its score: worse than the best on the same tasks, at the stated confidence.
        test = decision.tests["demo"]
        assert test.test == "mcnemar_exact" and not test.passed, decision.reasons
        assert test.p_value is not None and test.alpha is not None and test.p_value < test.alpha
        assert test.n == 12 and test.lost and test.lost >= 5 and test.gained == 0 and (test.effect or 0) < 0
        assert decision.tests["drift"].passed  # the limit is lenient here: the score alone refused it
        assert await load.served_since(t0, n=20)  # users kept getting answers meanwhile
        with stack.redis() as r:
            evals = read(r, keys.evals, EvalResult)
        assert next(e for e in evals if e.version == bad and e.suite == "demo").score == 0.0
        assert {e.suite for e in evals if e.version == 0} == {"demo", "drift"}  # the base, scored

        # What an operator sees: scored versions with their decisions, and a learning curve.
        clean = {k: v for k, v in os.environ.items() if not k.startswith("NEXTSTATE_")}
        clean["NEXTSTATE_HOME"] = str(stack.home)
        out = subprocess.run([NEXTSTATE, "eval", "show", "--json"], env=clean, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        rows = {row["version"]: row for row in json.loads(out.stdout)["versions"]}
        assert rows[bad]["decision"] == "refused" and rows[first.version]["decision"] == "promoted"
        assert rows[bad]["tests"]["demo"]["p_value"] == test.p_value and 0 in rows
        assert {"demo", "drift"} <= set(rows[first.version]["suites"])
        # The demo's per-version success carries the evaluation beside it.
        demo = subprocess.run([NEXTSTATE, "demo", "--task", "vowel", "--turns", "6", "--max-tokens", "2",
                               "--concurrency", "2", "--json"], env=clean, capture_output=True, text=True,
                              timeout=180)
        assert demo.returncode == 0, demo.stderr[-2000:]
        by_version = json.loads(demo.stdout.strip().splitlines()[-1])["by_version"]
        assert any(row.get("eval", {}).get("decision") == "promoted" and "demo" in row["eval"]["suites"]
                   for row in by_version), by_version
        png = tmp_path / "curve.png"
        plot = subprocess.run([NEXTSTATE, "eval", "plot", "-o", str(png)], env=clean,
                              capture_output=True, text=True, timeout=120)
        assert plot.returncode == 0, plot.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    except BaseException:
        print(stack.logs(20_000))
        raise
    finally:
        await asyncio.wait_for(load.stop(), 300)
        await asyncio.to_thread(stack.stop)
