"""A local append-only file of capture operations that could not reach Redis.

While Redis is unreachable the collector keeps serving; what it would have written —
turns to publish, pending turns to store, and pending turns closed locally — is
appended here as JSON lines, and replayed in order once Redis answers again. The file
survives a restart: a collector that starts with a non-empty spool flushes it first.

Flushing rotates the file (`<path>` -> `<path>.flushing`) so that new operations keep
appending while the old ones replay; a flush that fails part-way rewrites the
`.flushing` file with what is left, so nothing is replayed twice by this process
(consumers deduplicate by message id anyway). The spool is bounded: past `max_bytes`
new operations are shed and counted.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

Op = dict[str, Any]


class Spool:
    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.flushing = path.with_name(path.name + ".flushing")
        self.max_bytes = max_bytes
        self._fh: IO[bytes] | None = None
        self._size = _size(path)
        self._flushing_size = _size(self.flushing)

    @property
    def bytes(self) -> int:
        return self._size + self._flushing_size

    def has_data(self) -> bool:
        return self._size > 0 or self._flushing_size > 0

    def append(self, op: Op) -> bool:
        """Write one operation; False when the spool is full (the operation is shed)."""
        line = json.dumps(op, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
        if self.bytes + len(line) > self.max_bytes:
            return False
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "ab")  # held open for the process's life
        self._fh.write(line)
        self._fh.flush()
        self._size += len(line)
        return True

    def take(self) -> list[Op]:
        """The operations to replay next: the `.flushing` file, rotating the spool into
        it first when it is absent. Empty when there is nothing to replay."""
        if self._flushing_size == 0 and self._size > 0:
            self.close()
            os.replace(self.path, self.flushing)
            self._flushing_size, self._size = self._size, 0
        if self._flushing_size == 0:
            return []
        ops: list[Op] = []
        bad = 0
        with open(self.flushing, "rb") as fh:
            for raw in fh:
                try:
                    op = json.loads(raw)
                except ValueError:
                    bad += 1  # a torn last line after a crash
                    continue
                if isinstance(op, dict) and "op" in op:
                    ops.append(op)
                else:
                    bad += 1
        if bad:
            log.warning("skipped unreadable spool lines", extra={"lines": bad, "path": str(self.flushing)})
        return ops

    def settle(self, remaining: list[Op]) -> None:
        """After a replay: drop the `.flushing` file, or keep only what was not replayed."""
        if not remaining:
            self.flushing.unlink(missing_ok=True)
            self._flushing_size = 0
            return
        tmp = self.flushing.with_name(self.flushing.name + ".tmp")
        data = b"".join(
            json.dumps(op, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
            for op in remaining
        )
        tmp.write_bytes(data)
        os.replace(tmp, self.flushing)
        self._flushing_size = len(data)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
