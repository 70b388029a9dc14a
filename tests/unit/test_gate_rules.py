"""The promotion gate's rule (services/watcher/gate_rules.py), on hand-made results: the
baseline and delta, the drift limit, the first version against the base, the wait for
results, re-evaluation and rollback, what may be served, and the Redis round trip."""

from __future__ import annotations

from services.watcher.gate_rules import GateBook, Rules, field_name
from shared.schemas import EvalResult, eval_job_id

RULES = Rules(suites=("demo", "drift"), delta=0.05, drift_max=0.5, wait_s=60.0)
RUN = "r"


def result(version: int, suite: str, score: float, n: int = 32, suffix: str = "") -> EvalResult:
    return EvalResult(id=eval_job_id(RUN, version, suite) + suffix, run=RUN, version=version,
                      suite=suite, score=score, n=n, higher_is_better=suite != "drift",
                      ci_low=score - 0.1, ci_high=score + 0.1)


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


def test_versions_below_the_newest_promoted_are_not_judged() -> None:
    book = GateBook()
    book.see(1, 0.0)
    scored(book, 2, demo=0.8, drift=0.1)
    assert decisions(book, 10.0) == [(2, "promoted")]
    scored(book, 1, demo=0.9, drift=0.1)  # late: v2 superseded it
    assert decisions(book, 1000.0) == []  # nor is it refused when its wait is over
    assert book.records[1].decision is None and book.promoted == [2]


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
