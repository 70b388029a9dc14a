"""The Redis of docker-compose.yml and deploy/k8s, started for real (without Docker or a
cluster): the container's own command runs under `sh` — the ACL script, then
`docker-entrypoint.sh redis-server ...`, here a stand-in that adds a free port and a
scratch folder — with the environment compose or the pod would give it. Then every
service connects with the URL its compose service / workload gets, as its own user:
allowed what its role allows, refused the rest.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError

from services.ctl import redis_acl
from services.ctl.infra import free_port, redis_server_binary
from shared.keys import Keys
from tests.support.servers import stop_process, wait_until
from tests.unit import test_deploy_compose as compose_file
from tests.unit import test_deploy_k8s as k8s_files

pytestmark = pytest.mark.integration


class ContainerRedis:
    """`sh -c <command>` as the Redis container runs it, /data and /etc/redis-acl moved
    under `root`, docker-entrypoint.sh standing in for the image's."""

    def __init__(self, root: Path, command: str, env: dict[str, str], files: dict[str, str] | None = None) -> None:
        self.port = free_port()
        data = root / "data"
        data.mkdir(parents=True)
        bin_dir = root / "bin"
        bin_dir.mkdir()
        entrypoint = bin_dir / "docker-entrypoint.sh"
        entrypoint.write_text(
            "#!/bin/sh\n[ \"$1\" = redis-server ] && shift\n"
            f"exec {redis_server_binary()} \"$@\" --port {self.port} --bind 127.0.0.1 --dir {data} --save ''\n")
        entrypoint.chmod(0o755)
        def moved(text: str) -> str:
            return text.replace("/data/", f"{data}/").replace("/etc/redis-acl/", f"{root}/etc/redis-acl/")

        for path, text in (files or {}).items():
            target = root / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(moved(text))
        command = moved(command)
        self.log = root / "redis.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(["sh", "-c", command], cwd=data, stdout=log, stderr=subprocess.STDOUT,
                                         env={**env, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
        self.aclfile = data / "users.acl"

    def url(self, url: str) -> str:
        """A service's URL, pointed at this server."""
        parts = urlsplit(url)
        netloc = f"{parts.username}:{parts.password}@127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def wait(self, admin_password: str) -> None:
        client = redis.Redis(port=self.port, password=admin_password, socket_timeout=1, socket_connect_timeout=1)
        try:
            def up() -> bool:
                assert self.proc.poll() is None, self.log.read_text()
                return bool(client.ping())

            wait_until(up, 15, f"the container's redis-server on :{self.port}")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}:\n{self.log.read_text()}") from None
        finally:
            client.close()

    def close(self) -> None:
        stop_process(self.proc)


@pytest.fixture
def started() -> Iterator[list[ContainerRedis]]:
    servers: list[ContainerRedis] = []
    yield servers
    for s in servers:
        s.close()


def check_users(server: ContainerRedis, urls: dict[str, str], prefix: str) -> None:
    """Each service's URL logs in as its own user, who may do its job and nothing else."""
    keys = Keys(prefix)
    assert (server.aclfile.stat().st_mode & 0o777) == 0o600
    clients = {name: redis.Redis.from_url(server.url(u), decode_responses=True, socket_timeout=2)
               for name, u in urls.items()}
    try:
        for c in clients.values():
            assert c.ping()
            with pytest.raises(NoPermissionError):
                c.config_get("maxmemory")
            with pytest.raises(NoPermissionError):
                c.flushall()
        collector, judge = clients["collector"], clients["judge"]
        collector.xadd(keys.turns, {"data": "{}"})
        judge.xgroup_create(keys.turns, "judge", id="0")
        assert judge.xreadgroup("judge", "judge-0", {keys.turns: ">"})
        with pytest.raises(NoPermissionError):
            collector.xrange(keys.batches)
        with pytest.raises(NoPermissionError):
            judge.xadd(keys.batches, {"data": "x"})
        with pytest.raises(NoPermissionError):
            clients["trainer"].xadd(keys.turns, {"data": "x"})
        with pytest.raises(NoPermissionError):
            clients["watcher"].delete(keys.policy)
        with pytest.raises(NoPermissionError):
            collector.xadd("another-prefix:turns", {"data": "x"})
        wrong = redis.Redis(port=server.port, username="judge", password="wrong")
        with pytest.raises(AuthenticationError):
            wrong.ping()
        wrong.close()
    finally:
        for c in clients.values():
            c.close()


def test_compose_redis_starts_with_the_acl_users(tmp_path: Path, started: list[ContainerRedis]) -> None:
    env = compose_file.filled_example_env()
    env["NEXTSTATE_PREFIX"] = "exp"
    svcs = compose_file.compose(env)["services"]
    redis_svc = svcs["redis"]
    _, _, command = redis_svc["command"]
    server = ContainerRedis(tmp_path, command, {k: str(v) for k, v in redis_svc["environment"].items()})
    started.append(server)
    server.wait(env["REDIS_PASSWORD"])
    urls = {compose_file.REDIS_ROLES[name]: str(svc["environment"]["NEXTSTATE_REDIS__URL"])
            for name, svc in svcs.items() if name in compose_file.REDIS_ROLES}
    assert set(urls) == set(redis_acl.COMPOSE_USERS) - {redis_acl.ADMIN}
    check_users(server, urls, "exp")


def test_k8s_redis_starts_with_the_acl_users(tmp_path: Path, started: list[ContainerRedis]) -> None:
    docs = k8s_files.base_docs()
    secret = k8s_files.by_kind(docs, "Secret")["nextstate-secrets"]["stringData"]
    for name in secret:  # the operator fills in the template
        secret[name] = f"Filled{name.title().replace('_', '')}0123"
    pod = k8s_files.by_kind(docs, "StatefulSet")["redis"]["spec"]["template"]["spec"]
    (redis_c,) = pod["containers"]
    script = k8s_files.by_kind(docs, "ConfigMap")["redis-acl"]["data"]["users-acl.sh"]
    server = ContainerRedis(tmp_path, redis_c["command"][2], k8s_files.container_env(redis_c, docs),
                            files={"/etc/redis-acl/users-acl.sh": script})
    started.append(server)
    server.wait(secret["REDIS_PASSWORD"])
    urls = {k8s_files.REDIS_ROLES[name]: k8s_files.container_env(c, docs)["NEXTSTATE_REDIS__URL"]
            for name, c, _ in k8s_files.ours(docs) if name in k8s_files.REDIS_ROLES}
    # The operator's CLI and KEDA: the users the Secret holds passwords for.
    urls["ctl"] = redis_acl.url("ctl", secret["REDIS_CTL_PASSWORD"], "redis", 6379)
    check_users(server, urls, Keys().prefix)
    keda = redis.Redis(port=server.port, username="keda", password=secret["REDIS_KEDA_PASSWORD"],
                       decode_responses=True)
    try:
        assert keda.xinfo_groups(Keys().turns)[0]["name"] == "judge"
        with pytest.raises(NoPermissionError):
            keda.xrange(Keys().turns)
    finally:
        keda.close()
