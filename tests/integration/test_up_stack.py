"""`nextstate up`'s infrastructure for real: Redis and SeaweedFS, a port race, the records.

Someone takes each port right after `up` picked it: Redis and SeaweedFS fail to listen
(each words it its own way), are moved to new ports, and what is started after them is
built from the final ones. The supervisor's state records land in `up`'s own Redis,
which runs append-only with an fsync per write; stack.json says where everything is.
"""

from __future__ import annotations

import io
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from services.ctl.__main__ import build_parser
from services.ctl.supervisor import Proc, Supervisor
from services.ctl.up import Stack, redact
from shared.keys import Keys
from shared.settings import Settings, load_settings
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration


class RacyStack(Stack):
    """A Stack whose first choice of port for each process is taken by someone else
    between choosing it and starting the process."""

    squatters: dict[str, socket.socket]

    def movable(self, name: str, preferred: int, build: Callable[[int], Proc], fixed: int | None = None) -> Proc:
        def racy(port: int) -> Proc:
            proc = build(port)
            if name not in self.squatters:
                assert proc.port is not None
                self.squatters[name] = squatter = socket.socket()
                squatter.bind(("127.0.0.1", proc.port))
            return proc

        return super().movable(name, preferred, racy, fixed)


@pytest.fixture
def stack(tmp_path: Path, unique: str, monkeypatch: pytest.MonkeyPatch) -> RacyStack:
    for name in ("NEXTSTATE_REDIS__URL", "NEXTSTATE_BUCKET__ENDPOINT", "NEXTSTATE_ENV"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NEXTSTATE_RUN", f"run-{unique}")
    monkeypatch.setenv("NEXTSTATE_REDIS__PREFIX", f"t-{unique}")
    args = build_parser().parse_args(["up", "--home", str(tmp_path / "home")])
    racy = RacyStack(args, load_settings(Settings), Supervisor(out=io.StringIO(), publish_every_s=0.2))
    racy.squatters = {}
    return racy


async def test_infrastructure_survives_a_port_race_and_records_itself(stack: RacyStack, unique: str) -> None:
    out = stack.sup.out
    assert isinstance(out, io.StringIO)
    try:
        await stack.infrastructure()
        redis_proc, s3_proc = stack.sup.procs
        squatted = {s.getsockname()[1] for s in stack.squatters.values()}
        assert len(squatted) == 2 and redis_proc.port not in squatted and s3_proc.port not in squatted
        assert (redis_proc.state, s3_proc.state) == ("ready", "ready")
        assert out.getvalue().count("could not listen on port") == 2
        # Both wordings of "taken" were recognised (the output is echoed with a prefix).
        assert "Address already in use" in out.getvalue() and "Port allocation failed" in out.getvalue()

        # What is started after them gets the final endpoints.
        assert urlsplit(stack.redis_env("judge-0")["NEXTSTATE_REDIS__URL"]).port == redis_proc.port
        assert stack.bucket_role("trainer")["NEXTSTATE_BUCKET__ENDPOINT"] == f"127.0.0.1:{s3_proc.port}"

        client = aioredis.Redis.from_url(stack.redis_urls["default"], decode_responses=True)  # admin: CONFIG
        try:
            assert await client.config_get("appendonly") == {"appendonly": "yes"}
            assert await client.config_get("appendfsync") == {"appendfsync": "always"}
            key = Keys(f"t-{unique}").services

            async def records() -> dict[str, dict[str, Any]] | None:
                got = {str(k): json.loads(v) for k, v in (await client.hgetall(key)).items()}
                return got if {r["state"] for r in got.values()} == {"ready"} and len(got) == 2 else None

            got = await eventually(records, 10, "both records in up's Redis")
            assert got["redis"]["port"] == redis_proc.port and got["redis"]["serving_path"] is True
            assert got["s3"]["pid"] == s3_proc.pid and got["s3"]["port"] == s3_proc.port
        finally:
            await client.aclose()

        record = json.loads(stack.record_path.read_text())
        assert stack.record_path == stack.root / "stack.json" and stack.root.parent.name == "up"
        assert record["run"] == f"run-{unique}" and record["prefix"] == f"t-{unique}"
        assert record["redis_url"] == redact(stack.redis_url) == f"redis://ctl:***@127.0.0.1:{redis_proc.port}/0"
        assert record["bucket"] == {"endpoint": f"127.0.0.1:{s3_proc.port}", "name": stack.settings.bucket.name}
        assert record["services"]["redis"] == {
            "port": redis_proc.port, "pid": redis_proc.pid, "url": f"redis://127.0.0.1:{redis_proc.port}/0"}
        assert record["services"]["s3"]["url"] == f"http://127.0.0.1:{s3_proc.port}"
        assert "stopped" not in record and record["pid"] > 0
        assert "minioadmin" not in stack.record_path.read_text()  # no secrets
    finally:
        await stack.sup.stop(grace_s=10)
        stack.write_record(stopped=True)
        for s in stack.squatters.values():
            s.close()
    record = json.loads(stack.record_path.read_text())
    assert record["stopped"] is True
    assert all(s["pid"] is None for s in record["services"].values())


def test_redact_hides_only_the_password() -> None:
    assert redact("redis://:s3cret@redis:6379/0") == "redis://:***@redis:6379/0"
    assert redact("rediss://app:s3cret@host:6380/1") == "rediss://app:***@host:6380/1"
    assert redact("redis://127.0.0.1:6390/0") == "redis://127.0.0.1:6390/0"
