"""The promotion gate's rule and memory: which versions may be served, and why. Pure, no
I/O: gate.py feeds it the `evals` stream and LATEST, keeps it in Redis, announces its verdicts.

The rule, for each required suite (NEXTSTATE_GATE__SUITES) of a version:
- higher is better (demo, held-out tasks, a simulated user): the candidate is compared
  with the *best* version on that suite — the highest score among the promoted versions
  and the base model (an EvalResult for version 0) — on the tasks both were scored on,
  with a paired test (paired.py: McNemar's exact test for pass/fail tasks, a paired
  bootstrap over tasks for graded scores). It fails only when the test says "worse" at
  `alpha` (one-sided); "not worse" passes. Results without per-task scores cannot be
  paired: then score >= best - delta. With no best at all (no base result, nothing
  promoted) the suite passes on its own;
- lower is better (drift, any result with `higher_is_better=False`): score <= drift_max.
A version passes when every required suite does.

Which versions are judged:
- a *candidate* is a version above every promoted one. It is judged once all its required
  suites have a result (again when a new result for it arrives), and refused as
  unevaluated when `wait_s` passes first, counted from when the gate first saw it (LATEST
  named it, or a first result came);
- a version below a newer one that was judged on its results is `skipped` (the evaluator
  takes the newest version and leaves older ones it had not begun; a late result of one
  below the newest promoted comes after that one was chosen). Skipped is a decision, so the
  trainer's retention may let it go; a skipped candidate whose results do come is judged;
- a *promoted* version that gets a new result is judged again, against the other promoted
  versions and the base: failing now, it is `rolled_back` (never promoted again).
A result replaces the one it follows for the same suite, unless it rests on fewer samples
(`n`): a smaller evaluation does not overrule a larger one.

What may be served: the newest promoted version at or below LATEST's (an operator's
`nextstate rollback` is followed; a gate rollback moves LATEST too), then the promoted
ones below it, newest first. Nothing promoted: nothing is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import Literal

from services.watcher.paired import compare
from shared.gate_view import FIELD_PREFIX, field_name
from shared.schemas import EvalResult, SuiteTest

BASE = 0  # an EvalResult for version 0 scores the base model: the first baseline
Decision = Literal["promoted", "refused", "rolled_back", "skipped"]
JUDGED = ("promoted", "refused", "rolled_back")  # decisions taken on a version's results


@dataclass(frozen=True)
class Rules:
    suites: tuple[str, ...]
    delta: float  # results without per-task scores: score >= best - delta
    drift_max: float
    wait_s: float
    alpha: float = 0.05  # paired tests: refuse when "not worse" is rejected at this level


@dataclass(frozen=True)
class Score:
    """One suite's result on one version, as the gate keeps it. `tasks` (task id -> score,
    1/0 for pass/fail) only for higher-is-better suites: what a paired test needs."""

    id: str
    score: float
    higher_is_better: bool = True
    n: int = 0
    ci_low: float | None = None
    ci_high: float | None = None
    at: float = 0.0  # the result's created_at
    tasks: dict[str, float] = field(default_factory=dict)  # kept while the version may be a best
    binary: bool = False  # every task pass/fail: McNemar; otherwise graded: the bootstrap

    @classmethod
    def of(cls, r: EvalResult) -> Score:
        tasks: dict[str, float] = {}
        binary = False
        if r.higher_is_better and r.tasks:
            tasks = {t.task: float(t.passed) if t.passed is not None else t.score for t in r.tasks}
            binary = all(t.passed is not None for t in r.tasks)
        return cls(r.id, r.score, r.higher_is_better, r.n, r.ci_low, r.ci_high, r.created_at, tasks, binary)

    def text(self) -> str:
        ci = "" if self.ci_low is None or self.ci_high is None else \
            f" [{_num(self.ci_low)}, {_num(self.ci_high)}]"
        return f"{_num(self.score)}{ci} n={self.n}"


def _num(x: float) -> str:
    return f"{x:.4g}"


def _name(version: int) -> str:
    return "base" if version == BASE else f"v{version}"


@dataclass
class Record:
    """What the gate knows of one version."""

    version: int
    results: dict[str, Score] = field(default_factory=dict)
    decision: Decision | None = None
    reasons: list[str] = field(default_factory=list)
    first_seen: float | None = None  # wall clock: `wait_s` counts from here
    decided_at: float | None = None
    tests: dict[str, SuiteTest] = field(default_factory=dict)  # how each suite was decided

    def missing(self, suites: Iterable[str]) -> list[str]:
        return [s for s in suites if s not in self.results]

    def scores(self) -> dict[str, float]:
        return {s: r.score for s, r in sorted(self.results.items())}

    def to_json(self) -> str:
        return json.dumps({
            "version": self.version, "decision": self.decision, "reasons": self.reasons,
            "first_seen": self.first_seen, "decided_at": self.decided_at,
            "results": {s: vars(r) for s, r in self.results.items()},
            "tests": {s: t.model_dump() for s, t in self.tests.items()},
        })

    @classmethod
    def from_json(cls, raw: str) -> Record:
        d = json.loads(raw)
        return cls(
            version=int(d["version"]), decision=d.get("decision"), reasons=list(d.get("reasons") or []),
            first_seen=d.get("first_seen"), decided_at=d.get("decided_at"),
            results={s: Score(**r) for s, r in (d.get("results") or {}).items()},
            tests={s: SuiteTest.model_validate(t) for s, t in (d.get("tests") or {}).items()},
        )


@dataclass(frozen=True)
class Verdict:
    """A decision the gate just took, for a `Promotion`."""

    version: int
    decision: Decision
    reasons: list[str]
    scores: dict[str, float]
    baseline: dict[str, float]  # suite -> the best's score it was compared with
    tests: dict[str, SuiteTest] = field(default_factory=dict)


@dataclass
class Judgement:
    ok: bool = True
    reasons: list[str] = field(default_factory=list)
    tests: dict[str, SuiteTest] = field(default_factory=dict)
    baseline: dict[str, float] = field(default_factory=dict)


def judge_suite(suite: str, r: Score, best: tuple[int, Score] | None, rules: Rules) -> tuple[SuiteTest, str]:
    """How `r` (the candidate's result on `suite`) fares against `best` (version, result)."""
    if not r.higher_is_better:
        ok = r.score <= rules.drift_max
        return (SuiteTest(test="limit", passed=ok, n=r.n),
                f"{suite} {_num(r.score)} {'<=' if ok else '>'} limit {_num(rules.drift_max)}")
    if best is None:
        return SuiteTest(test="none", passed=True, n=r.n), f"{suite} {_num(r.score)} (no baseline yet)"
    against, b = best
    cmp = compare(b.tasks, r.tasks, b.binary and r.binary) if b.tasks and r.tasks else None
    if cmp is None:  # nothing to pair: the summary scores, with a margin
        ok = r.score >= b.score - rules.delta
        return (SuiteTest(test="threshold", passed=ok, n=r.n, effect=r.score - b.score, against=against),
                f"{suite} {_num(r.score)} {'>=' if ok else '<'} best {_num(b.score)} - {_num(rules.delta)}")
    ok = not cmp.refuses(rules.alpha)
    test = SuiteTest(test=cmp.test, passed=ok, n=cmp.n, p_value=cmp.p_value, alpha=rules.alpha,
                     effect=cmp.effect, against=against)
    if cmp.test == "mcnemar_exact":
        test = test.model_copy(update={"lost": cmp.worse, "gained": cmp.better})
        how = f"{cmp.worse} lost, {cmp.better} gained of {cmp.n} paired tasks, McNemar"
    else:
        how = f"effect {cmp.effect:+.3g} on {cmp.n} paired tasks, paired bootstrap"
    verdict = f"p={cmp.p_value:.3g} < {rules.alpha:g}: worse" if not ok else \
        f"p={cmp.p_value:.3g}: not worse"
    return test, f"{suite} {_num(r.score)} vs {_name(against)} {_num(b.score)}: {how} {verdict}"


@dataclass
class GateBook:
    """Every version's results and decision, and the promoted versions (ascending)."""

    records: dict[int, Record] = field(default_factory=dict)
    promoted: list[int] = field(default_factory=list)
    fresh: set[int] = field(default_factory=set)  # versions with results not judged yet
    changed: set[int] = field(default_factory=set)  # records to write back
    removed: set[int] = field(default_factory=set)  # records pruned, to delete

    def record(self, version: int) -> Record:
        if version not in self.records:
            self.records[version] = Record(version)
        return self.records[version]

    # -- facts in ---------------------------------------------------------------------
    def add(self, result: EvalResult, now: float) -> bool:
        """Keep `result`; False when it changes nothing (a redelivery, a smaller evaluation)."""
        rec = self.record(result.version)
        old = rec.results.get(result.suite)
        if old is not None and ((old.id, old.score, old.n) == (result.id, result.score, result.n)
                                or result.n < old.n):
            return False
        rec.results[result.suite] = Score.of(result)
        if rec.first_seen is None:
            rec.first_seen = now
        self.fresh.add(rec.version)
        self.changed.add(rec.version)
        return True

    def see(self, version: int | None, now: float) -> None:
        """LATEST names `version`: its wait for results starts now if it had not."""
        if version is None or version <= BASE:
            return
        rec = self.record(version)
        if rec.first_seen is None:
            rec.first_seen = now
            self.changed.add(version)

    # -- what follows ---------------------------------------------------------------------
    def best_of(self, suite: str, exclude: int | None = None) -> tuple[int, Score] | None:
        """The version with the best result on higher-is-better `suite` among the promoted
        ones and the base (`exclude` aside), and that result; ties go to the larger n, then
        to the newer version."""
        out: tuple[int, Score] | None = None
        for v in (BASE, *self.promoted):
            rec = self.records.get(v)
            r = None if rec is None or v == exclude else rec.results.get(suite)
            if r is not None and r.higher_is_better and \
                    (out is None or (r.score, r.n) >= (out[1].score, out[1].n)):
                out = (v, r)
        return out

    def best(self) -> dict[str, float]:
        """Every higher-is-better suite's best score, promoted versions and the base (what
        `gate-state` shows)."""
        suites = {s for v in (BASE, *self.promoted) if v in self.records for s in self.records[v].results}
        return {s: b[1].score for s in sorted(suites) if (b := self.best_of(s)) is not None}

    def judge(self, rec: Record, rules: Rules, exclude: int | None = None) -> Judgement:
        """Whether `rec` passes every required suite (all present), with one reason each."""
        out = Judgement()
        for suite in rules.suites:
            best = self.best_of(suite, exclude)
            test, reason = judge_suite(suite, rec.results[suite], best, rules)
            out.ok = out.ok and test.passed
            out.reasons.append(reason)
            out.tests[suite] = test
            if best is not None and test.test != "limit":
                out.baseline[suite] = best[1].score
        return out

    def decide(self, rules: Rules, now: float) -> list[Verdict]:
        """Judge what new facts allow: promoted versions with new results, then candidates,
        then what newer judged versions left behind."""
        verdicts = []
        for v in sorted(self.promoted, reverse=True):
            rec = self.records[v]
            if v in self.fresh and not rec.missing(rules.suites):
                j = self.judge(rec, rules, exclude=v)
                if j.ok:
                    rec.reasons, rec.tests = j.reasons, j.tests  # still passes: on the new results
                    self.changed.add(v)
                else:
                    self.promoted.remove(v)
                    verdicts.append(self._set(rec, "rolled_back", ["fails on re-evaluation", *j.reasons], j, now))
        top = max(self.promoted, default=BASE)
        for v in sorted(self.records):
            rec = self.records[v]
            if v <= top or rec.decision in ("promoted", "rolled_back"):
                continue
            missing = rec.missing(rules.suites)
            if not missing and (rec.decision is None or v in self.fresh):
                j = self.judge(rec, rules)
                verdicts.append(self._set(rec, "promoted" if j.ok else "refused", j.reasons, j, now))
                if j.ok:
                    self.promoted.append(v)
                    top = v
            elif missing and rec.decision is None and rec.first_seen is not None \
                    and now - rec.first_seen >= rules.wait_s:
                reasons = [f"unevaluated: no {', '.join(missing)} result within {rules.wait_s:g}s"]
                verdicts.append(self._set(rec, "refused", reasons, Judgement(ok=False), now))
        verdicts.extend(self._skip(rules, top, now))
        self.fresh.clear()
        return verdicts

    def _skip(self, rules: Rules, top: int, now: float) -> list[Verdict]:
        """Undecided versions below the newest one judged on its results: skipped."""
        judged = [v for v, r in self.records.items() if r.decision in JUDGED and not r.missing(rules.suites)]
        newest = max(judged, default=BASE)
        out = []
        for v in sorted(self.records):
            rec = self.records[v]
            if BASE < v < newest and rec.decision is None:
                missing = rec.missing(rules.suites)
                reason = (f"superseded: v{top} was promoted before its results came" if not missing
                          else f"not evaluated ({', '.join(missing)} missing): v{newest} was judged first")
                out.append(self._set(rec, "skipped", [reason], Judgement(ok=False), now))
        return out

    def _set(self, rec: Record, decision: Decision, reasons: list[str], j: Judgement, now: float) -> Verdict:
        rec.decision, rec.reasons, rec.decided_at, rec.tests = decision, reasons, now, j.tests
        if decision != "promoted":  # never a best: its tasks are not compared again (the bucket keeps them)
            rec.results = {s: replace(r, tasks={}) for s, r in rec.results.items()}
        self.changed.add(rec.version)
        return Verdict(rec.version, decision, list(reasons), rec.scores(), dict(j.baseline), dict(j.tests))

    # -- what to serve ------------------------------------------------------------------------
    def serving(self, latest: int | None) -> int | None:
        """The version to serve: the newest promoted at or below LATEST's (any when unknown)."""
        return next(iter(self.choices(latest, ())), None)

    def choices(self, latest: int | None, skip: Collection[int]) -> list[int]:
        """Promoted versions to try, best first (at or below LATEST's), minus `skip`."""
        return [v for v in sorted(self.promoted, reverse=True)
                if (latest is None or v <= latest) and v not in skip]

    def why(self, version: int) -> str | None:
        """`decision: reasons` of a version the gate decided on."""
        rec = self.records.get(version)
        if rec is None or rec.decision is None:
            return None
        return f"{rec.decision}: " + "; ".join(rec.reasons)

    def prune(self, keep: int) -> None:
        """Forget all but the newest `keep` records (the base's and promoted ones stay)."""
        extra = sorted(v for v in self.records if v != BASE and v not in self.promoted)
        for v in extra[:max(0, len(extra) - keep)]:
            del self.records[v]
            self.changed.discard(v)
            self.removed.add(v)

    # -- Redis hash `gate-state` ---------------------------------------------------------------
    def fields(self, latest: int | None, now: float) -> dict[str, str]:
        """The changed fields of `gate-state`: the summary and each changed `version:<n>`."""
        serving = self.serving(latest)
        out = {
            "promoted": json.dumps(self.promoted),
            "best": json.dumps(self.best()),
            "serving": "" if serving is None else str(serving),
            "decided_at": f"{now:.3f}",
        }
        out.update({field_name(v): self.records[v].to_json() for v in sorted(self.changed)
                    if v in self.records})
        return out

    @classmethod
    def from_fields(cls, raw: dict[str, str]) -> tuple[GateBook, list[str]]:
        """The book kept in `gate-state`, and the fields that could not be read."""
        book, bad = cls(), []
        for name, value in raw.items():
            if not name.startswith(FIELD_PREFIX):
                continue
            try:
                rec = Record.from_json(value)
                if field_name(rec.version) != name:
                    raise ValueError(f"holds version {rec.version}")
            except (ValueError, TypeError, KeyError) as exc:
                bad.append(f"{name}: {exc}")
                continue
            book.records[rec.version] = rec
        book.promoted = sorted(v for v, r in book.records.items() if r.decision == "promoted")
        return book, bad
