"""The offline stand-in for MinIO: SeaweedFS `weed mini` serving S3 with MinIO's users.

The compose file's MinIO users become SeaweedFS identities: MINIO_ROOT_USER /
MINIO_ROOT_PASSWORD the admin, `nextstate-<role>` with MINIO_<ROLE>_SECRET each role, with
the rights of services/ctl/bucket_roles.py (a unit test keeps the two tables equal).
`weed` listens on the container's loopback only, telemetry off, its filer/master/volume
HTTP APIs off; this process forwards the container's port 9000 to its S3 port, so S3 (with
keys) is the only door the network sees. It exits when `weed` does, and stops `weed` on
SIGTERM. The bucket itself is created by `bucket-init`, as with MinIO.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

ROLES = ("trainer", "watcher", "buffer", "evaluator")
READS = {"trainer": ("policies", "trainer-state"), "watcher": ("policies",), "buffer": (),
         "evaluator": ("policies",)}
WRITES = {"trainer": ("policies", "trainer-state"), "watcher": (), "buffer": ("samples",),
          "evaluator": ("evals",)}
LISTEN_PORT = 9000
WEED_PORTS = {"master": 9333, "volume": 8080, "filer": 8888, "s3": 8333, "admin": 23646}
DATA = Path(os.environ.get("S3_DATA_DIR", "/data"))


def actions(role: str, bucket: str) -> list[str]:
    if role == "admin":
        return ["Admin", "Read", "List", "Tagging", "Write"]
    return ([f"Read:{bucket}/{p}/*" for p in READS[role]] + [f"Write:{bucket}/{p}/*" for p in WRITES[role]]
            + [f"List:{bucket}"])


def identities(env: dict[str, str]) -> dict[str, object]:
    """SeaweedFS's `-s3.config` for the users of the compose file's environment."""
    def need(name: str) -> str:
        value = env.get(name, "")
        if not value:
            sys.exit(f"s3: set {name}")
        return value

    bucket = env.get("BUCKET", "nextstate")
    users = [("admin", need("MINIO_ROOT_USER"), need("MINIO_ROOT_PASSWORD"))]
    users += [(role, f"nextstate-{role}", need(f"MINIO_{role.upper()}_SECRET")) for role in ROLES]
    return {"identities": [
        {"name": role, "credentials": [{"accessKey": key, "secretKey": secret}], "actions": actions(role, bucket)}
        for role, key, secret in users
    ]}


def weed_argv(config: Path) -> list[str]:
    return [
        "/opt/weed/bin/weed", "mini", f"-dir={DATA / 'weed'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        *(f"-{name}.port={port}" for name, port in WEED_PORTS.items()),
        "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-master.telemetry=false", "-disableHttp", f"-s3.config={config}",
    ]


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def forward(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
    try:
        up_r, up_w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", WEED_PORTS["s3"]), 10)
    except (OSError, asyncio.TimeoutError):
        client_w.close()
        return
    await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w))


async def main() -> int:
    (DATA / "weed").mkdir(parents=True, exist_ok=True)
    config = Path("/tmp/s3-identities.json")
    fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(identities(dict(os.environ)), f)
    weed = await asyncio.create_subprocess_exec(*weed_argv(config), cwd=str(DATA))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, weed.terminate)
    server = await asyncio.start_server(forward, "0.0.0.0", LISTEN_PORT)
    async with server:
        rc = await weed.wait()
    return rc


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
