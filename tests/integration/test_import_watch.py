"""`nextstate import --watch DIR` and `--mock N --continuous`, against a real buffer (with the
tiny model's tokenizer), a real rule judge and Redis: what the trainer would see is counted.

The watch test SIGKILLs the watcher mid-file and restarts it, rotates a file, grows a
partial last line, adds a file while it runs, rewinds one committed offset (the state a
watcher killed between the buffer's answer and its commit leaves) — and then every good
line's turns are on `turns`, judged, decided once by the buffer and in at most one batch
(as tests/faults/test_faults.py counts); the only turns sent twice are those of the chunk
in flight at the kill and of the rewound file; the two bad lines are dead letters, once
each, with their file and line number.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from services.buffer.seeds import SeedRecord, turn_id
from services.ctl.importer import mock_records
from services.ctl.infra import free_port
from shared import keys as K
from shared.keys import Keys
from shared.schemas import DeadLetter, ScoredTurn, TrainBatch, Turn
from tests.integration.test_buffer_service import process_env
from tests.support.servers import REPO, ServiceProcess, wait_until
from tests.support.tiny_model import build_tokenizer

pytestmark = pytest.mark.integration

TOKEN = "import-watch-test-token-0001"
CHUNK = 4
# Rules a turn may be excluded by (services/buffer/rules.py): anything else is a bug.
DOCUMENTED = {"no_next_state", "zero_reward", "stale", "side", "no_tokens"}


@dataclass
class Stack:
    env: dict[str, str]
    buffer_url: str
    keys: Keys
    r: redis.Redis

    def cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "services.ctl", "import", *args, "--url", self.buffer_url]

    def proc_env(self) -> dict[str, str]:
        return {**os.environ, **self.env, "NEXTSTATE_INTERNAL__TOKEN": TOKEN}

    def start(self, *args: str, log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen(self.cli(*args), cwd=REPO, env=self.proc_env(), stdout=out,
                                    stderr=subprocess.STDOUT)

    def offsets(self, name: str) -> dict[str, dict[str, Any]]:
        """File path -> its committed position."""
        rows = self.r.hgetall(self.keys.import_offsets(name))
        return {json.loads(v)["path"]: json.loads(v) for v in rows.values()}

    def turns(self) -> list[Turn]:
        return [Turn.from_json(f[K.FIELD]) for _, f in self.r.xrange(self.keys.turns)]


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A rule judge and a buffer with a tokenizer (batches of 4), on a prefix of their own."""
    tok = tmp_path_factory.mktemp("tok")
    build_tokenizer(tok)
    unique = os.urandom(5).hex()
    env = {"NEXTSTATE_ENV": "test", "NEXTSTATE_RUN": f"run-{unique}", "NEXTSTATE_REDIS__URL": redis_url,
           "NEXTSTATE_REDIS__PREFIX": f"iw-{unique}", "NEXTSTATE_INTERNAL__TOKEN": TOKEN}
    penv, url = process_env(env, tokenizer=tok, batch_size=4, max_wait_s=0.5, force_settle_s=3)
    judge_port = free_port()
    judge = ServiceProcess("judge", {**penv, "NEXTSTATE_JUDGE__TYPE": "rule",
                                     "NEXTSTATE_JUDGE__PORT": str(judge_port)}).start()
    buffer = ServiceProcess("buffer", penv).start()
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        judge.wait_http(f"http://127.0.0.1:{judge_port}/healthz", timeout=90)
        buffer.wait_http(f"{url}/readyz", timeout=90)
        yield Stack(env, url, Keys(env["NEXTSTATE_REDIS__PREFIX"]), r)
    except BaseException:
        print(judge.logs(), buffer.logs())
        raise
    finally:
        judge.stop()
        buffer.stop()
        r.close()


def write_lines(path: Path, lines: list[str], *, end: str = "\n", mode: str = "w") -> None:
    with path.open(mode, encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines[:-1]) + lines[-1] + end)


def turn_ids(records: list[dict[str, Any]]) -> set[str]:
    """The ids of the turns the buffer publishes for `records` (trainable main turns)."""
    out = set()
    for raw in records:
        rec = SeedRecord.model_validate(raw)
        out |= {turn_id(rec.session_id, i, t) for i, t in enumerate(rec.turns)
                if t.type == "main" and t.trainable}
    return out


def drained(s: Stack) -> bool:
    def done(key: str, group: str) -> bool:
        g = next((g for g in s.r.xinfo_groups(key) if g["name"] == group), None)
        return g is not None and int(g["pending"]) == 0 and g.get("lag") == 0

    k = s.keys
    return done(k.turns, K.GROUP_JUDGE) and done(k.scored, K.GROUP_BUFFER) and s.r.zcard(k.force_candidates) == 0


def test_watch_killed_mid_file_forwards_every_line_once(stack: Stack, tmp_path: Path) -> None:
    s, name = stack, "watch-test"
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    log = tmp_path / "watch.log"
    big = [*mock_records(240, seed=31, prefix="big")]
    big_lines = [json.dumps(r) for r in big]
    big_lines.insert(40, "{not json")  # line 41
    big_lines.insert(77, json.dumps({"session_id": "bad", "turns": [{"prompt": "p"}]}))  # line 78
    by_line = {n: json.loads(x) for n, x in enumerate(big_lines, start=1) if n not in (41, 78)}
    write_lines(inbox / "big.jsonl", big_lines)
    small = [*mock_records(3, seed=32, prefix="small")]
    partial = json.dumps(small[2])
    write_lines(inbox / "small.jsonl", [json.dumps(small[0]), json.dumps(small[1]), partial[:20]], end="")
    (inbox / "notes.txt").write_text("not followed\n")
    size = (inbox / "big.jsonl").stat().st_size
    args = ("--watch", str(inbox), "--name", name, "--chunk", str(CHUNK), "--poll", "0.1")

    first = s.start(*args, log=log)
    try:
        # SIGKILL once a few hundred lines are in and many are still to go.
        def midway() -> int | None:
            pos = s.offsets(name).get(str(inbox / "big.jsonl"))
            return pos["line"] if pos and pos["line"] >= 60 and pos["offset"] < size else None

        wait_until(lambda: midway() is not None, 120, "the watcher midway through big.jsonl", interval=0.005)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        at_kill = s.offsets(name)[str(inbox / "big.jsonl")]
        assert 0 < at_kill["offset"] < size

        second = s.start(*args, log=log)
        # While it runs: a second watcher under the same name is refused.
        wait_until(lambda: s.r.exists(s.keys.import_lock(name)) and s.offsets(name)[str(inbox / "big.jsonl")]
                   ["line"] > at_kill["line"], 120, "the restarted watcher going on")
        refused = subprocess.run(s.cli(*args), cwd=REPO, env=s.proc_env(), capture_output=True, text=True,
                                 timeout=60)
        assert refused.returncode == 1 and "another importer" in refused.stderr, refused.stderr

        def caught_up() -> bool:
            pos = s.offsets(name)
            return (pos.get(str(inbox / "big.jsonl"), {}).get("offset") == size
                    and pos.get(str(inbox / "small.jsonl"), {}).get("line") == 2)

        wait_until(caught_up, 120, "big.jsonl forwarded to its end, small.jsonl to its partial line")
        assert not turn_ids([small[2]]) & {t.id for t in s.turns()}  # the partial line waits
        # Rotation: big.jsonl renamed within the directory (same inode: not read again);
        # the partial line completed; a new file appears.
        (inbox / "big.jsonl").rename(inbox / "big.1.jsonl")
        with (inbox / "small.jsonl").open("a") as f:
            f.write(partial[20:] + "\n")
        later = [*mock_records(5, seed=33, prefix="later")]
        write_lines(inbox / "later.jsonl", [json.dumps(r) for r in later])

        def settled() -> bool:
            pos = s.offsets(name)
            return (pos.get(str(inbox / "small.jsonl"), {}).get("line") == 3
                    and pos.get(str(inbox / "later.jsonl"), {}).get("line") == 5)

        wait_until(settled, 60, "the completed line and the new file forwarded")
        # The state a watcher killed after the buffer's answer but before its commit leaves:
        # the offset behind what was sent. small.jsonl is sent again, deduplicated downstream.
        ident = next(k for k, v in s.r.hgetall(s.keys.import_offsets(name)).items()
                     if json.loads(v)["path"] == str(inbox / "small.jsonl"))
        s.r.hset(s.keys.import_offsets(name), ident, json.dumps({"offset": 0, "line": 0, "head": "",
                                                                "path": str(inbox / "small.jsonl")}))
        wait_until(lambda: s.offsets(name)[str(inbox / "small.jsonl")]["line"] == 3, 60, "small.jsonl again")
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
    except BaseException:
        print(log.read_text(errors="replace")[-6000:])
        raise
    finally:
        for p in (first, locals().get("second")):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(5)
    assert log.read_text().strip().splitlines()[-1].startswith("imported ")
    wait_until(lambda: drained(s), 120, "turns judged, decided and batched")
    account(s, by_line, small, later, at_kill, inbox)


def account(s: Stack, by_line: dict[int, dict[str, Any]], small: list[dict[str, Any]],
            later: list[dict[str, Any]], at_kill: dict[str, Any], inbox: Path) -> None:
    k = s.keys
    big = list(by_line.values())
    expected = turn_ids(big + small + later)
    entries = s.turns()
    mine = [t for t in entries if t.id in expected or t.session_id.startswith(("big-", "small-", "later-"))]
    seen = collections.Counter(t.id for t in mine)
    assert set(seen) == expected, f"{len(expected - set(seen))} turns lost, {len(set(seen) - expected)} foreign"
    # Sent twice: only the chunk in flight at the kill (lines after the committed offset,
    # at most CHUNK of them, the bad lines counted) and small.jsonl, rewound on purpose.
    kill_line = at_kill["line"]
    in_flight = [r for n, r in by_line.items() if kill_line < n <= kill_line + CHUNK + 2]
    may_repeat = turn_ids(in_flight) | turn_ids(small)
    twice = {i for i, n in seen.items() if n > 1}
    assert twice <= may_repeat, f"{len(twice - may_repeat)} turns sent twice outside the crash window"
    assert turn_ids(small) <= twice  # the rewound file was sent again
    scored = collections.Counter(ScoredTurn.from_json(f[K.FIELD]).turn.id for _, f in s.r.xrange(k.scored))
    assert all(scored[i] >= 1 for i in expected), "turns never judged"
    batches = [TrainBatch.from_json(f[K.FIELD]) for _, f in s.r.xrange(k.batches)]
    in_batches = collections.Counter(x.id for b in batches for x in b.samples)
    assert not [i for i, n in in_batches.items() if n > 1], "a turn in two batches"
    by_id = {t.id: t for t in mine}
    decisions = {i: s.r.hget(k.session_decisions(by_id[i].session_id), i) for i in expected}
    assert not [i for i, d in decisions.items() if d is None], "turns the buffer never decided"
    for i, d in decisions.items():
        if d in ("kept", "forced"):
            assert in_batches[i] == 1, f"turn {i} {d} but in no batch"
        else:
            assert d in DOCUMENTED and in_batches[i] == 0, (i, d)
    assert sum(in_batches[i] for i in expected) > 0
    letters = [DeadLetter.from_json(f[K.FIELD]) for _, f in s.r.xrange(k.dead)]
    where = sorted(x.entry_id for x in letters)
    assert where == [f"{inbox / 'big.jsonl'}:41", f"{inbox / 'big.jsonl'}:78"], where
    errors = {x.entry_id.rsplit(":", 1)[1]: x.error for x in letters}
    assert "not JSON" in errors["41"]
    assert "HTTP 400" in errors["78"] and "turns.0.response: Field required" in errors["78"]
    assert {x.stream for x in letters} == {"import"}
    print(f"{len(expected)} turns from {len(big) + len(small) + len(later)} records: "
          f"{sum(seen.values()) - len(seen)} sent twice ({len(twice & turn_ids(in_flight))} of the chunk in "
          f"flight at the kill after line {kill_line}); {len(batches)} batches, decisions "
          f"{dict(collections.Counter(decisions.values()))}")


def test_mock_continuous_paces_and_stops_cleanly(stack: Stack, tmp_path: Path) -> None:
    s, log = stack, tmp_path / "mock.log"
    before = {t.session_id for t in s.turns()}
    started = time.monotonic()
    proc = s.start("--mock", "3", "--continuous", "--rate", "20", "--seed", "4", log=log)
    try:
        def sessions() -> set[str]:
            return {t.session_id for t in s.turns()} - before

        wait_until(lambda: len(sessions()) >= 12, 60, "12 mock sessions")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        elapsed = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    out = log.read_text()
    last = out.strip().splitlines()[-1]
    sent = int(last.split()[1])
    got = sessions()
    assert len(got) == sent, (len(got), last)  # every session it counted arrived, each once
    assert len({g.rsplit("-", 1)[0] for g in got}) == 1  # one run's nonce
    assert sent % 3 == 0 and sent <= 20 * elapsed + 3, (sent, elapsed)  # 3 per request, never above the rate
    assert "sessions mock-" in out and "until stopped" in out


def test_truncated_files_blank_lines_bad_bytes_and_a_dead_watchers_lock(redis_url: str, tmp_path: Path) -> None:
    """The file-following rules on their own (what the buffer answers is the test above's):
    a truncated file is read again from its start, blank lines advance the offset, a line
    that is not UTF-8 is a dead letter, a hard link is one file, and a lock left by a
    watcher that died on this host is taken over."""
    from services.ctl.import_watch import Watch

    keys = Keys(f"iw-{os.urandom(4).hex()}")
    r: Any = redis.Redis.from_url(redis_url, decode_responses=True)
    sent: list[tuple[int, Any]] = []

    def send(chunk: list[tuple[int, Any]], where: str) -> dict[str, Any]:
        sent.extend(chunk)
        return {"records": len(chunk), "published": len(chunk)}

    inbox = tmp_path / "in"
    inbox.mkdir()
    path = inbox / "a.jsonl"
    path.write_bytes(b'{"n": 1}\n\n   \n\xff\xfe\n{"n": 2}\n')
    os.link(path, inbox / "b.jsonl")
    r.set(keys.import_lock("w"), json.dumps({"host": os.uname().nodename, "pid": 2 ** 22 + 7, "token": "x"}))
    watch = Watch(inbox, "*.jsonl", "w", r, keys, send, 10, threading.Event())
    watch.run(poll=0.1, once=True)
    assert sent == [(1, {"n": 1}), (5, {"n": 2})]  # once, though two names; bad line 4 skipped
    (letter,) = [DeadLetter.from_json(f[K.FIELD]) for _, f in r.xrange(keys.dead)]
    assert letter.entry_id.endswith(":4") and "not UTF-8" in letter.error
    assert r.get(keys.import_lock("w")) is None  # released at the end
    path.write_bytes(b'{"n": 3}\n')  # truncated and rewritten (copytruncate): same inode
    watch.run(poll=0.1, once=True)
    assert sent[-1] == (1, {"n": 3})
    with path.open("ab") as f:
        f.write(b'{"n": 4}\n\n')
    watch.run(poll=0.1, once=True)
    assert sent[-1] == (2, {"n": 4}) and len(sent) == 4
    (pos,) = [json.loads(v) for v in r.hgetall(keys.import_offsets("w")).values()]
    assert (pos["offset"], pos["line"]) == (path.stat().st_size, 3)  # past the trailing blank line
    r.close()
