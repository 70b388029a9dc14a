"""`nextstate import --watch DIR`: forward a directory's `.jsonl` files as they appear and grow.

Every `--poll` seconds the watcher lists DIR (`--pattern`, default `*.jsonl`; not its
subdirectories) and reads each file, oldest first, from where it left off: complete lines
only (a last line without its newline waits for it), `--chunk` records per `POST /receive`
(the same records, credential and retries as `nextstate import FILE`).

**Each line once, across restarts.** A file is known by its identity, device and inode, and
checked by the hash of its first bytes (up to 4 KiB). Per identity the watcher keeps in
Redis (`keys.import_offsets(name)`) the byte offset and line number after the last line it
forwarded, committed only once the buffer accepted those lines (HTTP 200). So:

- a file renamed within DIR (rotated to `app.1.jsonl`) keeps its offset; a file truncated
  (copytruncate) or a new file on a reused inode (its head differs) is read from the start;
- killed (SIGKILL, a lost machine) between the buffer's answer and the commit, the restarted
  watcher sends that chunk again. Its records make the same turn ids (services/buffer/seeds.py:
  a hash of the content), so the judges skip them (their dedupe mark on the id, kept
  `NEXTSTATE_STREAMS__DEDUPE_TTL_S`) and the buffer never batches a turn twice. The
  guarantee: every complete line is forwarded at least once, at most one chunk of lines a
  second time after a crash, and each turn is trained at most once;
- a line that is not UTF-8 or not JSON, or that the buffer refuses (HTTP 400: not a record,
  cannot tokenize), goes to the `dead` stream — `entry_id` is `<path>:<line>`, `error` says
  why, `data` holds the line — in one transaction with the offset past it: dead-lettered
  once. A chunk the buffer refuses is split until each bad line is alone; the others go on.

One watcher per name: a lock (`keys.import_lock(name)`, a TTL renewed as it works) refuses a
second one; a lock left by a watcher that died on this host is taken over at once. `--name`
(default: a hash of DIR's absolute path) names the offsets, so two directories never share
them; a moved directory starts over (its lines are deduplicated as above).

SIGTERM or Ctrl-C: the chunk in flight finishes and is committed, then exit 0. `--once`:
one pass over what is there, then exit. A buffer that does not answer (after `--retries`)
or a Redis error abandons the pass, uncommitted; the next poll tries again: nothing skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import redis
from redis.exceptions import RedisError

from services.ctl.common import redis_error, settings_from
from services.ctl.import_send import (
    Refused,
    Stopped,
    Unauthorized,
    buffer_url,
    internal_token,
    send_chunk,
    stop_on_signals,
)
from shared.auth import bearer
from shared.errors import NextstateError
from shared.keys import Keys
from shared.schemas import DeadLetter

HEAD_BYTES = 4096  # a file's identity is checked against the hash of this much of its start
LOCK_TTL_S = 30
FORGET_S = 7 * 24 * 3600  # offsets of files gone from the directory this long are dropped
DEAD_STREAM = "import"  # a dead letter's `stream`: not a stream (`dlq requeue` refuses it)
LINE_FAULTS = (400, 413, 422)  # the buffer refused what the lines hold, not how they came


def add_watch_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--watch DIR (services/ctl/import_watch.py)")
    g.add_argument("--watch", metavar="DIR", help="follow DIR's .jsonl files as they appear and grow; "
                   "each line once across restarts, bad lines to dead letters")
    g.add_argument("--pattern", default="*.jsonl", help="file names to follow in DIR (default *.jsonl)")
    g.add_argument("--poll", type=float, default=1.0, help="seconds between looks at DIR (default 1)")
    g.add_argument("--name", help="the watch's name in Redis (offsets, lock); default: a hash of DIR's path")
    g.add_argument("--once", action="store_true", help="one pass over what DIR holds now, then exit")


class PassAbandoned(NextstateError):
    """This pass stopped before its end (the buffer or Redis did not answer); nothing past
    the last commit counts as read, and the next pass starts there."""


@dataclass
class Position:
    """How far one file was forwarded: after line `line`, at byte `offset`."""

    offset: int = 0
    line: int = 0
    head: str = ""  # sha256 of the file's first min(offset, HEAD_BYTES) bytes
    path: str = ""
    at: float = 0.0

    @classmethod
    def parse(cls, raw: str | None) -> Position | None:
        if not raw:
            return None
        try:
            obj = json.loads(raw)
            return cls(int(obj["offset"]), int(obj["line"]), str(obj["head"]), str(obj.get("path", "")),
                       float(obj.get("at", 0.0)))
        except (ValueError, KeyError, TypeError):
            return None  # unreadable: read the file again (resent lines are deduplicated)


@dataclass
class Line:
    number: int
    end: int  # byte offset just past its newline
    record: Any
    raw: bytes


@dataclass
class Totals:
    records: int = 0
    published: int = 0
    side: int = 0
    untrainable: int = 0
    dead: int = 0
    files: set[str] = field(default_factory=set)


def head_hash(f: IO[bytes], upto: int) -> str:
    data = os.pread(f.fileno(), min(upto, HEAD_BYTES), 0)
    return hashlib.sha256(data).hexdigest()


def default_name(directory: Path) -> str:
    return hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:12]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Watch:
    def __init__(self, directory: Path, pattern: str, name: str, r: redis.Redis, keys: Keys,
                 send: Callable[[list[tuple[int, Any]], str], dict[str, Any]], chunk: int,
                 stop: threading.Event) -> None:
        self.directory = directory
        self.pattern = pattern
        self.name = name
        self.r: Any = r  # decode_responses: str replies (redis-py types them bytes | str)
        self.offsets = keys.import_offsets(name)
        self.lock = keys.import_lock(name)
        self.dead_key = keys.dead
        self.send = send  # (chunk, where) -> the buffer's answer; raises like `send_chunk`
        self.chunk = chunk
        self.stop = stop
        self.totals = Totals()
        self.owner = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "token": os.urandom(8).hex()})
        self._renewed = 0.0

    # -- the lock ---------------------------------------------------------------------------
    def acquire(self) -> None:
        if self.r.set(self.lock, self.owner, nx=True, ex=LOCK_TTL_S):
            self._renewed = time.monotonic()
            return
        raw = self.r.get(self.lock)
        try:
            held = json.loads(raw) if raw else {}
        except ValueError:
            held = {}
        if held.get("host") == socket.gethostname() and isinstance(held.get("pid"), int) \
                and not _alive(held["pid"]):
            pipe = self.r.pipeline(transaction=True)  # take over a dead watcher's lock
            pipe.delete(self.lock)
            pipe.set(self.lock, self.owner, ex=LOCK_TTL_S)
            pipe.execute()
            self._renewed = time.monotonic()
            print(f"nextstate import: took over the lock of watcher pid {held['pid']} (no longer running)",
                  file=sys.stderr)
            return
        raise NextstateError(
            f"another importer (pid {held.get('pid', '?')} on {held.get('host', '?')}) watches under the "
            f"name {self.name}: stop it first (if it died on another machine, its lock expires within "
            f"{LOCK_TTL_S}s), or give this one another --name")

    def renew(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._renewed < LOCK_TTL_S / 3:
            return
        held = self.r.get(self.lock)
        if held is None and self.r.set(self.lock, self.owner, nx=True, ex=LOCK_TTL_S):
            held = self.owner  # it expired (a long stall) or Redis lost it: ours again
        if held != self.owner:
            raise NextstateError(f"the lock of watch {self.name} was taken by another importer; stopping")
        self.r.expire(self.lock, LOCK_TTL_S)
        self._renewed = time.monotonic()

    def release(self) -> None:
        try:
            if self.r.get(self.lock) == self.owner:
                self.r.delete(self.lock)
        except RedisError:
            pass  # it expires

    # -- passes -----------------------------------------------------------------------------
    def files(self) -> list[tuple[Path, os.stat_result]]:
        out = []
        for path in self.directory.glob(self.pattern):
            try:
                st = path.stat()
            except OSError:
                continue  # gone since the listing
            if stat.S_ISREG(st.st_mode):
                out.append((path, st))
        return sorted(out, key=lambda x: (x[1].st_mtime_ns, x[0].name))

    def scan(self) -> None:
        """One pass: every file's new complete lines forwarded and committed."""
        if not self.directory.is_dir():
            raise NextstateError(f"{self.directory} is not a directory")
        try:
            known: dict[str, str] = self.r.hgetall(self.offsets)
        except RedisError as exc:
            raise PassAbandoned(f"Redis did not answer: {exc}") from exc
        seen: set[str] = set()
        for path, st in self.files():
            ident = f"{st.st_dev}:{st.st_ino}"
            if ident in seen:
                continue  # a second name (hard link) of a file read already
            seen.add(ident)
            pos = Position.parse(known.get(ident))
            if pos is not None and pos.offset == st.st_size:
                continue
            self.follow(path, ident, pos)
            if self.stop.is_set():
                return
        self.forget(known, seen)

    def follow(self, path: Path, ident: str, pos: Position | None) -> None:
        try:
            f = path.open("rb")
        except OSError:
            return  # gone or unreadable since the listing: the next pass sees
        with f:
            st = os.fstat(f.fileno())
            if f"{st.st_dev}:{st.st_ino}" != ident:
                return  # replaced between the listing and the open
            if pos is not None and (st.st_size < pos.offset or head_hash(f, pos.offset) != pos.head):
                print(f"nextstate import: {path} was truncated or replaced: reading it from the start",
                      file=sys.stderr)
                pos = None
            pos = pos or Position()
            f.seek(pos.offset)
            self.totals.files.add(ident)
            committed = offset = pos.offset
            number = pos.line
            batch: list[Line] = []
            while not self.stop.is_set():
                raw = f.readline()
                if not raw.endswith(b"\n"):
                    break  # the end, or a last line still being written: it waits for its newline
                number += 1
                offset += len(raw)
                record, problem = parse_line(raw)
                if problem is not None:
                    self.deliver(f, path, ident, batch)
                    batch = []
                    self.dead_letter(f, path, ident, Line(number, offset, None, raw), problem)
                    committed = offset
                elif record is not None:
                    batch.append(Line(number, offset, record, raw))
                    if len(batch) >= self.chunk:
                        self.deliver(f, path, ident, batch)
                        batch, committed = [], offset
            self.deliver(f, path, ident, batch)
            if batch:
                committed = batch[-1].end
            if offset > committed and not self.stop.is_set():  # blank lines at the end
                self.commit(f, path, ident, offset, number)

    def deliver(self, f: IO[bytes], path: Path, ident: str, lines: list[Line]) -> None:
        """Send `lines`, then commit past the last; the lines the buffer refuses are split
        out and dead-lettered, the rest sent."""
        if not lines:
            return
        try:
            result = self.send([(x.number, x.record) for x in lines], f"{path} lines")
        except Refused as exc:
            if exc.status not in LINE_FAULTS:
                raise PassAbandoned(str(exc)) from exc
            if len(lines) > 1:
                half = len(lines) // 2
                self.deliver(f, path, ident, lines[:half])
                self.deliver(f, path, ident, lines[half:])
                return
            self.dead_letter(f, path, ident, lines[0], f"the buffer refused it (HTTP {exc.status}): {exc.message}")
            return
        except Stopped:
            raise PassAbandoned("stopped") from None
        except Unauthorized:
            raise  # nothing a retry would fix
        except NextstateError as exc:  # no answer after the retries
            raise PassAbandoned(str(exc)) from exc
        self.commit(f, path, ident, lines[-1].end, lines[-1].number)
        t = self.totals
        t.records += int(result.get("records", 0))
        t.published += int(result.get("published", 0))
        t.side += int(result.get("side", 0))
        t.untrainable += int(result.get("untrainable", 0))
        print(f"{path.name} lines {lines[0].number}-{lines[-1].number}: records {t.records}  "
              f"turns published {t.published}  side {t.side}  untrainable {t.untrainable}  "
              f"dead {t.dead}", flush=True)

    def _position(self, f: IO[bytes], path: Path, offset: int, number: int) -> str:
        return json.dumps(asdict(Position(offset, number, head_hash(f, offset), str(path), time.time())))

    def commit(self, f: IO[bytes], path: Path, ident: str, offset: int, number: int) -> None:
        try:
            self.r.hset(self.offsets, ident, self._position(f, path, offset, number))
            self.renew()
        except RedisError as exc:
            raise PassAbandoned(f"Redis did not answer: {exc}") from exc

    def dead_letter(self, f: IO[bytes], path: Path, ident: str, line: Line, problem: str) -> None:
        """The line to `dead` and the offset past it, in one transaction."""
        where = f"{path}:{line.number}"
        letter = DeadLetter(stream=DEAD_STREAM, group="watch", entry_id=where,
                            data=line.raw.decode("utf-8", "replace").rstrip("\n"), error=f"{where}: {problem}"[:2000],
                            deliveries=1, consumer=self.name)
        try:
            pipe = self.r.pipeline(transaction=True)
            pipe.xadd(self.dead_key, {"data": letter.to_json()})
            pipe.hset(self.offsets, ident, self._position(f, path, line.end, line.number))
            pipe.execute()
        except RedisError as exc:
            raise PassAbandoned(f"Redis did not answer: {exc}") from exc
        self.totals.dead += 1
        print(f"nextstate import: {where}: dead-lettered: {problem}", file=sys.stderr, flush=True)

    def forget(self, known: dict[str, str], seen: set[str]) -> None:
        """Drop the offsets of files gone from the directory for FORGET_S."""
        old = [ident for ident, raw in known.items()
               if ident not in seen and (p := Position.parse(raw)) is not None and p.at < time.time() - FORGET_S]
        if old:
            try:
                self.r.hdel(self.offsets, *old)
            except RedisError:
                pass

    def run(self, poll: float, once: bool) -> None:
        self.acquire()
        try:
            while not self.stop.is_set():
                try:
                    self.scan()
                except PassAbandoned as exc:
                    if self.stop.is_set():
                        break
                    print(f"nextstate import: pass abandoned ({exc}); trying again in {poll:g}s",
                          file=sys.stderr, flush=True)
                    if once:
                        raise NextstateError(f"--once: the pass did not finish: {exc}") from None
                if once:
                    break
                try:
                    self.renew()
                except RedisError as exc:
                    print(f"nextstate import: Redis did not answer ({exc})", file=sys.stderr)
                self.stop.wait(poll)
        finally:
            self.release()


def parse_line(raw: bytes) -> tuple[Any, str | None]:
    """(record, None) for a JSON line, (None, None) for a blank one, (None, why) for a bad one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 ({exc.reason} at byte {exc.start})"
    if not text.strip():
        return None, None
    try:
        return json.loads(text), None
    except ValueError as exc:
        return None, f"not JSON: {exc}"


def run_watch(args: argparse.Namespace) -> int:
    directory = Path(args.watch)
    if not directory.is_dir():
        raise NextstateError(f"--watch {directory}: not a directory")
    if args.poll <= 0:
        raise NextstateError("--poll must be more than 0 seconds")
    settings = settings_from(args)
    name = args.name or default_name(directory)
    keys = Keys(settings.redis.prefix)
    r = redis.Redis.from_url(settings.redis.url, decode_responses=True,
                             socket_timeout=settings.redis.socket_timeout,
                             socket_connect_timeout=settings.redis.connect_timeout)
    url = buffer_url(args)
    stop = stop_on_signals()
    with httpx.Client(timeout=args.timeout, headers=bearer(internal_token(url))) as client, r:
        def send(chunk: list[tuple[int, Any]], where: str) -> dict[str, Any]:
            return send_chunk(client, url, chunk, args.retries, where, stop)

        watch = Watch(directory, args.pattern, name, r, keys, send, args.chunk, stop)
        print(f"nextstate import: watching {directory.resolve()}/{args.pattern} as {name} "
              f"(offsets in {watch.offsets}) into {url}", file=sys.stderr, flush=True)
        try:
            watch.run(args.poll, args.once)
        except RedisError as exc:
            raise redis_error(exc, settings) from exc
    t = watch.totals
    print(f"imported {t.records} records from {len(t.files)} files: {t.published} turns published to "
          f"turns, {t.side} side and {t.untrainable} untrainable turns skipped, {t.dead} lines "
          "dead-lettered", flush=True)
    return 0
