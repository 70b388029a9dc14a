"""What the promotion gate's record (`gate-state`, written by the watcher) tells the trainer.

The trainer keeps only its newest versions in the bucket; with the gate on, evaluation can
lag training by minutes (SmolLM2 on 2 cores: ~1.5 min per version against ~1 min per
step). A version deleted before the gate decides on it can never be served: the gate
promotes it, the watcher cannot download it, and users stay on the old policy. So the
trainer's retention keeps, beside its newest versions:

- every version the gate has not decided on yet, for as long as the gate would wait for
  its results (`wait_s` of the gate's rule; after that the gate refuses it anyway), and
- the version the gate serves and the promoted one before it (a rollback's target).

The gate writes its rule (`config`) when it starts, so this holds from the first version
on; without a `config` field there is no gate and retention is the trainer's own.

`current` is the version the gate has the engine serve (None: nothing promoted, the
engine keeps the weights it started with): the trainer never drops a sample of the
policy users get now, however stale (services/trainer/service.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

FIELD_PREFIX = "version:"  # each version's record is the `gate-state` field `version:<n>`


def field_name(version: int) -> str:
    return f"{FIELD_PREFIX}{version}"


@dataclass(frozen=True)
class GateView:
    wait_s: float  # how long the gate waits for a version's results before refusing it
    decided: frozenset[int]  # versions with a decision (promoted, refused, rolled back)
    serving: frozenset[int]  # what it serves, and the promoted version before it
    current: int | None = None  # what it serves (None: nothing promoted yet)


def gate_view(raw: dict[str, str]) -> GateView | None:
    """The view of a `gate-state` hash (HGETALL), or None when no gate runs for it."""
    if not raw.get("config"):
        return None
    try:
        wait_s = float(json.loads(raw["config"]).get("wait_s"))
    except (ValueError, TypeError, AttributeError):
        return None
    decided, promoted = set(), []
    for name, value in raw.items():
        if not name.startswith(FIELD_PREFIX):
            continue
        try:
            rec = json.loads(value)
            version, decision = int(rec["version"]), rec.get("decision")
        except (ValueError, TypeError, KeyError):
            continue
        if decision:
            decided.add(version)
        if decision == "promoted":
            promoted.append(version)
    serving = set(sorted(promoted)[-2:])
    current = int(raw["serving"]) if raw.get("serving", "").isdigit() else None
    if current is not None:
        serving.add(current)
    return GateView(wait_s, frozenset(decided), frozenset(serving), current)
