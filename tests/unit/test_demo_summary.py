"""`nextstate demo`'s summary: each version's success with the evaluation's scores and decision beside it."""

from services.ctl.demo import Tally, attach_evaluations, eval_text, summary_of
from shared.demo_tasks import TASKS


def test_versions_carry_their_evaluation() -> None:
    tally = Tally()
    for version, ok in [("0", False), ("0", True), ("3", True), ("?", False)]:
        tally.add(version, ok)
    summary = summary_of(tally, TASKS["short"])
    evals = {3: {"decision": "promoted", "suites": {"demo": {"score": 0.625}, "drift": {"score": 0.0123}}}}
    attach_evaluations(summary, evals)
    rows = {row["version"]: row for row in summary["by_version"]}
    assert "eval" not in rows["0"] and "eval" not in rows["?"]
    assert rows["3"]["eval"] == {"decision": "promoted", "suites": {"demo": 0.625, "drift": 0.0123}}
    assert eval_text(rows["3"]["eval"]) == "demo 0.625 drift 0.0123  promoted"
    assert eval_text(None) == ""
    assert eval_text({"decision": None, "suites": {"demo": None}}) == "demo -"
