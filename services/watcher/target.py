"""Which version the engine should serve: pure decisions, no I/O (watcher.py gathers the facts).

The target is LATEST's version when it verifies and loads. When LATEST is unreadable, or
its version is refused (checksum, missing files, the engine said no, the confirm failed),
the engine keeps the last good version the watcher knows; a watcher that knows none (a
fresh process next to a restarted engine) falls back to the newest committed version
below the refused one — below none when LATEST is unreadable — that verifies. So the
engine is never sent back to its base weights while a trained version is at hand.

A refused version is skipped until `retry_bad_after_s` has passed (a re-publish may fix
it); the engine keeps serving the target meanwhile.

With the promotion gate on, the candidates are the gate's instead (gate_rules.py
`GateBook.choices`: promoted versions only, newest at or below LATEST's first); these
rules still apply to them, and nothing else is ever a fallback.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from shared.schemas import LatestPointer

BASE = 0  # the engine's weight_version before any load: the base model, never a trained policy


def policy_version(weight_version: str | None) -> int | None:
    """The trained policy version an engine's `weight_version` names; None for the base
    model ("0"), a non-numeric version, or no answer."""
    if weight_version and weight_version.isascii() and weight_version.isdigit():
        version = int(weight_version)
        return version if version > BASE else None
    return None


def label(weight_version: str | None) -> str:
    """How to name what the engine serves in a message: `v5`, `v0`, `'base'`, `nothing`."""
    if weight_version is None:
        return "nothing (unreachable)"
    if weight_version.isascii() and weight_version.isdigit():
        return f"v{int(weight_version)}"
    return repr(weight_version)


@dataclass(frozen=True)
class Latest:
    """What `policies/<run>/LATEST` said this pass."""

    pointer: LatestPointer | None = None  # None: no LATEST yet, or unreadable
    unreadable: str = ""  # why it could not be read ("" when it could)

    @property
    def version(self) -> int | None:
        return self.pointer.version if self.pointer is not None else None

    @property
    def published(self) -> bool:
        """Something was published: a fallback among committed versions makes sense."""
        return self.pointer is not None or bool(self.unreadable)


@dataclass
class Refusals:
    """Versions refused lately: each is skipped until `retry_after_s` has passed."""

    retry_after_s: float
    _at: dict[int, tuple[float, str]] = field(default_factory=dict)  # version -> (monotonic, reason)

    def add(self, version: int, reason: str, now: float) -> None:
        self._at[version] = (now, reason)

    def clear(self, version: int) -> None:
        self._at.pop(version, None)

    def recent(self, now: float) -> frozenset[int]:
        """Versions still held off at `now`."""
        return frozenset(v for v, (at, _) in self._at.items() if now - at < self.retry_after_s)

    def why(self, version: int, now: float) -> str:
        """Why a held-off version is skipped ("" if it is not): the same text every pass."""
        at, reason = self._at.get(version, (None, ""))
        if at is None or now - at >= self.retry_after_s:
            return ""
        return f"{reason}; retried {self.retry_after_s:g}s after the refusal"


def first_choices(latest: int | None, good: int | None, refused: Collection[int]) -> list[int]:
    """Versions to try before listing the bucket, best first: LATEST's (newer or a
    rollback, it is followed), then the last good one; refused ones are skipped."""
    return [v for v in dict.fromkeys((latest, good)) if v is not None and v not in refused]


def fallbacks(listed: Iterable[int], below: int | None, skip: Collection[int]) -> list[int]:
    """Committed versions to fall back on, newest first: those below `below` (LATEST's
    version; every one when LATEST is unreadable), minus `skip` (refused or tried)."""
    return sorted((v for v in set(listed)
                   if v > BASE and (below is None or v < below) and v not in skip), reverse=True)
