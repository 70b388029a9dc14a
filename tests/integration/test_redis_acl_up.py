"""`nextstate up`'s own Redis has a password and one ACL user per role, and keeps them.

The real `Stack.infrastructure()` (the bucket is pointed elsewhere, so only Redis runs):
an owner-only aclfile with hashed passwords, each service's URL naming its own role, the
ctl URL in secrets.json and none in stack.json, and the supervisor's state records
written as ctl. Then Redis is SIGKILLed: the supervisor restarts it with the same
aclfile, and every user, the data (append-only file) and the records are back.
"""

from __future__ import annotations

import io
import json
import os
import signal
import stat
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, NoPermissionError

from services.ctl import redis_acl
from services.ctl.__main__ import build_parser
from services.ctl.supervisor import Backoff, Supervisor
from services.ctl.up import Stack
from shared import keys as K
from shared.settings import Settings, load_settings
from shared.streams import Bus
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
def stack(tmp_path: Path, unique: str, monkeypatch: pytest.MonkeyPatch) -> Stack:
    for name in [n for n in os.environ if n.startswith("NEXTSTATE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("NEXTSTATE_RUN", f"run-{unique}")
    monkeypatch.setenv("NEXTSTATE_REDIS__PREFIX", f"t-{unique}")
    monkeypatch.setenv("NEXTSTATE_BUCKET__ENDPOINT", "127.0.0.1:9")  # not started: Redis only
    args = build_parser().parse_args(["up", "--home", str(tmp_path / "home")])
    sup = Supervisor(out=io.StringIO(), publish_every_s=0.2, backoff=Backoff(base_s=0.1, cap_s=0.5))
    return Stack(args, load_settings(Settings), sup)


async def pings(url: str) -> bool:
    client = aioredis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        return bool(await client.ping())
    finally:
        await client.aclose()


async def test_up_redis_has_a_user_per_role_and_keeps_them_after_sigkill(stack: Stack, unique: str) -> None:
    keys = K.Keys(f"t-{unique}")
    try:
        await stack.infrastructure()
        (redis_proc,) = stack.sup.procs
        port = redis_proc.port
        assert port is not None and redis_proc.state == "ready"

        # The aclfile: in the run's folder, owner-only, passwords hashed.
        aclfile = stack.root / "redis.acl"
        assert stat.S_IMODE(aclfile.stat().st_mode) == 0o600
        assert "--aclfile" in redis_proc.argv and str(aclfile.resolve()) in redis_proc.argv
        text = aclfile.read_text()
        assert {line.split()[1] for line in text.splitlines()} == set(redis_acl.USERS)
        for url in stack.redis_urls.values():
            assert urlsplit(url).password not in text

        # Each service its own user; the engine none. The CLI's (ctl) URL is a secret.
        for name, role in [("collector", "collector"), ("judge-0", "judge"), ("judge-3", "judge"),
                           ("buffer", "buffer"), ("trainer", "trainer"), ("watcher", "watcher")]:
            url = stack.redis_env(name)["NEXTSTATE_REDIS__URL"]
            assert urlsplit(url).username == role and urlsplit(url).port == port
        assert stack.redis_env("engine") == {}
        secrets_file = stack.root / "secrets.json"
        assert stat.S_IMODE(secrets_file.stat().st_mode) == 0o600
        secrets = json.loads(secrets_file.read_text())
        assert secrets["redis_url"] == stack.redis_url and urlsplit(stack.redis_url).username == "ctl"
        assert urlsplit(secrets["redis_admin_url"]).username == redis_acl.ADMIN
        stack.write_record()
        record = stack.record_path.read_text()
        assert json.loads(record)["redis_url"] == f"redis://ctl:***@127.0.0.1:{port}/0"
        assert all(urlsplit(u).password not in record for u in stack.redis_urls.values())

        async def users_work() -> bool:
            for url in stack.redis_urls.values():
                assert await pings(url)
            return True

        await users_work()
        with pytest.raises(AuthenticationError):
            await pings(f"redis://127.0.0.1:{port}/0")  # no password, no Redis

        settings = Settings(env="test", redis={"url": stack.redis_urls["collector"], "prefix": keys.prefix})
        async with Bus(settings) as collector:
            assert await collector.publish_raw(K.TURNS, "{}") is not None
            with pytest.raises(NoPermissionError):
                await collector.redis.xrange(keys.batches)
        admin = aioredis.Redis.from_url(secrets["redis_admin_url"], decode_responses=True)
        try:
            await eventually(lambda: admin.hexists(keys.services, "redis"), what="the supervisor's records")
            await admin.delete(keys.services)

            old = redis_proc.pid
            assert old is not None
            os.kill(old, signal.SIGKILL)
            await eventually(lambda: redis_proc.pid not in (None, old) and redis_proc.state == "ready",
                             timeout=30, what="Redis restarted by the supervisor")
            await users_work()  # the same users and passwords, from the same aclfile
            await admin.aclose()  # its connection died with the old Redis
            admin = aioredis.Redis.from_url(secrets["redis_admin_url"], decode_responses=True)
            assert await admin.xlen(keys.turns) == 1  # and the data, from the append-only file
            record_again = await eventually(lambda: admin.hget(keys.services, "redis"), what="records again")
            assert json.loads(record_again)["restarts"] == 1
        finally:
            await admin.aclose()
    finally:
        await stack.sup.stop(grace_s=10)
        stack.write_record(stopped=True)
