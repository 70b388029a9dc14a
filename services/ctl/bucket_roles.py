"""Least privilege on the bucket: one S3 identity per service role, and a closed SeaweedFS.

Only the trainer writes checkpoints; the watcher only reads them; the buffer only writes
its sample archive; the evaluator reads checkpoints and writes its results; collector,
judge and engines never touch the bucket. The operator's
CLI (`nextstate rollback`) and `up` itself use the admin identity.

| role    | may                                                                         |
| ------- | --------------------------------------------------------------------------- |
| trainer | read + write `policies/*` and `trainer-state/*`, list the bucket            |
| watcher | read `policies/*`, list the bucket                                          |
| buffer  | write `samples/*`, list the bucket                                          |
| evaluator | read `policies/*`, write `evals/*`, list the bucket                       |
| admin   | everything (create the bucket, move LATEST by hand)                         |

`nextstate up` (SeaweedFS `weed mini`) gets these as an `-s3.config` identities file with
fresh random keys at every start; each service's `NEXTSTATE_BUCKET__ACCESS_KEY` /
`__SECRET_KEY` are its role's, and `NEXTSTATE_BUCKET__REGION` is set so clients never
need the bucket-level GetBucketLocation the narrow roles lack. It also closes the other
doors of `weed mini`: `-disableHttp` turns off the filer's, master's and volume server's
HTTP APIs (the filer's would list and serve every object without keys), and every gRPC
port requires a client certificate signed by a CA generated for this stack
(`security.toml` in weed's working folder, owner-only files), so only the S3 endpoint,
with keys, is left. For MinIO (docker compose, Kubernetes), `minio_policy` gives the same
rights as IAM policies; deploy/minio/ holds them, created by the compose `bucket-init`.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REGION = "us-east-1"
ROLES = ("trainer", "watcher", "buffer", "evaluator")
# Prefixes each role may read / write (shared/checkpoints.py spells the keys).
READS = {"trainer": ("policies", "trainer-state"), "watcher": ("policies",), "buffer": (),
         "evaluator": ("policies",)}
WRITES = {"trainer": ("policies", "trainer-state"), "watcher": (), "buffer": ("samples",),
          "evaluator": ("evals",)}


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str

    @classmethod
    def new(cls, role: str) -> Credentials:
        return cls(f"{role}-{secrets.token_hex(6)}", secrets.token_urlsafe(30))

    def env(self) -> dict[str, str]:
        return {"NEXTSTATE_BUCKET__ACCESS_KEY": self.access_key,
                "NEXTSTATE_BUCKET__SECRET_KEY": self.secret_key,
                "NEXTSTATE_BUCKET__REGION": REGION}


def new_credentials() -> dict[str, Credentials]:
    """Random keys for the admin and every role."""
    return {name: Credentials.new(name) for name in ("admin", *ROLES)}


def weed_actions(role: str, bucket: str) -> list[str]:
    if role == "admin":
        return ["Admin", "Read", "List", "Tagging", "Write"]
    return ([f"Read:{bucket}/{p}/*" for p in READS[role]] + [f"Write:{bucket}/{p}/*" for p in WRITES[role]]
            + [f"List:{bucket}"])


def weed_s3_config(bucket: str, creds: dict[str, Credentials]) -> dict[str, Any]:
    """SeaweedFS's `-s3.config` identities for these credentials."""
    return {"identities": [
        {"name": role, "credentials": [{"accessKey": c.access_key, "secretKey": c.secret_key}],
         "actions": weed_actions(role, bucket)}
        for role, c in creds.items()
    ]}


def minio_policy(role: str) -> dict[str, Any]:
    """The same rights as a MinIO (AWS IAM) policy, for any bucket name."""
    statements: list[dict[str, Any]] = [{
        "Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketLocation"],
        "Resource": ["arn:aws:s3:::*"]}]
    if READS[role]:
        statements.append({"Effect": "Allow", "Action": ["s3:GetObject"],
                           "Resource": [f"arn:aws:s3:::*/{p}/*" for p in READS[role]]})
    if WRITES[role]:
        statements.append({"Effect": "Allow",
                           "Action": ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",
                                      "s3:ListMultipartUploadParts"],
                           "Resource": [f"arn:aws:s3:::*/{p}/*" for p in WRITES[role]]})
    return {"Version": "2012-10-17", "Statement": statements}


def write_private(path: Path, data: bytes) -> None:
    """Write `path` readable by its owner only, whole (a reader never sees half)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


GRPC_SECTIONS = ("master", "volume", "filer", "s3", "admin", "worker", "msg_broker", "msg_agent", "mq")


def ensure_grpc_tls(folder: Path) -> Path:
    """A CA, one certificate for 127.0.0.1 (server and client) and the `security.toml`
    that makes every `weed` gRPC port demand it; made once per stack folder. Returns
    the folder to run `weed` in (it reads security.toml from its working folder)."""
    toml = folder / "security.toml"
    if toml.is_file() and (folder / "tls" / "weed.key").is_file():
        return folder
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    tls = folder / "tls"
    tls.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = dt.datetime.now(dt.timezone.utc)
    valid = (now - dt.timedelta(minutes=5), now + dt.timedelta(days=3650))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nextstate local stack CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(valid[0]).not_valid_after(valid[1])
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "weed")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(valid[0]).not_valid_after(valid[1])
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    write_private(tls / "ca.crt", ca.public_bytes(pem))
    write_private(tls / "weed.crt", cert.public_bytes(pem))
    write_private(tls / "weed.key", key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    pair = f'cert = "{tls / "weed.crt"}"\nkey = "{tls / "weed.key"}"\n'
    text = f'[grpc]\nca = "{tls / "ca.crt"}"\n' + "".join(f"[grpc.{s}]\n{pair}" for s in GRPC_SECTIONS)
    write_private(toml, (text + f"[grpc.client]\n{pair}").encode())
    return folder


def write_weed_s3_config(path: Path, bucket: str, creds: dict[str, Credentials]) -> Path:
    write_private(path, json.dumps(weed_s3_config(bucket, creds), indent=2).encode())
    return path


def init_bucket(env: dict[str, str]) -> list[str]:
    """`bucket-init` where there is no `mc` (the offline compose override): create the bucket
    with the admin keys of NEXTSTATE_BUCKET__* (idempotent), then check that each role whose
    secret is in MINIO_<ROLE>_SECRET can list it as `nextstate-<role>`. Returns what it did."""
    from pydantic import SecretStr

    from shared.settings import Settings
    from shared.store import Bucket

    admin = Settings().bucket
    done = []
    with Bucket(admin, retries=5) as bucket:
        bucket.ensure()
        done.append(f"bucket {admin.name} at {admin.endpoint}")
    for role in ROLES:
        secret = env.get(f"MINIO_{role.upper()}_SECRET")
        if not secret:
            continue
        narrow = admin.model_copy(update={"access_key": f"nextstate-{role}", "secret_key": SecretStr(secret),
                                          "region": REGION})
        with Bucket(narrow, retries=2) as bucket:
            bucket.ensure()  # a narrow role checks that it can list instead
        done.append(f"role {role} can list it")
    return done


def main() -> int:
    """`python -m services.ctl.bucket_roles minio DIR`: write the MinIO policy files.
    `python -m services.ctl.bucket_roles init`: see init_bucket."""
    import sys

    if sys.argv[1:] == ["init"]:
        for line in init_bucket(dict(os.environ)):
            print(f"bucket-init: {line}")
        return 0
    if len(sys.argv) != 3 or sys.argv[1] != "minio":
        print("usage: python -m services.ctl.bucket_roles minio DIR | init", file=sys.stderr)
        return 2
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    for role in ROLES:
        (out / f"nextstate-{role}.json").write_text(json.dumps(minio_policy(role), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
