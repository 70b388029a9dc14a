"""The promotion gate against real processes: SeaweedFS, Redis, the CPU engine, the watcher
with NEXTSTATE_GATE__ENABLED.

The paired test, end to end with the real evaluator (its `demo` suite on the `vowel` task,
an evaluation engine of its own): the base is scored first; a version whose answers all
start with a vowel is promoted over it; one whose answers never do — worse on the very
same tasks — is refused on its score (McNemar, its p-value, n and effect in the
`Promotion`) and never served; one equal to the best is promoted.

In the other tests the test plays the evaluator: it publishes `EvalResult`s on `evals` as
the evaluator's workers would (summary scores without tasks: the gate's threshold).

A deliberately broken version (scrambled weights, a failing demo score, a huge drift) is
refused and never served while a client keeps getting answers; a better version is
promoted and served; a larger re-evaluation that finds the served version worse rolls it
back (engine on the previous version, `Promotion` rolled_back, the trainer's rebase
request, LATEST moved back). A version without results is refused as unevaluated after
WAIT_S; the gate's memory survives a watcher restart next to a restarted engine, and
results published while it was down are still taken. With the gate off nothing changes.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from shared import checkpoints as ckpt
from shared.gate_view import GateView, gate_view
from shared.schemas import CheckpointPublished, EvalResult, PolicyLoaded, Promotion, eval_job_id
from shared.settings import Settings
from shared.store import Bucket
from shared.streams import Bus
from tests.integration.test_watcher import (  # noqa: F401  (fixtures)
    AUTH,
    TOKEN,
    engine,
    engine_proc,
    metric,
    models,
    ops_url,
    restart_engine,
    weight_version,
)
from tests.support.servers import ServiceProcess, free_port
from tests.support.steered import CONSONANTS, VOWELS, steer
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

DRIFT_MAX = 1.0


def scrambled(src: Path, dest: Path) -> Path:
    """A copy of the model folder `src` whose every weight tensor is shuffled: loads fine,
    answers garbage."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    weights = dest / "model.safetensors"
    gen = torch.Generator().manual_seed(7)
    tensors = load_file(str(weights))
    out = {k: t.flatten()[torch.randperm(t.numel(), generator=gen)].reshape(t.shape) * 10
           for k, t in tensors.items()}
    save_file(out, str(weights), metadata={"format": "pt"})
    return dest


def gated_watcher(engine_url: str, s3_env: dict[str, str], local_dir: Path, wait_s: float = 3600,
                  suites: tuple[str, ...] = ("demo", "drift")) -> ServiceProcess:
    env = {
        **s3_env,
        "NEXTSTATE_WATCHER__ENGINE_URL": engine_url,
        "NEXTSTATE_WATCHER__POLL_INTERVAL_S": "0.2",
        "NEXTSTATE_WATCHER__LOCAL_DIR": str(local_dir),
        "NEXTSTATE_WATCHER__RETRY_BAD_AFTER_S": "3600",
        "NEXTSTATE_WATCHER__PORT": str(free_port()),
        "NEXTSTATE_INTERNAL__TOKEN": TOKEN,
        "NEXTSTATE_GATE__ENABLED": "true",
        "NEXTSTATE_GATE__SUITES": json.dumps(list(suites)),
        "NEXTSTATE_GATE__DELTA": "0.05",
        "NEXTSTATE_GATE__DRIFT_MAX": str(DRIFT_MAX),
        "NEXTSTATE_GATE__WAIT_S": str(wait_s),
    }
    proc = ServiceProcess("watcher", env).start()
    proc.wait_http(ops_url(proc, "readyz"), timeout=60)
    return proc


class Client:
    """Sends /generate to the engine throughout, noting each answer's weight version."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.versions: Counter[str] = Counter()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with httpx.Client(headers=AUTH, timeout=60) as http:
            while not self._stop.is_set():
                try:
                    r = http.post(f"{self.url}/generate", json={
                        "input_ids": [5, 60, 7, 80], "sampling_params": {"max_new_tokens": 2}})
                    if r.status_code == 200:
                        self.versions[str(r.json()["meta_info"]["weight_version"])] += 1
                    else:
                        self.failures.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                self._stop.wait(0.05)

    def __enter__(self) -> Client:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


async def evaluated(bus: Bus, run: str, version: int, *, demo: float, drift: float,
                    n: int = 32, rerun: str = "") -> None:
    """Publish the demo and drift results of `version`, as the evaluator would."""
    for suite, score, higher in (("demo", demo, True), ("drift", drift, False)):
        await bus.publish("evals", EvalResult(
            id=eval_job_id(run, version, suite) + rerun, run=run, version=version, suite=suite,
            score=score, higher_is_better=higher, n=n, ci_low=score - 0.05, ci_high=score + 0.05))


async def promotions(bus: Bus, at_least: int = 0) -> list[Promotion] | None:
    rows = await bus.redis.xrange(bus.keys.promotions)
    got = [Promotion.from_json(f["data"]) for _, f in rows]
    return got if len(got) >= at_least else None


async def loads(bus: Bus) -> list[PolicyLoaded]:
    return [PolicyLoaded.from_json(f["data"]) for _, f in await bus.redis.xrange(bus.keys.policy)]


async def loads_until(bus: Bus, version: int, count: int | None = None) -> list[PolicyLoaded]:
    """The `policy` stream once its last entry announces `version` (and it holds `count`
    entries): the engine answers with the new version a moment before the watcher records it."""
    async def ready() -> list[PolicyLoaded] | None:
        got = await loads(bus)
        ok = bool(got) and got[-1].version == version and (count is None or len(got) == count)
        return got if ok else None
    return await eventually(ready, 10, f"PolicyLoaded v{version}")  # type: ignore[no-any-return]


async def gate_record(bus: Bus, version: int) -> dict[str, object] | None:
    raw = await bus.redis.hget(bus.keys.gate_state, f"version:{version}")
    return None if raw is None else dict(json.loads(raw))


async def gate_view_of(bus: Bus) -> GateView | None:
    return gate_view(await bus.redis.hgetall(bus.keys.gate_state))


@pytest.fixture
def watch_dir(tmp_path: Path) -> Path:
    return tmp_path / "ckpts"


async def test_broken_refused_better_promoted_worse_rolled_back(
    s3_settings: Settings, s3_env: dict[str, str], engine: str, models: dict[str, Path],  # noqa: F811
    watch_dir: Path, tmp_path: Path,
) -> None:
    run = s3_settings.run
    bad = scrambled(models["b"], tmp_path / "scrambled")
    watcher = gated_watcher(engine, s3_env, watch_dir)
    try:
        with Bucket(s3_settings.bucket) as bucket, Client(engine) as client:
            async with Bus(s3_settings) as bus:
                # The gate records its rule as it starts, before any decision: the trainer's
                # retention keeps what it has yet to decide on from the first version on.
                view = await eventually(lambda: gate_view_of(bus), 30, "the gate's rule recorded")
                assert view.decided == frozenset() and view.wait_s > 0
                await evaluated(bus, run, 0, demo=0.5, drift=0.0)  # the base model's scores

                # v1, committed but not yet evaluated: the engine stays on its base weights.
                ckpt.publish_checkpoint(bucket, run, 1, models["b"], step=1)
                await eventually(lambda: gate_record(bus, 1), 30, "the gate seeing v1")
                assert weight_version(engine) == "0"
                await evaluated(bus, run, 1, demo=0.6, drift=0.1)
                await eventually(lambda: weight_version(engine) == "1", 60, "v1 promoted and served")
                (p1,) = await promotions(bus) or []
                assert (p1.version, p1.decision, p1.serving) == (1, "promoted", 1)
                assert p1.baseline == {"demo": 0.5} and p1.scores == {"demo": 0.6, "drift": 0.1}
                (loaded,) = await loads_until(bus, 1, 1)
                assert loaded.version == 1 and loaded.promotion == \
                    "promoted: demo 0.6 >= best 0.5 - 0.05; drift 0.1 <= limit 1"

                # v2: scrambled weights, a failing demo score and a huge drift. Refused, never served.
                ckpt.publish_checkpoint(bucket, run, 2, bad, step=2)
                await evaluated(bus, run, 2, demo=0.0, drift=50.0)
                p2 = (await eventually(lambda: promotions(bus, 2), 30, "v2 decided"))[-1]
                assert (p2.version, p2.decision, p2.serving) == (2, "refused", 1)
                assert p2.reasons == ["demo 0 < best 0.6 - 0.05", "drift 50 > limit 1"]
                state = await eventually(lambda: _watcher_state(bus, latest_version="2", target_version="1"),
                                         10, "watcher-state: LATEST v2, target v1")
                assert state["engine_version"] == "1" and state["mismatch"] == "0"
                assert weight_version(engine) == "1"

                # v3 is better: promoted and served.
                ckpt.publish_checkpoint(bucket, run, 3, models["c"], step=3)
                await evaluated(bus, run, 3, demo=0.7, drift=0.2)
                await eventually(lambda: weight_version(engine) == "3", 60, "v3 promoted and served")
                assert (await loads_until(bus, 3))[-1].promotion == \
                    "promoted: demo 0.7 >= best 0.6 - 0.05; drift 0.2 <= limit 1"

                # A larger re-evaluation finds v3 worse: back to v1, the trainer asked to rebase on it.
                await evaluated(bus, run, 3, demo=0.3, drift=0.2, n=256, rerun=".n256")
                await eventually(lambda: weight_version(engine) == "1", 60, "rolled back to v1")
                back = (await eventually(lambda: promotions(bus, 4), 10, "the rollback announced"))[-1]
                assert (back.version, back.decision, back.serving) == (3, "rolled_back", 1)
                assert back.reasons == ["fails on re-evaluation", "demo 0.3 < best 0.6 - 0.05",
                                        "drift 0.2 <= limit 1"]
                lineage = json.loads(await bus.redis.get(bus.keys.lineage))
                assert lineage["base"] == 1 and lineage["by"] == "gate"
                latest = ckpt.read_latest(bucket, run)
                assert latest is not None and latest.version == 1
                assert (await loads_until(bus, 1))[-1].cause == "new_version"

                gate = await bus.redis.hgetall(bus.keys.gate_state)
                assert json.loads(gate["promoted"]) == [1] and gate["serving"] == "1"
                assert json.loads(gate["best"]) == {"demo": 0.6}
                assert json.loads(gate["version:3"])["decision"] == "rolled_back"
                assert metric(watcher, "nextstate_gate_decisions_total", decision="promoted") == 2
                assert metric(watcher, "nextstate_gate_decisions_total", decision="refused") == 1
                assert metric(watcher, "nextstate_gate_decisions_total", decision="rolled_back") == 1
                assert metric(watcher, "nextstate_gate_promoted_version") == 1
        assert not client.failures, client.failures[:5]
        assert "2" not in client.versions and {"0", "1", "3"} <= set(client.versions), client.versions
    finally:
        assert watcher.stop() == 0, watcher.logs()
    assert "Traceback" not in watcher.logs(100_000)


async def test_a_version_worse_on_the_same_tasks_is_refused_an_equal_one_promoted(
    s3_settings: Settings, s3_env: dict[str, str], engine: str, models: dict[str, Path],  # noqa: F811
    watch_dir: Path, tmp_path: Path,
) -> None:
    run, base = s3_settings.run, models["a"]  # `engine` serves models["a"]
    vowel = steer(base, tmp_path / "vowel", VOWELS)  # every answer starts with a vowel
    consonant = steer(base, tmp_path / "consonant", CONSONANTS)  # none does
    eval_port = free_port()
    eval_engine = ServiceProcess("engine", {**s3_env, "NEXTSTATE_INTERNAL__TOKEN": TOKEN},
                                 ["--model", str(base), "--port", str(eval_port)]).start()
    evaluator = ServiceProcess("evaluator", {
        **s3_env, "NEXTSTATE_INTERNAL__TOKEN": TOKEN,
        "NEXTSTATE_EVAL__ENGINE_URL": f"http://127.0.0.1:{eval_port}",
        "NEXTSTATE_EVAL__SUITES": '["demo"]', "NEXTSTATE_EVAL__DEMO_TASK": "vowel",
        "NEXTSTATE_EVAL__SAMPLES": "16", "NEXTSTATE_EVAL__MAX_TOKENS": "3",
        "NEXTSTATE_EVAL__BASE_MODEL": str(base), "NEXTSTATE_EVAL__TOKENIZER": str(base),
        "NEXTSTATE_EVAL__LOCAL_DIR": str(tmp_path / "eval-checkpoints"),
        "NEXTSTATE_EVAL__PORT": str(free_port()), "NEXTSTATE_EVAL__CONSUMER_NAME": "evaluator-paired",
        "NEXTSTATE_EVAL__MAINTENANCE_S": "1",
    })
    watcher = None
    try:
        eval_engine.wait_http(f"http://127.0.0.1:{eval_port}/health", timeout=120)
        evaluator.start().wait_http(f"http://127.0.0.1:{evaluator.env['NEXTSTATE_EVAL__PORT']}/readyz", timeout=90)
        watcher = gated_watcher(engine, s3_env, watch_dir, suites=("demo",))
        with Bucket(s3_settings.bucket) as bucket, Client(engine) as client:
            async with Bus(s3_settings) as bus:
                async def decided(version: int) -> Promotion | None:
                    return next((p for p in await promotions(bus) or [] if p.version == version), None)

                async def commit(version: int, folder: Path) -> Promotion:
                    ckpt.publish_checkpoint(bucket, run, version, folder, step=version, base_model=str(base))
                    await bus.publish("checkpoints", CheckpointPublished(
                        run=run, version=version, step=version, manifest=ckpt.manifest_key(run, version)))
                    return await eventually(lambda: decided(version), 120, f"v{version} decided")  # type: ignore[no-any-return]

                # The base, evaluated first without being asked: it never starts with a vowel.
                base_result = await eventually(lambda: _result(bus, 0), 120, "the base's result")
                assert (base_result.score, base_result.n) == (0.0, 16)

                p1 = await commit(1, vowel)  # 16 gained: promoted over the base, served
                assert (p1.decision, p1.baseline, p1.scores) == ("promoted", {"demo": 0.0}, {"demo": 1.0})
                t1 = p1.tests["demo"]
                assert (t1.test, t1.n, t1.lost, t1.gained, t1.against, t1.p_value) == \
                    ("mcnemar_exact", 16, 0, 16, 0, 1.0)
                await eventually(lambda: weight_version(engine) == "1", 60, "v1 served")

                p2 = await commit(2, consonant)  # worse on the very same 16 tasks: refused on its score
                t2 = p2.tests["demo"]
                assert (p2.decision, p2.serving, p2.schema_version) == ("refused", 1, 2)
                assert (t2.test, t2.passed, t2.n, t2.lost, t2.gained, t2.effect, t2.against) == \
                    ("mcnemar_exact", False, 16, 16, 0, -1.0, 1)
                assert t2.p_value == 2.0**-16 and t2.alpha == 0.05
                assert p2.reasons == ["demo 0 vs v1 1: 16 lost, 0 gained of 16 paired tasks, "
                                      "McNemar p=1.53e-05 < 0.05: worse"]

                p3 = await commit(3, vowel)  # the same answers as the best: not worse, promoted
                assert (p3.decision, p3.tests["demo"].p_value, p3.tests["demo"].effect) == ("promoted", 1.0, 0.0)
                await eventually(lambda: weight_version(engine) == "3", 60, "v3 served")
                # The client's own answers say so too (on a busy host it may have sent none since).
                await eventually(lambda: client.versions["3"] > 0, 60, "an answer under v3")
                # What the operator sees: the decision with its test.
                row = json.loads((await bus.redis.hgetall(bus.keys.gate_state))["version:2"])
                assert row["decision"] == "refused" and row["tests"]["demo"]["p_value"] == 2.0**-16
        assert not client.failures, client.failures[:5]
        assert "2" not in client.versions and {"1", "3"} <= set(client.versions), client.versions
    finally:
        for proc in (watcher, evaluator, eval_engine):
            if proc is not None:
                proc.stop()
    assert "Traceback" not in evaluator.logs(100_000), evaluator.logs(20_000)


async def _result(bus: Bus, version: int) -> EvalResult | None:
    rows = await bus.redis.xrange(bus.keys.evals)
    return next((r for r in (EvalResult.from_json(f["data"]) for _, f in rows) if r.version == version), None)


async def _watcher_state(bus: Bus, checked_after: float = 0.0, **want: str) -> dict[str, str] | None:
    state = dict(await bus.redis.hgetall(bus.keys.watcher_state))
    if not state or float(state["checked_at"]) < checked_after:
        return None
    return state if all(state.get(k) == v for k, v in want.items()) else None


async def test_unevaluated_refused_and_the_gate_survives_a_restart(
    s3_settings: Settings, s3_env: dict[str, str], engine_proc: ServiceProcess, engine: str,  # noqa: F811
    models: dict[str, Path], watch_dir: Path, tmp_path: Path,  # noqa: F811
) -> None:
    run = s3_settings.run
    watcher = gated_watcher(engine, s3_env, watch_dir, wait_s=3)
    try:
        with Bucket(s3_settings.bucket) as bucket:
            async with Bus(s3_settings) as bus:
                # No base scores: the first version passes on the drift limit alone.
                ckpt.publish_checkpoint(bucket, run, 1, models["b"], step=1)
                await evaluated(bus, run, 1, demo=0.4, drift=0.3)
                await eventually(lambda: weight_version(engine) == "1", 60, "v1 served")
                (p1,) = await promotions(bus) or []
                assert p1.reasons == ["demo 0.4 (no baseline yet)", "drift 0.3 <= limit 1"]

                # v2 gets no results within WAIT_S: refused as unevaluated, v1 kept.
                ckpt.publish_checkpoint(bucket, run, 2, models["c"], step=2)
                p2 = (await eventually(lambda: promotions(bus, 2), 30, "v2 refused"))[-1]
                assert (p2.version, p2.decision, p2.serving) == (2, "refused", 1)
                assert p2.reasons == ["unevaluated: no demo, drift result within 3s"]
                assert weight_version(engine) == "1"

                # Both restart: a fresh watcher (nothing on its disk) next to an engine on its base
                # weights. LATEST is v2, refused: the gate's memory puts v1 back, not v2, not "0".
                assert watcher.stop() == 0, watcher.logs()
                restart_engine(engine_proc)
                assert weight_version(engine) == "0"
                watcher.env["NEXTSTATE_WATCHER__LOCAL_DIR"] = str(tmp_path / "fresh")
                watcher.start()
                await eventually(lambda: weight_version(engine) == "1", 60, "v1 back after the restart")
                since = time.time()
                await eventually(lambda: _watcher_state(bus, engine_version="1", target_version="1",
                                                        latest_version="2", checked_after=since + 1.0),
                                 10, "passes after the restart")  # about five: v2 is never tried
                assert weight_version(engine) == "1"
                assert len(await promotions(bus) or []) == 2  # nothing decided again
                assert json.loads((await bus.redis.hgetall(bus.keys.gate_state))["promoted"]) == [1]

                # Results published while the watcher was down are taken: v2, late, passes.
                assert watcher.stop() == 0, watcher.logs()
                await evaluated(bus, run, 2, demo=0.45, drift=0.2)
                watcher.start()
                await eventually(lambda: weight_version(engine) == "2", 60, "v2 promoted late")
                p3 = (await promotions(bus))[-1]  # type: ignore[index]
                assert (p3.version, p3.decision, p3.serving) == (2, "promoted", 2)
                assert (await loads_until(bus, 2))[-1].promotion == \
                    "promoted: demo 0.45 >= best 0.4 - 0.05; drift 0.2 <= limit 1"
                group = next(g for g in await bus.redis.xinfo_groups(bus.keys.evals) if g["name"] == "gate")
                assert int(group["pending"]) == 0 and group["lag"] == 0
    finally:
        assert watcher.stop() in (0, None), watcher.logs()
    assert "Traceback" not in watcher.logs(100_000)


async def test_gate_off_serves_latest_whatever_the_evaluations_say(
    s3_settings: Settings, s3_env: dict[str, str], engine: str, models: dict[str, Path],  # noqa: F811
    watch_dir: Path,
) -> None:
    run = s3_settings.run
    env = {**s3_env, "NEXTSTATE_WATCHER__ENGINE_URL": engine, "NEXTSTATE_WATCHER__POLL_INTERVAL_S": "0.2",
           "NEXTSTATE_WATCHER__LOCAL_DIR": str(watch_dir), "NEXTSTATE_WATCHER__PORT": str(free_port()),
           "NEXTSTATE_INTERNAL__TOKEN": TOKEN}
    watcher = ServiceProcess("watcher", env).start()
    try:
        watcher.wait_http(ops_url(watcher, "readyz"), timeout=60)
        with Bucket(s3_settings.bucket) as bucket:
            async with Bus(s3_settings) as bus:
                ckpt.publish_checkpoint(bucket, run, 1, models["b"], step=1)
                await eventually(lambda: weight_version(engine) == "1", 60, "v1 served")
                await evaluated(bus, run, 1, demo=0.0, drift=50.0)
                ckpt.publish_checkpoint(bucket, run, 2, models["c"], step=2)  # never evaluated
                await eventually(lambda: weight_version(engine) == "2", 60, "v2 served")
                assert [p.promotion for p in await loads_until(bus, 2, 2)] == [None, None]
                assert not await bus.redis.exists(bus.keys.gate_state, bus.keys.promotions, bus.keys.lineage)
                assert not await bus.redis.xinfo_groups(bus.keys.evals)
                assert metric(watcher, "nextstate_gate_decisions_total", decision="refused") is None
    finally:
        assert watcher.stop() == 0, watcher.logs()
