"""The promotion gate's rule and memory: which versions may be served, and why. Pure, no
I/O: gate.py feeds it the `evals` stream and LATEST, keeps it in Redis, announces its verdicts.

The rule, for each required suite (NEXTSTATE_GATE__SUITES) of a version:
- higher is better (demo, held-out tasks, a simulated user): score >= best - delta, where
  best is that suite's best score among the promoted versions; while none is promoted
  (or none has that suite), the base model's (an EvalResult for version 0) if there is
  one; with no baseline at all the suite passes on its own;
- lower is better (drift, any result with `higher_is_better=False`): score <= drift_max.
A version passes when every required suite does.

Which versions are judged:
- a *candidate* is a version above every promoted one. It is judged once all its required
  suites have a result (again when a new result for it arrives), and refused as
  unevaluated when `wait_s` passes first, counted from when the gate first saw it (LATEST
  named it, or a first result came). Versions below the newest promoted one are not
  judged: they were superseded before their results came.
- a *promoted* version that gets a new result is judged again, against the other promoted
  versions: failing now, it is `rolled_back` (never promoted again).
A result replaces the one it follows for the same suite, unless it rests on fewer samples
(`n`): a smaller evaluation does not overrule a larger one.

What may be served: the newest promoted version at or below LATEST's (an operator's
`nextstate rollback` is followed; a gate rollback moves LATEST too), then the promoted
ones below it, newest first. Nothing promoted: nothing is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Literal

from shared.gate_view import FIELD_PREFIX, field_name
from shared.schemas import EvalResult

BASE = 0  # an EvalResult for version 0 scores the base model: the first baseline
Decision = Literal["promoted", "refused", "rolled_back"]



@dataclass(frozen=True)
class Rules:
    suites: tuple[str, ...]
    delta: float
    drift_max: float
    wait_s: float


@dataclass(frozen=True)
class Score:
    """One suite's result on one version, as the gate keeps it."""

    id: str
    score: float
    higher_is_better: bool = True
    n: int = 0
    ci_low: float | None = None
    ci_high: float | None = None
    at: float = 0.0  # the result's created_at

    @classmethod
    def of(cls, r: EvalResult) -> Score:
        return cls(r.id, r.score, r.higher_is_better, r.n, r.ci_low, r.ci_high, r.created_at)

    def text(self) -> str:
        ci = "" if self.ci_low is None or self.ci_high is None else \
            f" [{_num(self.ci_low)}, {_num(self.ci_high)}]"
        return f"{_num(self.score)}{ci} n={self.n}"


def _num(x: float) -> str:
    return f"{x:.4g}"


@dataclass
class Record:
    """What the gate knows of one version."""

    version: int
    results: dict[str, Score] = field(default_factory=dict)
    decision: Decision | None = None
    reasons: list[str] = field(default_factory=list)
    first_seen: float | None = None  # wall clock: `wait_s` counts from here
    decided_at: float | None = None

    def missing(self, suites: Iterable[str]) -> list[str]:
        return [s for s in suites if s not in self.results]

    def scores(self) -> dict[str, float]:
        return {s: r.score for s, r in sorted(self.results.items())}

    def to_json(self) -> str:
        return json.dumps({
            "version": self.version, "decision": self.decision, "reasons": self.reasons,
            "first_seen": self.first_seen, "decided_at": self.decided_at,
            "results": {s: vars(r) for s, r in self.results.items()},
        })

    @classmethod
    def from_json(cls, raw: str) -> Record:
        d = json.loads(raw)
        return cls(
            version=int(d["version"]), decision=d.get("decision"), reasons=list(d.get("reasons") or []),
            first_seen=d.get("first_seen"), decided_at=d.get("decided_at"),
            results={s: Score(**r) for s, r in (d.get("results") or {}).items()},
        )


@dataclass(frozen=True)
class Verdict:
    """A decision the gate just took, for a `Promotion`."""

    version: int
    decision: Decision
    reasons: list[str]
    scores: dict[str, float]
    baseline: dict[str, float]


def judge(record: Record, rules: Rules, baseline: dict[str, float]) -> tuple[bool, list[str]]:
    """Whether `record` passes every required suite (all present), with one reason each."""
    ok, reasons = True, []
    for suite in rules.suites:
        r = record.results[suite]
        if not r.higher_is_better:
            if r.score <= rules.drift_max:
                reasons.append(f"{suite} {_num(r.score)} <= limit {_num(rules.drift_max)}")
            else:
                ok = False
                reasons.append(f"{suite} {_num(r.score)} > limit {_num(rules.drift_max)}")
        elif (best := baseline.get(suite)) is None:
            reasons.append(f"{suite} {_num(r.score)} (no baseline yet)")
        elif r.score >= best - rules.delta:
            reasons.append(f"{suite} {_num(r.score)} >= best {_num(best)} - {_num(rules.delta)}")
        else:
            ok = False
            reasons.append(f"{suite} {_num(r.score)} < best {_num(best)} - {_num(rules.delta)}")
    return ok, reasons


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
    def baseline(self, suites: Iterable[str], exclude: int | None = None) -> dict[str, float]:
        """Per higher-is-better suite: the best promoted score (`exclude` aside), else the base's."""
        out: dict[str, float] = {}
        base = self.records.get(BASE)
        for suite in suites:
            scores = [r.score for v in self.promoted if v != exclude
                      if (r := self.records[v].results.get(suite)) is not None and r.higher_is_better]
            if scores:
                out[suite] = max(scores)
            elif base is not None and (r := base.results.get(suite)) is not None and r.higher_is_better:
                out[suite] = r.score
        return out

    def best(self) -> dict[str, float]:
        """Every higher-is-better suite's best promoted score (what `gate-state` shows)."""
        suites = {s for v in self.promoted for s in self.records[v].results}
        return self.baseline(sorted(suites))

    def decide(self, rules: Rules, now: float) -> list[Verdict]:
        """Judge what new facts allow: promoted versions with new results, then candidates."""
        verdicts = []
        for v in sorted(self.promoted, reverse=True):
            rec = self.records[v]
            if v in self.fresh and not rec.missing(rules.suites):
                baseline = self.baseline(rules.suites, exclude=v)
                ok, reasons = judge(rec, rules, baseline)
                if ok:
                    rec.reasons = reasons  # still passes: its reasons now cite the new results
                    self.changed.add(v)
                else:
                    self.promoted.remove(v)
                    verdicts.append(self._set(rec, "rolled_back", ["fails on re-evaluation", *reasons],
                                              baseline, now))
        top = max(self.promoted, default=BASE)
        for v in sorted(self.records):
            rec = self.records[v]
            if v <= top or rec.decision in ("promoted", "rolled_back"):
                continue
            missing = rec.missing(rules.suites)
            if not missing and (rec.decision is None or v in self.fresh):
                baseline = self.baseline(rules.suites)
                ok, reasons = judge(rec, rules, baseline)
                verdicts.append(self._set(rec, "promoted" if ok else "refused", reasons, baseline, now))
                if ok:
                    self.promoted.append(v)
                    top = v
            elif missing and rec.decision is None and rec.first_seen is not None \
                    and now - rec.first_seen >= rules.wait_s:
                reasons = [f"unevaluated: no {', '.join(missing)} result within {rules.wait_s:g}s"]
                verdicts.append(self._set(rec, "refused", reasons, {}, now))
        self.fresh.clear()
        return verdicts

    def _set(self, rec: Record, decision: Decision, reasons: list[str], baseline: dict[str, float],
             now: float) -> Verdict:
        rec.decision, rec.reasons, rec.decided_at = decision, reasons, now
        self.changed.add(rec.version)
        return Verdict(rec.version, decision, list(reasons), rec.scores(), dict(baseline))

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
