"""The outage spool: ordered, bounded, survives a restart, replays each operation once."""

from __future__ import annotations

from pathlib import Path

from services.collector.spool import Spool


def test_append_take_settle_in_order(tmp_path: Path) -> None:
    sp = Spool(tmp_path / "s.jsonl", 1 << 20)
    assert not sp.has_data() and sp.take() == []
    for i in range(3):
        assert sp.append({"op": "turn", "data": f"t{i}"})
    ops = sp.take()
    assert [o["data"] for o in ops] == ["t0", "t1", "t2"]
    # New operations keep appending while the taken ones replay.
    sp.append({"op": "turn", "data": "t3"})
    assert sp.take() == ops  # not settled yet: the same batch again
    sp.settle(ops[2:])  # the first two were replayed
    assert [o["data"] for o in sp.take()] == ["t2"]
    sp.settle([])
    assert [o["data"] for o in sp.take()] == ["t3"]
    sp.settle([])
    assert not sp.has_data() and sp.bytes == 0
    sp.close()


def test_survives_a_restart_and_skips_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    sp = Spool(path, 1 << 20)
    sp.append({"op": "pending", "h": "abc", "record": "r\nx", "deadline": 1.5, "lineage": "{}"})
    sp.close()
    with open(path, "ab") as fh:
        fh.write(b'{"op": "turn", "da')  # the process died mid-write
    again = Spool(path, 1 << 20)
    assert again.has_data()
    ops = again.take()
    again.close()
    assert ops == [{"op": "pending", "h": "abc", "record": "r\nx", "deadline": 1.5, "lineage": "{}"}]


def test_bounded(tmp_path: Path) -> None:
    sp = Spool(tmp_path / "s.jsonl", 1024)
    n = 0
    while sp.append({"op": "turn", "data": "x" * 100}):
        n += 1
    assert 5 <= n <= 10 and sp.bytes <= 1024
    sp.settle(sp.take()[:0])  # replayed everything: room again
    assert sp.append({"op": "turn", "data": "y"})
    sp.close()
