"""The promotion gate's I/O: results in from `evals`, decisions out to `promotions`, its
memory in Redis. The rule itself is gate_rules.py; the watcher asks `choices` what it may load.

Each watcher pass with NEXTSTATE_GATE__ENABLED=true calls `Gate.step(latest)` first:
1. the first time, load the book from the hash `gate-state` (so a restarted watcher keeps
   every decision and never serves what it refused); until that works nothing is loaded;
2. read new `EvalResult`s in group `gate` on `evals` (own pending entries first: a
   restarted watcher takes back what it read and had not acked), start LATEST's wait;
3. decide (gate_rules.py); when the served version was rolled back, ask the trainer to
   rebase on the one served now (shared/lineage.py: the `lineage-base` record, then LATEST
   moved back, when the watcher's bucket identity may write it); write `gate-state`;
   publish one `Promotion` per decision;
4. ack the entries. A result that does not parse goes to `dead`; one of another run is
   acked and ignored.

`gate-state` (HSET; readers: `nextstate status`, `nextstate eval show`):
    promoted     JSON list of promoted versions, oldest first
    best         JSON suite -> best promoted score (higher-is-better suites)
    serving      the version the gate has the engine serve ("" none yet)
    decided_at   when this was written (unix seconds)
    config       JSON {suites, alpha, delta, drift_max, wait_s}: the rule in force
    version:<n>  JSON {version, decision, reasons, first_seen, decided_at,
                 results: {suite: {id, score, higher_is_better, n, ci_low, ci_high, at,
                                   tasks: {task id: score}, binary}},
                 tests: {suite: SuiteTest (shared/schemas.py): how it was decided}}
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge
from redis.exceptions import RedisError, ResponseError

from services.watcher.gate_rules import GateBook, Rules, Verdict
from services.watcher.settings import WatcherSettings
from shared import keys as K
from shared import lineage
from shared.errors import BusError, MalformedMessage, StoreError
from shared.gate_view import field_name
from shared.schemas import EvalResult, Promotion
from shared.store import AsyncBucket
from shared.streams import Bus

log = logging.getLogger(__name__)

DECISIONS = Counter("nextstate_gate_decisions_total", "Promotion gate decisions", ["decision"])
PROMOTED_VERSION = Gauge("nextstate_gate_promoted_version",
                         "The version the gate has the engine serve (-1: none promoted yet)")
RESULTS = Counter("nextstate_gate_results_total", "EvalResults the gate read", ["suite"])

READ_COUNT = 256


@dataclass
class Gate:
    settings: WatcherSettings
    bus: Bus
    bucket: AsyncBucket
    book: GateBook | None = None  # None until loaded from `gate-state`
    stale: bool = False  # a step failed: read the book again from `gate-state` next step
    rules: Rules = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.settings.gate
        self.rules = Rules(tuple(cfg.suites), cfg.delta, cfg.drift_max, cfg.wait_s, cfg.alpha)
        PROMOTED_VERSION.set(-1)

    @property
    def run(self) -> str:
        return self.settings.run

    # -- what the watcher asks ----------------------------------------------------------
    def choices(self, latest: int | None, skip: frozenset[int]) -> list[int]:
        """Promoted versions the engine may serve, best first (none before the book loads)."""
        return [] if self.book is None else self.book.choices(latest, skip)

    def promoted(self, version: int | None) -> bool:
        return self.book is not None and version in self.book.promoted

    def why(self, version: int) -> str | None:
        return None if self.book is None else self.book.why(version)

    # -- one pass -------------------------------------------------------------------------
    async def step(self, latest: int | None) -> list[Verdict]:
        """Take new results, decide, record and announce. Raises RedisError / BusError;
        then the book is read again from `gate-state` at the next step (the entries were
        not acked: they come back and are decided again), and meanwhile the watcher keeps
        serving from the book it has (a Redis outage never strands the engine)."""
        try:
            return await self._step(latest)
        except (RedisError, BusError):
            self.stale = True
            raise

    async def _step(self, latest: int | None) -> list[Verdict]:
        if self.book is None or self.stale:
            self.book = await self._load()
            self.stale = False
        book = self.book
        entries = await self._read()
        now = time.time()
        for entry_id, data in entries:
            await self._take(book, entry_id, data, now)
        book.see(latest, now)
        before = book.serving(latest)
        verdicts = book.decide(self.rules, now)
        after = book.serving(latest)
        book.prune(self.settings.gate.keep_versions)
        if before is not None and any(v.version == before and v.decision == "rolled_back" for v in verdicts):
            await self._rebase(before, after)
        if book.changed or book.removed or verdicts:
            await self._save(book, latest, now)
        for verdict in verdicts:
            await self._announce(verdict, after)
        if entries:
            await self.bus.redis.xack(self.bus.keys.evals, K.GROUP_GATE, *(e for e, _ in entries))
        PROMOTED_VERSION.set(-1 if after is None else after)
        return verdicts

    async def _load(self) -> GateBook:
        await self.bus.ensure_group(K.EVALS, K.GROUP_GATE)
        raw = await self.bus.redis.hgetall(self.bus.keys.gate_state)
        book, bad = GateBook.from_fields(raw)
        for problem in bad:
            log.warning("gate-state field unreadable, ignored", extra={"error": problem})
        # The rule in force, from the start: the trainer's retention keeps what the gate has
        # yet to decide on once it sees a gate (shared/gate_view.py).
        await self.bus.redis.hset(self.bus.keys.gate_state, "config", self._config())
        log.info("gate ready", extra={"promoted": book.promoted, "versions": len(book.records),
                                      "suites": list(self.rules.suites)})
        return book

    async def _read(self) -> list[tuple[str, str | None]]:
        """This consumer's pending entries (read before a restart, not acked), then new
        ones; never blocks. An entry trimmed away while pending comes back as None."""
        out: list[tuple[str, str | None]] = []
        name, key = self.settings.gate.consumer_name, self.bus.keys.evals
        for start in ("0", ">"):
            while True:
                try:
                    resp = await self.bus.redis.xreadgroup(K.GROUP_GATE, name, {key: start},
                                                           count=READ_COUNT)
                except ResponseError as exc:
                    if "NOGROUP" not in str(exc):
                        raise
                    await self.bus.ensure_group(K.EVALS, K.GROUP_GATE)  # the stream was deleted
                    resp = []
                rows = resp[0][1] if resp else []
                out.extend((eid, None if f is None else f.get(K.FIELD, "")) for eid, f in rows)
                if start == "0" or len(rows) < READ_COUNT:
                    break
        return out

    async def wait(self, timeout_s: float) -> bool:
        """Block until a result arrives on `evals` or `timeout_s` passes: the watcher waits
        here between passes, so a decision follows its results at once rather than a poll
        later. What arrives stays pending for this consumer; the next step takes it (`_read`
        starts with the pending ones). True when something arrived."""
        if self.book is None or self.stale:
            return False  # the group may not exist yet: the step that loads the book creates it
        block_ms = max(1, min(int(timeout_s * 1000), int(self.settings.redis.socket_timeout * 1000) - 500))
        resp = await self.bus.redis.xreadgroup(K.GROUP_GATE, self.settings.gate.consumer_name,
                                               {self.bus.keys.evals: ">"}, count=READ_COUNT, block=block_ms)
        return bool(resp and resp[0][1])

    async def _take(self, book: GateBook, entry_id: str, data: str | None, now: float) -> None:
        if data is None:
            return  # trimmed from the stream while pending: nothing left to read
        try:
            result = EvalResult.from_json(data)
        except MalformedMessage as exc:
            log.error("unreadable entry on evals, dead-lettered", extra={"entry": entry_id, "error": str(exc)})
            await self.bus.dead_letter(K.EVALS, K.GROUP_GATE, entry_id, data, str(exc), 1,
                                       self.settings.gate.consumer_name)
            return
        if result.run != self.run:
            log.debug("EvalResult of another run ignored", extra={"run": result.run})
            return
        RESULTS.labels(result.suite).inc()
        if book.add(result, now):
            log.info("eval result", extra={"version": result.version, "suite": result.suite,
                                           "score": result.score, "n": result.n})

    def _config(self) -> str:
        return json.dumps({"suites": list(self.rules.suites), "alpha": self.rules.alpha,
                           "delta": self.rules.delta, "drift_max": self.rules.drift_max,
                           "wait_s": self.rules.wait_s})

    async def _save(self, book: GateBook, latest: int | None, now: float) -> None:
        fields = book.fields(latest, now)
        fields["config"] = self._config()
        pipe = self.bus.redis.pipeline(transaction=True)
        pipe.hset(self.bus.keys.gate_state, mapping=fields)
        if book.removed:
            pipe.hdel(self.bus.keys.gate_state, *(field_name(v) for v in sorted(book.removed)))
        await pipe.execute()
        book.changed.clear()
        book.removed.clear()

    async def _announce(self, verdict: Verdict, serving: int | None) -> None:
        DECISIONS.labels(verdict.decision).inc()
        promotion = Promotion(run=self.run, version=verdict.version, decision=verdict.decision,
                              reasons=verdict.reasons, scores=verdict.scores,
                              baseline=verdict.baseline, serving=serving, tests=verdict.tests)
        level = logging.INFO if verdict.decision in ("promoted", "skipped") else logging.WARNING
        log.log(level, "gate: v%s %s (%s)", verdict.version, verdict.decision, "; ".join(verdict.reasons),
                extra={"version": verdict.version, "decision": verdict.decision, "serving": serving})
        try:
            await self.bus.publish(K.PROMOTIONS, promotion)
        except BusError as exc:
            log.warning("could not publish a promotion", extra={"error": str(exc)})

    async def _rebase(self, bad: int, base: int | None) -> None:
        """The served version was rolled back: the trainer rebases on the one served now
        (shared/lineage.py: the `lineage-base` record, then LATEST moved back to it)."""
        if base is None:
            log.error("gate rolled back v%s, and no earlier version was promoted: the engine keeps its "
                      "weights until a version is promoted; no rebase requested", bad,
                      extra={"version": bad})
            return
        try:
            done = await lineage.request_rebase(self.bucket, self.bus.redis, self.bus.keys, self.run, base,
                                                by="gate")
        except (StoreError, OSError) as exc:
            # The watcher's bucket identity may only read (`nextstate up`'s roles): then the
            # record is written but LATEST stays, which the gate does not need (it serves
            # promoted versions only); the trainer follows the record.
            log.warning("gate rollback: LATEST not moved back to v%s (%s)", base, exc,
                        extra={"version": bad, "rebase_on": base})
        else:
            if not done.recorded:
                log.warning("gate rollback: the rebase record was not written (%s); the trainer "
                            "follows LATEST", done.error, extra={"version": bad, "rebase_on": base})
        log.warning("gate rolled back v%s: serving v%s, trainer asked to rebase on it", bad, base,
                    extra={"version": bad, "rebase_on": base})
