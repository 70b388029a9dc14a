"""`nextstate eval run --model PATH | --version RUN:V`: any model evaluated beside the run,
against real processes — Redis, SeaweedFS, the CPU engine as the evaluation engine (on the
base model), `python -m services.evaluator` — and the CLI as a user runs it.

An HF folder of the policy's shape, then another run's version from the bucket, are each
served by the evaluation engine while the suites run (the real `drift` suite, which tells
them from the base, and a test suite that records what the engine served), their results
printed beside the run's versions and stored in the bucket under the run; `eval show` and
`eval plot` show them. Nothing of the run moves: no entry on `evals` or `promotions`, the
gate's state and the lineage as they were, and afterwards the engine serves the base
again. A model of another shape fails with the engine's reason, exit 1.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from shared import checkpoints as ckpt
from shared.auth import bearer
from shared.evaljobs import model_result_key
from shared.keys import Keys
from shared.schemas import EvalResult, eval_job_id
from shared.settings import Settings
from shared.store import Bucket
from tests.integration.test_ctl import run as nextstate
from tests.support.servers import ServiceProcess, free_port
from tests.support.tiny_model import build_tiny_model

pytestmark = pytest.mark.integration

TOKEN = "eval-model-test-internal-token"
SERVED = "tests.support.eval_suites:served_model"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval-models")
    out = {name: build_tiny_model(root / name, seed=seed) for name, seed in
           (("base", 1), ("sft-candidate", 2), ("other-run-v2", 3))}
    out["narrow"] = build_tiny_model(root / "narrow", seed=4, hidden=32)
    return out


@pytest.fixture
def stack(models: dict[str, Path], s3_env: dict[str, str], tmp_path: Path) -> Iterator[dict[str, str]]:
    """The evaluation engine on the base model and one evaluator; the CLI's environment."""
    port = free_port()
    engine = ServiceProcess("engine", {"NEXTSTATE_ENV": "test", "NEXTSTATE_INTERNAL__TOKEN": TOKEN},
                            ["--model", str(models["base"]), "--port", str(port)]).start()
    evaluator = ServiceProcess("evaluator", {
        **s3_env, "NEXTSTATE_INTERNAL__TOKEN": TOKEN, "NEXTSTATE_EVAL__ENGINE_URL": f"http://127.0.0.1:{port}",
        "NEXTSTATE_EVAL__SUITES": json.dumps(["drift"]), "NEXTSTATE_EVAL__BASELINE": "false",
        "NEXTSTATE_EVAL__BASE_MODEL": str(models["base"]), "NEXTSTATE_EVAL__TOKENIZER": str(models["base"]),
        "NEXTSTATE_EVAL__LOCAL_DIR": str(tmp_path / "eval-checkpoints"), "NEXTSTATE_EVAL__PORT": str(free_port()),
        "NEXTSTATE_EVAL__SAMPLES": "4", "NEXTSTATE_EVAL__SUITE_SAMPLES": json.dumps({"drift": 4}),
        "NEXTSTATE_EVAL__MAX_TOKENS": "8", "NEXTSTATE_EVAL__JOB_TIMEOUT_S": "300"})
    try:
        engine.wait_http(f"http://127.0.0.1:{port}/health", timeout=180)
        evaluator.start().wait_http(f"http://127.0.0.1:{evaluator.env['NEXTSTATE_EVAL__PORT']}/readyz", timeout=120)
        yield {**s3_env, "ENGINE": f"http://127.0.0.1:{port}"}
    except BaseException:
        print(engine.logs(), evaluator.logs())
        raise
    finally:
        evaluator.stop()
        engine.stop()


def run_state(r: Any, keys: Keys) -> dict[str, Any]:
    """What a model's evaluation must not change."""
    return {"evals": r.xlen(keys.evals), "promotions": r.xlen(keys.promotions), "gate": r.hgetall(keys.gate_state),
            "lineage": r.get(keys.lineage), "checkpoints": r.xlen(keys.checkpoints)}


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return nextstate(env, "eval", "run", *args, timeout=600)


def test_any_model_is_evaluated_beside_the_run_and_nothing_of_the_run_moves(
    stack: dict[str, str], s3_settings: Settings, models: dict[str, Path], tmp_path: Path,
) -> None:
    name, keys = s3_settings.run, Keys(s3_settings.redis.prefix)
    r: Any = redis.Redis.from_url(s3_settings.redis.url, decode_responses=True)
    with Bucket(s3_settings.bucket) as bucket:
        ckpt.publish_checkpoint(bucket, "other-run", 2, models["other-run-v2"], step=2, base_model=str(models["base"]))
    # The run's own history: v0 and v1 scored on drift, the gate serving v1.
    for v, score in ((0, 0.0), (1, 0.4)):
        r.xadd(keys.evals, {"data": EvalResult(id=eval_job_id(name, v, "drift"), run=name, version=v, suite="drift",
                                               score=score, n=4, higher_is_better=False).to_json()})
    r.hset(keys.gate_state, mapping={"serving": "1", "promoted": "[1]"})
    before = run_state(r, keys)

    out = cli(stack, "--model", str(models["sft-candidate"]), "--suite", "drift", SERVED)
    print(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    drift = next(ln for ln in lines if ln.startswith("sft-candidate  drift "))
    assert float(drift.split()[2]) > 0.05 and drift.endswith("n=4"), drift  # not the base's ~0
    assert "sft-candidate  tests.support.eval_suites:served_model 1 " in out.stdout
    assert "beside run" in out.stdout and "drift (lower is better): sft-candidate" in out.stdout
    assert "v0 (base) 0, v1 (serving) 0.4" in out.stdout

    out = cli(stack, "--version", "other-run:2", "--suite", SERVED)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "other-run:v2  tests.support.eval_suites:served_model 1 " in out.stdout

    with Bucket(s3_settings.bucket) as bucket:
        sft = EvalResult.model_validate_json(bucket.get_bytes(model_result_key(name, "sft-candidate", SERVED)))
        other = EvalResult.model_validate_json(bucket.get_bytes(model_result_key(name, "other-run:v2", SERVED)))
    assert (sft.model, sft.run, sft.score) == ("sft-candidate", name, 1.0)
    assert sft.tasks[0].details["model_path"] == str(models["sft-candidate"])  # what the engine served
    assert other.tasks[0].details["model_path"].endswith("/runs/other-run/v000002")
    assert sft.tasks[0].details["run"] != name  # its suites ran as a run of their own
    assert run_state(r, keys) == before  # no result on evals, no decision, no lineage change
    info = httpx.get(f"{stack['ENGINE']}/model_info", headers=bearer(TOKEN), timeout=10).json()
    assert info["model_path"] == str(models["base"])  # the engine serves what it served before

    show = nextstate(stack, "eval", "show", "--json")
    assert show.returncode == 0, show.stderr
    data = json.loads(show.stdout)
    assert [row["version"] for row in data["versions"]] == [0, 1]
    assert {m["model"]: sorted(m["suites"]) for m in data["models"]} == {
        "other-run:v2": [SERVED], "sft-candidate": ["drift", SERVED]}
    text = nextstate(stack, "eval", "show").stdout
    assert "models beside the run" in text and "sft-candidate" in text
    png = tmp_path / "curve.png"
    plot = nextstate(stack, "eval", "plot", "-o", str(png), timeout=120)
    assert plot.returncode == 0 and "2 model(s) beside it" in plot.stdout, plot.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    bad = cli(stack, "--model", str(models["narrow"]), "--suite", SERVED, "--retries", "0", "--label", "narrow")
    print(bad.stdout, text)
    assert bad.returncode == 1
    assert "narrow  tests.support.eval_suites:served_model failed: EngineError: the evaluation engine refused " \
           "narrow" in bad.stdout and "does not fit" in bad.stdout, bad.stdout
    assert run_state(r, keys) == before
    r.close()
