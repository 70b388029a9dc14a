"""The bucket `nextstate up` runs: only the S3 endpoint, with one identity per service role.

SeaweedFS started exactly as `up` starts it (identities file, `-disableHttp`, gRPC behind
client certificates): each role can do what its service needs and nothing more; the
filer's, master's and volume server's HTTP APIs serve no object; a gRPC port refuses a
client without the stack's certificate.
"""

from __future__ import annotations

import io
import os
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from minio import Minio
from minio.error import S3Error

from services.ctl import bucket_roles, infra
from shared.settings import BucketSettings
from shared.store import Bucket
from tests.support.servers import stop_process, wait_until

pytestmark = pytest.mark.integration
BUCKET = "roles"


class Closed:
    def __init__(self, root: Path) -> None:
        self.creds = bucket_roles.new_credentials()
        self.ports = infra.weed_ports()
        data = root / "s3"
        data.mkdir()
        config = bucket_roles.write_weed_s3_config(data / "identities.json", BUCKET, self.creds)
        workdir = self.workdir = bucket_roles.ensure_grpc_tls(data)
        self.log = open(root / "weed.log", "wb")
        self.proc = subprocess.Popen(infra.weed_argv(data, self.ports, BUCKET, s3_config=config),
                                     cwd=workdir, stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ))
        admin = self.client("admin")
        wait_until(lambda: admin.bucket_exists(BUCKET), 60, "weed with identities", interval=0.2)

    def client(self, role: str) -> Minio:
        c = self.creds[role]
        return Minio(f"127.0.0.1:{self.ports['s3']}", access_key=c.access_key, secret_key=c.secret_key,
                     secure=False, region=bucket_roles.REGION)

    def bucket(self, role: str) -> Bucket:
        c = self.creds[role]
        return Bucket(BucketSettings(endpoint=f"127.0.0.1:{self.ports['s3']}", name=BUCKET, access_key=c.access_key,
                                     secret_key=c.secret_key, region=bucket_roles.REGION))


@pytest.fixture(scope="module")
def closed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Closed]:
    server = Closed(tmp_path_factory.mktemp("closed-s3"))
    yield server
    stop_process(server.proc)
    server.log.close()


def allowed(fn: object) -> bool:
    try:
        out = fn()  # type: ignore[operator]
        if hasattr(out, "read"):
            out.read()
        return True
    except S3Error as exc:
        assert exc.code == "AccessDenied", exc
        return False


def put(c: Minio, key: str) -> bool:
    return allowed(lambda: c.put_object(BUCKET, key, io.BytesIO(b"x" * 10), 10))


def test_each_role_may_do_its_job_and_nothing_more(closed: Closed) -> None:
    trainer, watcher, buffer = (closed.client(r) for r in ("trainer", "watcher", "buffer"))
    assert put(trainer, "policies/r/v000001/model.safetensors") and put(trainer, "trainer-state/r/v000001/state.pt")
    assert put(trainer, "policies/r/LATEST")
    assert not put(trainer, "samples/r/x.jsonl.gz")
    assert allowed(lambda: watcher.get_object(BUCKET, "policies/r/v000001/model.safetensors"))
    assert allowed(lambda: list(watcher.list_objects(BUCKET, "policies/", recursive=True)))
    assert not put(watcher, "policies/r/LATEST")  # the watcher cannot swap the policy
    assert not allowed(lambda: watcher.remove_object(BUCKET, "policies/r/LATEST") or watcher.stat_object(BUCKET, "x"))
    assert not allowed(lambda: watcher.get_object(BUCKET, "trainer-state/r/v000001/state.pt"))
    assert put(buffer, "samples/r/2026-11-30/a.jsonl.gz")
    assert not put(buffer, "policies/r/LATEST")  # nor can the buffer
    assert not allowed(lambda: buffer.get_object(BUCKET, "policies/r/v000001/model.safetensors"))
    anonymous = Minio(f"127.0.0.1:{closed.ports['s3']}", secure=False, region=bucket_roles.REGION)
    assert not allowed(lambda: anonymous.get_object(BUCKET, "policies/r/LATEST"))
    # The services' own health checks and start-up work with the narrow keys.
    for role in bucket_roles.ROLES:
        with closed.bucket(role) as b:
            b.ping()
            b.ensure()


def test_only_the_s3_endpoint_serves_objects(closed: Closed) -> None:
    key = "policies/r/v000001/model.safetensors"
    secret = b"only-through-s3-" * 4
    closed.client("trainer").put_object(BUCKET, key, io.BytesIO(secret), len(secret))
    assert closed.client("watcher").get_object(BUCKET, key).read() == secret  # the S3 endpoint serves it
    for name in ("filer", "master", "volume", "admin"):
        for path in (f"/buckets/{BUCKET}/{key}", f"/buckets/{BUCKET}/", "/dir/assign", "/"):
            try:
                r = httpx.get(f"http://127.0.0.1:{closed.ports[name]}{path}", timeout=3,
                              headers={"Accept": "application/json"})
            except httpx.HTTPError:
                continue
            assert secret.decode() not in r.text and '"Entries"' not in r.text and '"fid"' not in r.text, (name, path)


def grpc_answer(port: int, tls_dir: Path, with_cert: bool) -> bytes:
    """Speak TLS + HTTP/2 to a gRPC port, trusting the stack's CA; the server's first frame."""
    ctx = ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))
    ctx.check_hostname = False
    ctx.set_alpn_protocols(["h2"])
    if with_cert:
        ctx.load_cert_chain(tls_dir / "weed.crt", tls_dir / "weed.key")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        return tls.recv(1024)


def test_grpc_ports_demand_the_stacks_client_certificate(closed: Closed, tmp_path: Path) -> None:
    tls_dir = closed.workdir / "tls"
    for name in ("filer", "master", "volume"):
        port = closed.ports[name] + 10000
        assert grpc_answer(port, tls_dir, with_cert=True)  # TLS with the certificate: HTTP/2 answers
        with pytest.raises((ssl.SSLError, ConnectionError)):  # TLS, no certificate: refused
            if not grpc_answer(port, tls_dir, with_cert=False):
                raise ConnectionError("closed without a client certificate")
