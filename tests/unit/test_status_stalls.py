"""`nextstate status`'s stall rule (services/ctl/status.py) on hand-built snapshots: a group
with a backlog and no acks is stalled, except the archive holding its roll on purpose
(as its consumers report it) until that hold is older than roll_s + grace_s."""

from __future__ import annotations

import copy
from typing import Any

from services.ctl.status import mark_stalls, render
from shared import keys as K

NOW = 1_000_000.0


def snapshot(pending: int, acked: int, archive: dict[str, Any] | None = None, lag: int = 0) -> dict[str, Any]:
    group = {"name": K.GROUP_ARCHIVE, "pending": pending, "lag": lag, "entries_read": acked + pending,
             "consumers": [{"name": "buffer-1-archive", "pending": pending, "idle_ms": 10, "inactive_ms": 10}]}  # fmt: skip
    trainer = {"name": K.GROUP_TRAINER, "pending": 0, "lag": 0, "entries_read": acked + pending, "consumers": []}
    return {"prefix": "p", "policy_version": None, "trainer_version": None, "dead_letters": 0,
            "streams": [{"stream": K.BATCHES, "length": acked + pending, "shed": 0, "groups": [group, trainer]}],
            "archive": archive or {}}  # fmt: skip


def state(held_since: float | None, roll_s: float = 300.0, grace_s: float = 90.0) -> dict[str, Any]:
    return {"buffer-1-archive": {"roll_s": roll_s, "grace_s": grace_s, "held_since": held_since,
                                 "uploaded_at": NOW - 400, "last_key": "samples/r/x.jsonl.gz", "at": NOW}}  # fmt: skip


def marked(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    mark_stalls(before, after, 2.0, now=NOW)
    return next(g for g in after["streams"][0]["groups"] if g["name"] == K.GROUP_ARCHIVE)


def test_the_archive_holding_a_young_roll_is_not_stalled() -> None:
    after = snapshot(3, 10, state(NOW - 100))  # held 100 s of a 300 s roll: uploads in 200 s
    group = marked(copy.deepcopy(after), after)
    assert group["stalled"] is False and group["archive_hold"] == {"upload_in_s": 200.0}
    assert after["stalled"] == []
    assert "holding the archive roll (uploads in 200s)" in render(after)


def test_a_hold_past_its_roll_and_grace_is_a_stall() -> None:
    after = snapshot(3, 10, state(NOW - 400))  # 100 s past the roll, grace 90
    group = marked(copy.deepcopy(after), after)
    assert group["stalled"] is True and group["archive_hold"] == {"overdue_s": 100.0}
    assert after["stalled"] == [f"{K.BATCHES}/{K.GROUP_ARCHIVE}"]
    assert "STALLED: the archive roll is 100s overdue" in render(after)
    # Within the grace (an upload being retried) it still holds.
    after = snapshot(3, 10, state(NOW - 350))
    assert marked(copy.deepcopy(after), after)["stalled"] is False


def test_without_a_report_the_plain_rule_applies() -> None:
    for archive in ({}, state(None)):  # an older buffer; or one that says it holds nothing
        after = snapshot(3, 10, archive)
        assert marked(copy.deepcopy(after), after)["stalled"] is True


def test_acks_in_the_window_are_never_a_stall() -> None:
    before = snapshot(3, 10, state(NOW - 400))
    after = snapshot(1, 12, state(NOW - 1))
    group = marked(before, after)
    assert group["stalled"] is False and group["acked_in_window"] == 2 and "archive_hold" not in group
