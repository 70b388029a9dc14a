"""The promotion gate's rule (services/watcher/gate_rules.py) and its paired tests
(services/watcher/paired.py), on hand-made results: McNemar's exact test and the paired
bootstrap against closed forms; a candidate worse on the same tasks refused, an equal one
and one within the noise promoted; the base as the first baseline; the threshold for
results without tasks, the drift limit, the wait for results, skipped versions,
re-evaluation and rollback, what may be served, and the Redis round trip."""

from __future__ import annotations

import math

import pytest

from services.watcher.gate_rules import GateBook, Rules, field_name
from services.watcher.paired import compare, mcnemar_exact, paired_bootstrap
from shared.errors import MalformedMessage
from shared.schemas import EvalResult, Promotion, TaskResult, eval_job_id

RULES = Rules(suites=("demo", "drift"), delta=0.05, drift_max=0.5, wait_s=60.0)
RUN = "r"


def result(version: int, suite: str, score: float, n: int = 32, suffix: str = "") -> EvalResult:
    return EvalResult(id=eval_job_id(RUN, version, suite) + suffix, run=RUN, version=version,
                      suite=suite, score=score, n=n, higher_is_better=suite != "drift",
                      ci_low=score - 0.1, ci_high=score + 0.1)


def with_tasks(version: int, suite: str, outcomes: list[float], binary: bool = True,
               suffix: str = "") -> EvalResult:
    """A result with per-task outcomes (task i is `<suite>/i`): pass/fail or graded."""
    tasks = [TaskResult(task=f"{suite}/{i:03d}", score=x, passed=bool(x) if binary else None)
             for i, x in enumerate(outcomes)]
    score = sum(outcomes) / len(outcomes)
    return EvalResult(id=eval_job_id(RUN, version, suite) + suffix, run=RUN, version=version, suite=suite,
                      score=score, n=len(outcomes), tasks=tasks)


def drift(version: int, score: float = 0.1) -> EvalResult:
    return result(version, "drift", score)


def scored(book: GateBook, version: int, demo: float, drift: float, now: float = 0.0, **kw: int) -> None:
    book.add(result(version, "demo", demo, **kw), now)
    book.add(result(version, "drift", drift, **kw), now)


def decisions(book: GateBook, now: float = 1.0) -> list[tuple[int, str]]:
    return [(v.version, v.decision) for v in book.decide(RULES, now)]


def test_first_version_without_base_scores_passes_on_the_drift_limit_alone() -> None:
    book = GateBook()
    scored(book, 1, demo=0.01, drift=0.4)
    scored(book, 2, demo=0.9, drift=0.6)  # only judged after 1 is promoted: against it
    verdicts = book.decide(RULES, 1.0)
    assert [(v.version, v.decision) for v in verdicts] == [(1, "promoted"), (2, "refused")]
    assert verdicts[0].reasons == ["demo 0.01 (no baseline yet)", "drift 0.4 <= limit 0.5"]
    assert "drift 0.6 > limit 0.5" in verdicts[1].reasons
    assert verdicts[1].baseline == {"demo": 0.01} and verdicts[1].scores == {"demo": 0.9, "drift": 0.6}
    assert book.promoted == [1] and book.serving(None) == 1


def test_first_version_is_judged_against_the_base_model_when_it_was_evaluated() -> None:
    book = GateBook()
    scored(book, 0, demo=0.6, drift=0.0)
    scored(book, 1, demo=0.5, drift=0.1)
    (verdict,) = book.decide(RULES, 1.0)
    assert (verdict.decision, verdict.baseline) == ("refused", {"demo": 0.6})
    assert verdict.reasons[0] == "demo 0.5 < best 0.6 - 0.05"
    scored(book, 2, demo=0.56, drift=0.1)  # within delta of the base
    assert decisions(book) == [(2, "promoted")]
    assert book.promoted == [2]


def test_best_served_minus_delta() -> None:
    book = GateBook()
    scored(book, 1, demo=0.7, drift=0.1)
    scored(book, 2, demo=0.66, drift=0.1)  # 0.7 - 0.05 <= 0.66
    scored(book, 3, demo=0.64, drift=0.1)  # best is still 0.7, not 0.66: no creeping down
    assert decisions(book) == [(1, "promoted"), (2, "promoted"), (3, "refused")]
    assert book.best() == {"demo": 0.7}


def test_a_version_waits_for_all_its_suites_then_is_refused_as_unevaluated() -> None:
    book = GateBook()
    book.see(1, now=100.0)
    book.add(result(1, "demo", 0.9), 110.0)
    assert decisions(book, 150.0) == []  # drift missing, 50 s < 60 s
    (verdict,) = book.decide(RULES, 160.0)
    assert verdict.decision == "refused" and verdict.reasons == ["unevaluated: no drift result within 60s"]
    assert decisions(book, 500.0) == []  # decided once
    book.add(result(1, "drift", 0.1), 600.0)  # late: judged after all
    assert decisions(book, 601.0) == [(1, "promoted")]


def test_a_refused_version_is_judged_again_on_a_new_result() -> None:
    book = GateBook()
    scored(book, 1, demo=0.8, drift=0.1)
    scored(book, 2, demo=0.5, drift=0.1)
    assert decisions(book) == [(1, "promoted"), (2, "refused")]
    book.add(result(2, "demo", 0.79, n=256, suffix=".n256"), 2.0)
    assert decisions(book) == [(2, "promoted")]
    assert book.promoted == [1, 2]


def test_a_failing_re_evaluation_rolls_the_served_version_back() -> None:
    book = GateBook()
    scored(book, 1, demo=0.6, drift=0.1)
    scored(book, 2, demo=0.8, drift=0.1)
    assert decisions(book) == [(1, "promoted"), (2, "promoted")]
    assert book.serving(2) == 2
    # A larger evaluation of v2: judged against the others (v1's 0.6), not its own old score.
    book.add(result(2, "demo", 0.57, n=256, suffix=".n256"), 2.0)
    assert decisions(book) == []
    assert book.why(2) == "promoted: demo 0.57 >= best 0.6 - 0.05; drift 0.1 <= limit 0.5"
    book.add(result(2, "demo", 0.3, n=512, suffix=".n512"), 3.0)
    (verdict,) = book.decide(RULES, 3.0)
    assert (verdict.version, verdict.decision, verdict.baseline) == (2, "rolled_back", {"demo": 0.6})
    assert verdict.reasons[0] == "fails on re-evaluation" and "demo 0.3 < best 0.6 - 0.05" in verdict.reasons
    assert book.promoted == [1] and book.serving(2) == 1
    # Rolled back is final: a later good result does not promote it again.
    book.add(result(2, "demo", 0.9, n=1024, suffix=".n1024"), 4.0)
    assert decisions(book) == []


def test_a_smaller_evaluation_or_a_redelivery_changes_nothing() -> None:
    book = GateBook()
    scored(book, 1, demo=0.8, drift=0.1, n=256)
    assert decisions(book) == [(1, "promoted")]
    assert not book.add(result(1, "demo", 0.8, n=256), 2.0)  # the same message again
    assert not book.add(result(1, "demo", 0.1, n=8, suffix=".n8"), 2.0)
    assert decisions(book) == [] and book.promoted == [1]


def test_versions_below_the_newest_judged_one_are_skipped() -> None:
    book = GateBook()
    book.see(1, 0.0)
    scored(book, 2, demo=0.8, drift=0.1)
    verdicts = book.decide(RULES, 10.0)  # v1 never evaluated (the evaluator took v2): skipped
    assert [(v.version, v.decision) for v in verdicts] == [(2, "promoted"), (1, "skipped")]
    assert verdicts[1].reasons == ["not evaluated (demo, drift missing): v2 was judged first"]
    scored(book, 1, demo=0.9, drift=0.1)  # late: v2 was chosen before, v1 is not judged
    assert decisions(book, 1000.0) == []  # nor is it refused when its wait is over
    assert book.records[1].decision == "skipped" and book.promoted == [2]
    book.see(3, 1000.0)
    scored(book, 4, demo=0.9, drift=0.9)  # refused: v3 below it is skipped all the same
    assert decisions(book, 1001.0) == [(4, "refused"), (3, "skipped")]
    scored(book, 3, demo=0.8, drift=0.1)  # ...and judged when its results do come (above v2)
    assert decisions(book, 1002.0) == [(3, "promoted")]


def test_what_may_be_served_follows_latest_and_only_promoted_versions() -> None:
    book = GateBook()
    for v, demo in ((1, 0.5), (2, 0.1), (3, 0.6)):
        scored(book, v, demo=demo, drift=0.1)
    assert decisions(book) == [(1, "promoted"), (2, "refused"), (3, "promoted")]
    assert book.choices(None, ()) == [3, 1]
    assert book.choices(4, ()) == [3, 1]  # LATEST v4 not promoted (yet): v3
    assert book.choices(2, ()) == [1]  # rolled back by hand to v2, refused: v1
    assert book.choices(3, {3}) == [1]  # v3 would not install: the promoted one below
    assert book.choices(0, ()) == [] and GateBook().choices(5, ()) == []


def test_the_book_round_trips_through_its_redis_fields_and_prunes() -> None:
    book = GateBook()
    book.see(7, 5.0)
    for v in range(1, 6):
        scored(book, v, demo=0.5 + v / 100, drift=0.1 if v != 4 else 0.9)
    book.decide(RULES, 10.0)
    fields = book.fields(latest=5, now=10.0)
    assert fields["promoted"] == "[1, 2, 3, 5]" and fields["serving"] == "5"
    assert fields["best"] == '{"demo": 0.55}'
    again, bad = GateBook.from_fields({**fields, field_name(9): "{not json", "config": "{}"})
    assert bad and bad[0].startswith("version:9")
    assert again.promoted == [1, 2, 3, 5] and again.records[7].first_seen == 5.0
    assert again.records[4].decision == "refused" and again.records[4].results == book.records[4].results
    assert again.why(4) == book.why(4)

    again.prune(keep=1)  # promoted versions stay; of the others only the newest
    assert sorted(again.records) == [1, 2, 3, 5, 7] and again.removed == {4}


# -- the paired tests --------------------------------------------------------------------------
def test_mcnemar_exact_is_the_binomial_tail_of_the_discordant_tasks() -> None:
    assert mcnemar_exact(0, 0) == 1.0  # nothing changed: no evidence at all
    assert mcnemar_exact(5, 0) == 1 / 32  # five lost, none gained: P(X >= 5 | 5, 1/2)
    assert mcnemar_exact(0, 5) == 1.0
    assert math.isclose(mcnemar_exact(8, 2), sum(math.comb(10, k) for k in range(8, 11)) / 1024)
    assert math.isclose(mcnemar_exact(3, 3), 0.65625)  # P(X >= 3 | 6, 1/2) = 42/64
    with pytest.raises(ValueError):
        mcnemar_exact(-1, 2)


def test_paired_bootstrap_p_values() -> None:
    assert paired_bootstrap([0.0] * 10) == 1.0  # identical: never worse
    assert paired_bootstrap([-0.2] * 10) == 1 / 2001  # worse on every task, by the same amount
    # Symmetric differences: about half the resampled means fall at or below the observed 0.
    assert 0.45 < paired_bootstrap([0.3, -0.3] * 10) < 0.65
    drop = [-0.5, -0.25, 0.0, -0.25, 0.25, -0.5, 0.0, -0.25] * 4  # mostly worse
    assert paired_bootstrap(drop) < 0.001 and paired_bootstrap(drop) == paired_bootstrap(drop)  # seeded


def test_compare_pairs_only_the_common_tasks() -> None:
    best = {"a": 1.0, "b": 1.0, "c": 0.0, "d": 1.0}
    cand = {"a": 0.0, "b": 1.0, "c": 1.0, "x": 0.0}  # d not asked, x not asked of the best
    cmp = compare(best, cand, binary=True)
    assert cmp is not None and (cmp.test, cmp.n, cmp.worse, cmp.better) == ("mcnemar_exact", 3, 1, 1)
    assert cmp.effect == 0.0 and cmp.p_value == 0.75
    graded = compare({"a": 0.8, "b": 0.6}, {"a": 0.6, "b": 0.6}, binary=False)
    assert graded is not None and graded.test == "paired_bootstrap" and math.isclose(graded.effect, -0.1)
    assert compare({"a": 1.0}, {"b": 1.0}, binary=True) is None


# -- the rule with paired tests ------------------------------------------------------------------
PASSES = [1.0] * 20 + [0.0] * 12  # 32 tasks, 0.625


def test_a_version_worse_on_the_same_tasks_is_refused_an_equal_one_promoted() -> None:
    book = GateBook()
    book.add(with_tasks(0, "demo", PASSES), 0.0)  # the base model: the first baseline
    book.add(drift(0, 0.0), 0.0)
    book.add(with_tasks(1, "demo", PASSES), 0.0)  # the same answers: promoted
    book.add(drift(1), 0.0)
    (v1,) = book.decide(RULES, 1.0)
    assert v1.decision == "promoted" and v1.baseline == {"demo": 0.625}
    assert v1.reasons[0] == "demo 0.625 vs base 0.625: 0 lost, 0 gained of 32 paired tasks, McNemar p=1: not worse"
    t = v1.tests["demo"]
    assert (t.test, t.passed, t.n, t.p_value, t.alpha, t.effect, t.against) == \
        ("mcnemar_exact", True, 32, 1.0, 0.05, 0.0, 0)
    assert v1.tests["drift"].test == "limit" and v1.tests["drift"].passed

    # v2 loses 7 of the tasks v1 passes and gains 1: p = P(X >= 7 | 8, 1/2) = 9/256 < 0.05.
    worse = [0.0] * 7 + [1.0] * 13 + [1.0] + [0.0] * 11
    book.add(with_tasks(2, "demo", worse), 2.0)
    book.add(drift(2), 2.0)
    (v2,) = book.decide(RULES, 3.0)
    assert v2.decision == "refused"
    assert v2.reasons[0] == ("demo 0.4375 vs v1 0.625: 7 lost, 1 gained of 32 paired tasks, "
                             "McNemar p=0.0352 < 0.05: worse")
    assert (v2.tests["demo"].lost, v2.tests["demo"].gained, v2.tests["demo"].against) == (7, 1, 1)
    assert math.isclose(v2.tests["demo"].p_value or 0, 9 / 256)

    # v3 scores lower than v1 too (0.5625), but 4 lost against 2 gained is noise: promoted.
    noisy = [0.0] * 4 + [1.0] * 16 + [1.0] * 2 + [0.0] * 10
    book.add(with_tasks(3, "demo", noisy), 4.0)
    book.add(drift(3), 4.0)
    (v3,) = book.decide(RULES, 5.0)
    assert v3.decision == "promoted" and v3.tests["demo"].p_value == mcnemar_exact(4, 2)
    assert book.best() == {"demo": 0.625}  # v1 stays the best: no creeping down
    # What may be compared again keeps its tasks in `gate-state`; a refused version does not.
    assert book.records[1].results["demo"].tasks and not book.records[2].results["demo"].tasks


def test_a_stricter_alpha_refuses_less() -> None:
    book = GateBook()
    book.add(with_tasks(0, "demo", PASSES), 0.0)
    book.add(with_tasks(1, "demo", [0.0] * 7 + [1.0] * 13 + [1.0] + [0.0] * 11), 0.0)
    book.add(drift(1), 0.0)
    strict = Rules(suites=("demo", "drift"), delta=0.05, drift_max=0.5, wait_s=60.0, alpha=0.01)
    (v1,) = book.decide(strict, 1.0)  # p = 0.035: worse at 0.05, not at 0.01
    assert v1.decision == "promoted" and v1.reasons[0].endswith("McNemar p=0.0352: not worse")


def test_graded_scores_use_the_paired_bootstrap() -> None:
    rules = Rules(suites=("simulated-user",), delta=0.05, drift_max=0.5, wait_s=60.0)
    ratings = [0.25, 0.5, 0.75, 1.0] * 6
    book = GateBook()
    book.add(with_tasks(0, "simulated-user", ratings, binary=False), 0.0)
    book.add(with_tasks(1, "simulated-user", [min(1.0, r + 0.25) for r in ratings], binary=False), 0.0)
    book.add(with_tasks(2, "simulated-user", [max(0.0, r - 0.25) for r in ratings], binary=False), 0.0)
    v1, v2 = book.decide(rules, 1.0)
    assert (v1.decision, v1.tests["simulated-user"].test) == ("promoted", "paired_bootstrap")
    assert v2.decision == "refused" and v2.tests["simulated-user"].against == 1
    assert (v2.tests["simulated-user"].p_value or 1) < 0.001 and "paired bootstrap" in v2.reasons[0]


def test_the_base_counts_as_a_best_and_pairing_takes_the_common_tasks() -> None:
    book = GateBook()
    book.add(with_tasks(0, "demo", [1.0] * 32), 0.0)  # the base passes all 32 of its tasks
    book.add(drift(0, 0.0), 0.0)
    book.add(with_tasks(1, "demo", [1.0] * 16 + [0.0] * 48), 0.0)  # n = 64: 16 of the common 32 lost
    book.add(drift(1), 0.0)
    (v1,) = book.decide(RULES, 1.0)
    assert v1.decision == "refused" and v1.tests["demo"].n == 32 and v1.tests["demo"].lost == 16
    assert v1.baseline == {"demo": 1.0}


def test_results_without_tasks_fall_back_to_the_threshold() -> None:
    book = GateBook()
    book.add(with_tasks(0, "demo", PASSES), 0.0)
    scored(book, 1, demo=0.5, drift=0.1)  # no per-task results: nothing to pair
    (v1,) = book.decide(RULES, 1.0)
    assert v1.decision == "refused" and v1.reasons[0] == "demo 0.5 < best 0.625 - 0.05"
    assert v1.tests["demo"].test == "threshold" and v1.tests["demo"].effect == -0.125


def test_tests_round_trip_through_redis_fields() -> None:
    book = GateBook()
    book.add(with_tasks(0, "demo", PASSES), 0.0)
    book.add(with_tasks(1, "demo", PASSES), 0.0)
    book.add(drift(1), 0.0)
    book.decide(RULES, 1.0)
    again, bad = GateBook.from_fields(book.fields(latest=1, now=1.0))
    assert not bad and again.records[1].tests == book.records[1].tests
    assert again.records[0].results["demo"].tasks == book.records[0].results["demo"].tasks
    assert again.records[0].results["demo"].binary


def test_promotion_schema_versions() -> None:
    old = ('{"type":"promotion","schema_version":1,"id":"x","created_at":1.0,"run":"r","version":3,'
           '"decision":"refused","reasons":["demo 0.5 < best 0.7 - 0.05"]}')
    p1 = Promotion.from_json(old)  # written before the paired tests: still read
    assert p1.schema_version == 1 and p1.tests == {}
    book = GateBook()
    book.add(with_tasks(0, "demo", PASSES), 0.0)
    book.add(with_tasks(1, "demo", PASSES), 0.0)
    book.add(drift(1), 0.0)
    (v,) = book.decide(RULES, 1.0)
    p2 = Promotion(run=RUN, version=1, decision=v.decision, reasons=v.reasons, tests=v.tests)
    assert p2.schema_version == 2 and Promotion.from_json(p2.to_json()).tests == v.tests
    with pytest.raises(MalformedMessage, match="schema_version 1"):
        Promotion.from_json(p2.to_json().replace('"schema_version":2', '"schema_version":1'))
    with pytest.raises(MalformedMessage, match="schema_version"):
        Promotion.from_json(p2.to_json().replace('"schema_version":2', '"schema_version":3'))
