"""Evaluation job ids, their rq and bucket spellings, and the evaluator's timing settings,
without a server. Enqueuing against a real Redis: tests/integration/test_evaluator_enqueue.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.evaluator.settings import EvalSettings
from shared.errors import SettingsError
from shared.evaljobs import JOB_FUNCTION, job_id_for, result_key, rq_job_id
from shared.rqworker import worker_ttl
from shared.schemas import eval_job_id
from shared.settings import load_settings
from tests.support.servers import REPO


def test_the_job_id_is_the_results_and_a_sample_override_is_another_job() -> None:
    assert job_id_for("r1", 42, "demo") == eval_job_id("r1", 42, "demo") == "eval.r1.v000042.demo"
    assert job_id_for("r1", 42, "demo", samples=256) == "eval.r1.v000042.demo.n256"
    assert job_id_for("r1", 42, "demo", samples=32) != job_id_for("r1", 42, "demo")
    with pytest.raises(ValueError, match="samples"):
        job_id_for("r1", 42, "demo", samples=0)


@pytest.mark.parametrize("job_id", [
    "eval.r1.v000042.demo", "eval.r_1.v000042.demo.n256", "eval.r.1.v000001.mypkg.evals:suite",
    "eval.run-x.v000003.simulated-user", "eval.r.v000001.été",
])
def test_rq_ids_are_what_rq_accepts(job_id: str) -> None:
    from rq.job import JOB_ID_PATTERN

    rq_id = rq_job_id(job_id)
    assert JOB_ID_PATTERN.fullmatch(rq_id), rq_id
    assert rq_id.startswith("eval_2e")  # the evaluator's Redis user may touch only these


def test_rq_ids_are_one_to_one() -> None:
    """Runs may hold `_` and `.`, suites `-`, `.` and `:`: no two ids share an rq id."""
    ids = ["eval.a_b.v000001.demo", "eval.a.b.v000001.demo", "eval.a_2eb.v000001.demo",
           "eval.a-b.v000001.demo", "eval.r.v000001.x:y", "eval.r.v000001.x.y", "eval.r.v000001.x_3ay"]
    assert len({rq_job_id(i) for i in ids}) == len(ids)
    assert rq_job_id("eval.r1.v000042.demo") == "eval_2er1_2ev000042_2edemo"


def test_results_lie_at_eval_key_even_for_module_callable_suites() -> None:
    assert result_key("r1", 42, "demo") == "evals/r1/v000042/demo.json"
    assert result_key("r1", 42, "mypkg.evals:tool_suite") == "evals/r1/v000042/mypkg.evals.tool_suite.json"


def test_the_job_function_is_importable_at_its_stable_path() -> None:
    module, _, name = JOB_FUNCTION.rpartition(".")
    assert (module, name) == ("services.evaluator.jobs", "run_eval")
    # Enqueuing (the watcher's gate, `nextstate eval run`) never pulls torch or the evaluator.
    code = ("import sys, shared.evaljobs; "
            "assert 'torch' not in sys.modules and 'services.evaluator' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr


def test_timing_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("NEXTSTATE_")]:
        monkeypatch.delenv(name)
    cfg = load_settings(EvalSettings).eval
    assert (cfg.heartbeat_s, cfg.abandoned_after_s, cfg.maintenance_s) == (10, 45, 15)
    # An idle worker's blocking dequeue returns every maintenance_s: rq blocks worker_ttl - 15.
    assert worker_ttl(cfg.maintenance_s) - 15 == cfg.maintenance_s
    monkeypatch.setenv("NEXTSTATE_EVAL__HEARTBEAT_S", "30")
    with pytest.raises(SettingsError, match="at least twice heartbeat_s"):
        load_settings(EvalSettings)
    monkeypatch.setenv("NEXTSTATE_EVAL__HEARTBEAT_S", "0.5")
    with pytest.raises(SettingsError, match="NEXTSTATE_EVAL__HEARTBEAT_S"):
        load_settings(EvalSettings)
