"""What `nextstate eval` reads: the evaluation results of a run and the gate's decisions.

Shared by `eval show` / `eval plot` / `eval run VERSION` (services/ctl/evals.py) and
`eval run --model | --version` (services/ctl/eval_models.py), so neither imports the other
for them.

Results come from the `evals` stream and the bucket (`evals/<run>/v…/<suite>.json`, which
outlives the stream's trimming); per version and suite the one the gate uses counts (the
newest, unless it rests on fewer samples); a model's results (`evals/<run>/models/…`) are
kept apart, the newest per suite. Decisions come from the gate's `gate-state` and the
`promotions` stream, the newest of either. The bucket is optional: without it (no
credentials, not reachable) the stream alone is read, and `gather` says why on stderr.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import defaultdict
from typing import Any

from redis.exceptions import RedisError

from services.ctl.common import redis_error
from shared import checkpoints as ckpt
from shared import keys as K
from shared.errors import MalformedMessage, StoreError
from shared.schemas import EvalResult, Promotion
from shared.settings import Settings
from shared.store import Bucket
from shared.streams import Bus

DEFAULT_SUITES = ("demo", "drift")
CHUNK = 500


def _kept(old: dict[str, Any] | None, newer: EvalResult) -> bool:
    """Whether `newer` replaces `old` for its suite (the gate's rule: unless it has a smaller n)."""
    return old is None or newer.n >= old["n"]


def _row(r: EvalResult) -> dict[str, Any]:
    return {
        "score": r.score,
        "ci_low": r.ci_low,
        "ci_high": r.ci_high,
        "n": r.n,
        "higher_is_better": r.higher_is_better,
        "id": r.id,
        "created_at": r.created_at,
    }


async def stream_messages(bus: Bus, key: str) -> list[str]:
    """Every entry's `data` of a stream, read in chunks."""
    out: list[str] = []
    start = "-"
    while True:
        rows = await bus.redis.xrange(key, min=start, count=CHUNK)
        out.extend(str(f.get(K.FIELD, "")) for _, f in rows)
        if len(rows) < CHUNK:
            return out
        start = "(" + str(rows[-1][0])


def bucket_results(settings: Settings, run: str) -> tuple[list[EvalResult], str | None]:
    """The EvalResults in the bucket, and why none could be read (None when they could)."""
    quick = settings.bucket.model_copy(update={"timeout": 5.0})
    out = []
    try:
        with Bucket(quick, retries=1) as bucket:
            for obj in bucket.list(ckpt.evals_prefix(run)):
                if obj.key.endswith(".json"):
                    try:
                        out.append(EvalResult.from_json(bucket.get_bytes(obj.key)))
                    except MalformedMessage:
                        continue
    except (StoreError, OSError) as exc:
        return out, f"{type(exc).__name__}: {exc}"
    return out, None


async def collect(bus: Bus, run: str, extra: list[EvalResult]) -> dict[str, Any]:
    """Per version: the results that count and the newest decision; the gate's summary."""
    keys = bus.keys
    results: list[EvalResult] = list(extra)
    for data in await stream_messages(bus, keys.evals):
        try:
            results.append(EvalResult.from_json(data))
        except MalformedMessage:
            continue
    versions: dict[int, dict[str, Any]] = defaultdict(
        lambda: {"suites": {}, "decision": None, "reasons": [], "tests": {}, "decided_at": None}
    )
    models: dict[str, dict[str, Any]] = defaultdict(dict)  # label -> suite -> the newest result
    for r in sorted((r for r in results if r.run == run), key=lambda r: r.created_at):
        if r.model is not None:
            models[r.model][r.suite] = _row(r)
            continue
        suites = versions[r.version]["suites"]
        if _kept(suites.get(r.suite), r):
            suites[r.suite] = _row(r)
    gate_raw: dict[str, str] = await bus.redis.hgetall(keys.gate_state)
    for name, raw in gate_raw.items():
        if name.startswith("version:"):
            try:
                rec = json.loads(raw)
                _decide(
                    versions,
                    int(rec["version"]),
                    rec.get("decision"),
                    rec.get("reasons") or [],
                    rec.get("decided_at"),
                    None,
                    dict(rec.get("tests") or {}),
                )
            except (ValueError, KeyError, TypeError):
                continue
    for data in await stream_messages(bus, keys.promotions):
        try:
            p = Promotion.from_json(data)
        except MalformedMessage:
            continue
        if p.run == run:
            _decide(
                versions,
                p.version,
                p.decision,
                p.reasons,
                p.created_at,
                p.serving,
                {suite: t.model_dump() for suite, t in p.tests.items()},
            )
    return {
        "run": run,
        "gate": gate_summary(gate_raw),
        "versions": [{"version": v, **versions[v]} for v in sorted(versions)],
        "models": [{"model": m, "suites": models[m]} for m in sorted(models)],
    }


def _decide(
    versions: dict[int, dict[str, Any]],
    version: int,
    decision: str | None,
    reasons: list[str],
    at: float | None,
    serving: int | None,
    tests: dict[str, Any],
) -> None:
    row = versions[version]
    if decision is None or (row["decided_at"] is not None and (at or 0) < row["decided_at"]):
        return
    row.update(decision=decision, reasons=list(reasons), decided_at=at, tests=tests)
    if serving is not None:
        row["serving_after"] = serving


def gate_summary(raw: dict[str, str]) -> dict[str, Any] | None:
    if not raw:
        return None

    def load(name: str, default: Any) -> Any:
        try:
            return json.loads(raw[name]) if raw.get(name) else default
        except ValueError:
            return default

    serving = raw.get("serving", "")
    return {
        "promoted": load("promoted", []),
        "best": load("best", {}),
        "serving": int(serving) if serving.isdigit() else None,
        "decided_at": float(raw["decided_at"]) if raw.get("decided_at") else None,
        "config": load("config", {}),
    }


async def gather(
    settings: Settings, run: str, *, batches: bool = False, quiet: bool = False
) -> dict[str, Any]:
    """What `show` prints (and, with `batches`, the training reward per policy version)."""
    extra, why = await asyncio.to_thread(bucket_results, settings, run)
    if why and not quiet:
        print(
            f"nextstate: bucket not read ({why[:200]}); showing the evals stream only",
            file=sys.stderr,
        )
    async with Bus(settings) as bus:
        try:
            data = await collect(bus, run, extra)
            if batches:
                data["reward"] = await rewards(bus, run)
        except RedisError as exc:
            raise redis_error(exc, settings) from exc
    return data


async def rewards(bus: Bus, run: str) -> dict[int, float]:
    """Mean reward of the training samples per policy version, over the `batches` stream."""
    total: dict[int, float] = defaultdict(float)
    count: dict[int, int] = defaultdict(int)
    for data in await stream_messages(bus, bus.keys.batches):
        try:
            batch = json.loads(data)
            if batch.get("run", "default") != run:
                continue
            for s in batch.get("samples", []):
                total[int(s.get("policy_version", 0))] += float(s["reward"])
                count[int(s.get("policy_version", 0))] += 1
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return {v: total[v] / count[v] for v in sorted(count)}
