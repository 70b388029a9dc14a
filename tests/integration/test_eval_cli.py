"""`nextstate eval show | plot | run` and `tail evals | promotions` as a user runs them,
against a real Redis and bucket holding what the evaluator and the gate write."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
from rq import Queue

from shared import checkpoints as ckpt
from shared.evaljobs import rq_connection, rq_job_id
from shared.schemas import EvalResult, Promotion, TrainBatch, TrainSample, eval_job_id
from shared.settings import Settings
from shared.store import Bucket
from shared.streams import Bus
from tests.integration.test_ctl import run

pytestmark = pytest.mark.integration


def result(run_name: str, version: int, suite: str, score: float, n: int = 32, rerun: str = "") -> EvalResult:
    return EvalResult(id=eval_job_id(run_name, version, suite) + rerun, run=run_name, version=version,
                      suite=suite, score=score, n=n, higher_is_better=suite != "drift",
                      ci_low=score - 0.1, ci_high=score + 0.1)


def batch(run_name: str, version: int, rewards: list[float]) -> TrainBatch:
    return TrainBatch(run=run_name, samples=[
        TrainSample(session_id="s", tokens=[1, 2, 3], response_length=1, loss_mask=[1], reward=r,
                    policy_version=version) for r in rewards])


async def fill(settings: Settings) -> None:
    """v0..v3 evaluated on the stream (v3 twice, the second larger), v4's demo only in the
    bucket; the gate promoted v1, refused v2, promoted then rolled back v3; batches for v0..v3."""
    name = settings.run
    async with Bus(settings) as bus:
        for v, demo, drift in ((0, 0.5, 0.0), (1, 0.6, 0.1), (2, 0.0, 50.0), (3, 0.7, 0.2)):
            await bus.publish("evals", result(name, v, "demo", demo))
            await bus.publish("evals", result(name, v, "drift", drift))
        await bus.publish("evals", result(name, 3, "demo", 0.3, n=256, rerun=".n256"))
        await bus.publish("evals", result("another-run", 1, "demo", 0.99))
        decisions = [(1, "promoted", ["demo 0.6 >= best 0.5 - 0.05"], 1),
                     (2, "refused", ["demo 0 < best 0.6 - 0.05", "drift 50 > limit 1"], 1),
                     (3, "promoted", ["demo 0.7 >= best 0.6 - 0.05"], 3),
                     (3, "rolled_back", ["fails on re-evaluation", "demo 0.3 < best 0.6 - 0.05"], 1)]
        for v, decision, reasons, serving in decisions:
            await bus.publish("promotions", Promotion(run=name, version=v, decision=decision,  # type: ignore[arg-type]
                                                      reasons=reasons, serving=serving))
        await bus.redis.hset(bus.keys.gate_state, mapping={
            "promoted": "[1]", "best": '{"demo": 0.6}', "serving": "1", "decided_at": str(time.time()),
            "config": json.dumps({"suites": ["demo", "drift"], "delta": 0.05, "drift_max": 1.0,
                                  "wait_s": 1800})})
        for v, rewards in ((0, [-1, 0, 1, -1]), (1, [1, 1, -1]), (2, [1, 1, 1, 0]), (3, [1, -1])):
            await bus.publish("batches", batch(name, v, rewards))
    with Bucket(settings.bucket) as bucket:
        bucket.put_json(ckpt.eval_key(name, 4, "demo"), result(name, 4, "demo", 0.65))


async def test_eval_show_lists_versions_with_scores_and_decisions(
    s3_settings: Settings, s3_env: dict[str, str],
) -> None:
    await fill(s3_settings)
    out = run(s3_env, "eval", "show", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["run"] == s3_settings.run
    assert data["gate"]["promoted"] == [1] and data["gate"]["serving"] == 1
    rows = {row["version"]: row for row in data["versions"]}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    assert [rows[v]["decision"] for v in range(5)] == [None, "promoted", "refused", "rolled_back", None]
    assert rows[2]["reasons"] == ["demo 0 < best 0.6 - 0.05", "drift 50 > limit 1"]
    assert rows[1]["suites"]["demo"] == {**rows[1]["suites"]["demo"], "score": 0.6, "n": 32,
                                         "ci_low": pytest.approx(0.5), "ci_high": pytest.approx(0.7)}
    assert rows[3]["suites"]["demo"]["score"] == 0.3 and rows[3]["suites"]["demo"]["n"] == 256
    assert rows[4]["suites"] == {"demo": rows[4]["suites"]["demo"]}  # from the bucket only
    assert rows[4]["suites"]["demo"]["score"] == 0.65

    text = run(s3_env, "eval", "show")
    assert text.returncode == 0, text.stderr
    assert "gate: serving v1, promoted v1" in text.stdout
    line = next(ln for ln in text.stdout.splitlines() if ln.startswith("v2 "))
    assert "refused" in line and "demo 0 [-0.1, 0.1] n=32" in line and "drift 50" in line
    assert "why: demo 0 < best 0.6 - 0.05; drift 50 > limit 1" in text.stdout


async def test_eval_plot_writes_a_png(s3_settings: Settings, s3_env: dict[str, str], tmp_path: Path) -> None:
    await fill(s3_settings)
    png = tmp_path / "plots" / "curve.png"
    out = run(s3_env, "eval", "plot", "-o", str(png), timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"wrote {png} (5 evaluated version(s), 4 policy version(s)" in out.stdout
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (900, 780)  # three panels: demo, drift, the training reward
    assert len(data) > 30_000  # curves, markers, labels: not an empty canvas

    empty = run({**s3_env, "NEXTSTATE_RUN": "nothing-here"}, "eval", "plot", "-o", str(tmp_path / "x.png"))
    assert empty.returncode == 1 and "nothing to plot for run nothing-here" in empty.stderr


async def test_eval_run_enqueues_a_larger_evaluation(
    s3_settings: Settings, s3_env: dict[str, str], tmp_path: Path,
) -> None:
    name = s3_settings.run
    folder = tmp_path / "v3"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with Bucket(s3_settings.bucket) as bucket:
        ckpt.publish_checkpoint(bucket, name, 3, folder, step=3)
    out = run(s3_env, "eval", "run", "3", "--samples", "256")
    assert out.returncode == 0, out.stderr
    jobs = [f"eval.{name}.v000003.{suite}.n256" for suite in ("demo", "drift")]
    assert [ln.split()[1].rstrip(":") for ln in out.stdout.splitlines() if ln.startswith("enqueued")] == jobs
    conn = rq_connection(s3_settings.redis.url)
    try:
        queue = Queue(f"{s3_settings.redis.prefix}-eval", connection=conn)
        assert sorted(queue.job_ids) == [rq_job_id(j) for j in jobs]
        assert queue.fetch_job(rq_job_id(jobs[0])).kwargs == {"run": name, "version": 3, "suite": "demo", "samples": 256}
    finally:
        conn.close()

    missing = run(s3_env, "eval", "run", "99", "--suite", "demo")
    assert missing.returncode == 1 and f"run {name} has no committed v99" in missing.stderr


async def test_tail_shows_eval_results_and_promotions(s3_settings: Settings, s3_env: dict[str, str]) -> None:
    await fill(s3_settings)
    evals = run(s3_env, "tail", "evals", "-n", "1").stdout
    assert "eval_result" in evals and "suite=demo score=0.99" in evals and "higher-is-better" in evals
    promos = run(s3_env, "tail", "promotions", "-n", "4").stdout.splitlines()
    assert len(promos) == 4
    assert "version=2 decision=refused serving=1 reasons='demo 0 < best 0.6 - 0.05; drift 50 > limit 1'" in promos[1]
    assert "decision=rolled_back" in promos[3]
    status = run(s3_env, "status", "--window", "0")
    assert status.returncode == 0, status.stderr
    assert "gate: serving v1, promoted v1, best demo 0.6" in status.stdout
    assert "last decision: v3 rolled_back" in status.stdout
