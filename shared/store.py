"""The bucket every service shares: bytes, JSON and files in one S3 bucket, errors that say what to check.

`Bucket` wraps one `minio.Minio` client (sync, S3 over HTTP) for its whole life, with an
explicit urllib3 pool: connect and read timeouts from `BucketSettings.timeout`, bounded
retries with backoff for connection errors and 5xx answers (S3 writes of whole objects
are idempotent, so retrying them is safe). Every minio/urllib3 failure becomes a
`StoreError` naming the operation, the key, and what to check (endpoint, credentials,
bucket).

A missing object raises `ObjectNotFound` (a `StoreError`), never returns None, so a
caller cannot confuse "absent" with "empty"; `exists(key)` asks without raising.

Files go up and down in one pass: `put_file` hashes (sha256) while minio reads the file
for the (multipart, parallel) upload, and `get_file` hashes while it writes, so the
checkpoint protocol verifies without reading anything twice.

Async services use `AsyncBucket`: the same methods as coroutines, each run on a small
thread pool the object owns, so the event loop never waits on the network; `run(fn, …)`
runs any blocking function (e.g. `download_checkpoint`) on that pool.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, ParamSpec, TypeVar

import certifi
import urllib3
from minio import Minio
from minio.deleteobjects import DeleteObject
from minio.error import InvalidResponseError, MinioException, S3Error, ServerError
from pydantic import BaseModel
from urllib3.util import Retry, Timeout

from shared.errors import ObjectNotFound, StoreError
from shared.settings import BucketSettings

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")

MiB = 1024 * 1024
CHUNK = 1 * MiB
_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                     "InvalidToken", "ExpiredToken"}


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str
    last_modified: datetime | None
    is_prefix: bool = False  # a "folder" in a non-recursive listing


@dataclass(frozen=True)
class FileDigest:
    """What one pass over a file's bytes saw: how many, and their sha256."""

    size: int
    sha256: str


class _HashingReader:
    """A read-only file wrapper that hashes every byte as minio reads it."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._h = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._h.update(data)
        self.size += len(data)
        return data

    def digest(self) -> FileDigest:
        return FileDigest(self.size, self._h.hexdigest())


class Bucket:
    """One S3 bucket through one pooled client. Thread-safe; close it (or use `with`)."""

    def __init__(
        self,
        settings: BucketSettings,
        *,
        retries: int = 3,
        part_size: int = 16 * MiB,
        part_parallel: int = 3,
        max_connections: int = 32,
    ) -> None:
        if part_size < 5 * MiB:
            raise ValueError("part_size must be at least 5 MiB (the S3 minimum)")
        self.settings = settings
        self.name = settings.name
        self.part_size = part_size
        self.part_parallel = part_parallel
        self._http = urllib3.PoolManager(
            timeout=Timeout(connect=settings.timeout, read=settings.timeout),
            maxsize=max_connections,
            cert_reqs="CERT_REQUIRED",
            ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
            retries=Retry(
                total=retries,
                connect=retries,
                read=1,  # a server that stops answering gets one more chance, not `retries`
                status=retries,
                backoff_factor=0.2,
                backoff_max=2.0,
                status_forcelist=(500, 502, 503, 504),
                raise_on_status=False,  # hand the last 5xx to minio, which parses its S3 code
            ),
        )
        self._client = Minio(
            settings.endpoint,
            access_key=settings.access_key,
            secret_key=settings.secret_key.get_secret_value(),
            secure=settings.secure,
            region=settings.region,
            http_client=self._http,
        )

    # -- life -----------------------------------------------------------------------
    def close(self) -> None:
        self._http.clear()

    def __enter__(self) -> Bucket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Bucket({self.settings.endpoint}/{self.name})"

    # -- the bucket itself ------------------------------------------------------------
    def ensure(self) -> None:
        """Create the bucket if it does not exist (racing creators both succeed). A key
        without bucket-level rights (a narrow service role) cannot ask, nor create it: it
        checks that it can list the bucket instead."""
        with self._errors("create bucket"):
            try:
                if self._client.bucket_exists(self.name):
                    return
            except S3Error as exc:
                if exc.code != "AccessDenied":
                    raise
                self._list_one()
                return
            try:
                self._client.make_bucket(self.name, location=self.settings.region)
                log.info("created bucket %s at %s", self.name, self.settings.endpoint)
            except S3Error as exc:
                if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    def ping(self) -> None:
        """Raise `StoreError` unless the endpoint answers, the bucket exists and this key may
        list it (for health; listing is the one right every service role has)."""
        with self._errors("check bucket"):
            self._list_one()

    def _list_one(self) -> None:
        for _ in self._client.list_objects(self.name, prefix="", recursive=False):
            break

    # -- bytes and JSON -------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
        with self._errors("put", key):
            self._client.put_object(self.name, key, io.BytesIO(data), len(data),
                                    content_type=content_type)

    def get_bytes(self, key: str) -> bytes:
        """The object's bytes; `ObjectNotFound` if there is no such key."""
        with self._errors("get", key):
            resp = self._client.get_object(self.name, key)
            try:
                return resp.read()
            finally:
                resp.close()
                resp.release_conn()

    def put_json(self, key: str, obj: BaseModel | Any) -> None:
        """A pydantic model (its JSON form) or any JSON-serialisable value."""
        text = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
        self.put_bytes(key, text.encode(), content_type="application/json")

    def get_json(self, key: str) -> Any:
        data = self.get_bytes(key)
        try:
            return json.loads(data)
        except ValueError as exc:
            raise StoreError(f"object {key!r} in bucket {self.name!r} is not JSON: {exc}") from None

    # -- files ------------------------------------------------------------------------------
    def put_file(self, key: str, path: str | Path) -> FileDigest:
        """Upload a file (multipart in parallel parts above `part_size`); hash it on the way."""
        with open(path, "rb") as f:
            length = os.fstat(f.fileno()).st_size
            reader = _HashingReader(f)
            with self._errors("upload", key, local=path):
                self._client.put_object(
                    self.name, key, reader, length,  # type: ignore[arg-type]
                    part_size=self.part_size, num_parallel_uploads=self.part_parallel,
                )
        return reader.digest()

    def get_file(self, key: str, path: str | Path) -> FileDigest:
        """Download to `path` (written to a temporary sibling, then renamed); hash it on the way."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.part")
        h = hashlib.sha256()
        size = 0
        try:
            with self._errors("download", key, local=path):
                resp = self._client.get_object(self.name, key)
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)  # once the object is there
                    with open(tmp, "wb") as f:
                        for chunk in resp.stream(CHUNK):
                            f.write(chunk)
                            h.update(chunk)
                            size += len(chunk)
                finally:
                    resp.close()
                    resp.release_conn()
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return FileDigest(size, h.hexdigest())

    # -- listing and deleting -----------------------------------------------------------------
    def list(self, prefix: str = "", recursive: bool = True) -> list[ObjectInfo]:
        """Objects under `prefix`, in key order; non-recursive listings include folders."""
        with self._errors("list", prefix):
            return [
                ObjectInfo(
                    key=o.object_name or "",
                    size=o.size or 0,
                    etag=(o.etag or "").strip('"'),
                    last_modified=o.last_modified,
                    is_prefix=bool(o.is_dir),
                )
                for o in self._client.list_objects(self.name, prefix=prefix, recursive=recursive)
            ]

    def exists(self, key: str) -> bool:
        try:
            with self._errors("stat", key):
                self._client.stat_object(self.name, key)
        except ObjectNotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        """Delete one object; deleting a missing key is not an error (S3 semantics)."""
        with self._errors("delete", key):
            self._client.remove_object(self.name, key)

    def delete_keys(self, keys: builtins.list[str]) -> None:
        """Delete many objects in batched requests; raise if the server refused any."""
        if not keys:
            return
        with self._errors("delete", keys[0]):
            failed = list(self._client.remove_objects(self.name, (DeleteObject(k) for k in keys)))
        if failed:
            first = failed[0]
            raise StoreError(
                f"could not delete {len(failed)} of {len(keys)} objects in bucket {self.name!r}, "
                f"e.g. {first.name!r}: {first.code} {first.message}"
            )

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under `prefix`; returns how many. Refuses the empty prefix."""
        if not prefix:
            raise ValueError("refusing to delete the whole bucket: give a non-empty prefix")
        keys = [o.key for o in self.list(prefix, recursive=True)]
        self.delete_keys(keys)
        return len(keys)

    # -- errors ----------------------------------------------------------------------------------
    def _no_bucket(self) -> str:
        return (
            f"bucket {self.name!r} does not exist at {self.settings.endpoint}: create it "
            f"(Bucket.ensure(), `nextstate up`) or check NEXTSTATE_BUCKET__NAME"
        )

    @contextlib.contextmanager
    def _errors(self, op: str, key: str = "", local: str | Path | None = None) -> Iterator[None]:
        """Turn minio/urllib3 failures into `StoreError`s that say what to check."""
        where = f"{op} {key!r}" if key else op
        endpoint = self.settings.endpoint
        try:
            yield
        except S3Error as exc:
            if exc.code == "NoSuchKey":
                raise ObjectNotFound(key, self.name) from None
            if exc.code == "NoSuchBucket":
                raise StoreError(f"{where}: {self._no_bucket()}") from None
            if exc.code in _CREDENTIAL_CODES:
                raise StoreError(
                    f"{where}: {endpoint} refused the credentials ({exc.code}: {exc.message}); "
                    f"check NEXTSTATE_BUCKET__ACCESS_KEY / NEXTSTATE_BUCKET__SECRET_KEY and "
                    f"that this key may use bucket {self.name!r}"
                ) from None
            raise StoreError(f"{where} in bucket {self.name!r} failed: {exc.code}: {exc.message}") from exc
        except ServerError as exc:
            raise StoreError(
                f"{where}: {endpoint} answered HTTP {exc.status_code} after retries; "
                f"is the S3 server healthy?"
            ) from exc
        except InvalidResponseError as exc:
            raise StoreError(
                f"{where}: {endpoint} did not answer like an S3 server ({exc}); "
                f"check NEXTSTATE_BUCKET__ENDPOINT and NEXTSTATE_BUCKET__SECURE"
            ) from None
        except MinioException as exc:
            raise StoreError(f"{where} in bucket {self.name!r} failed: {exc}") from exc
        except urllib3.exceptions.HTTPError as exc:
            reason = getattr(exc, "reason", None) or exc
            raise StoreError(
                f"{where}: cannot reach the S3 server at {endpoint} ({type(reason).__name__}: "
                f"{reason}; timeout {self.settings.timeout}s); check NEXTSTATE_BUCKET__ENDPOINT "
                f"and that the server is running"
            ) from None
        except OSError as exc:
            if local is None:
                raise StoreError(f"{where} at {endpoint} failed: {exc}") from exc
            raise StoreError(f"{where} failed on local file {str(local)!r}: {exc}") from exc


class AsyncBucket:
    """`Bucket` for asyncio code: each call runs on this object's own thread pool.

    A cancelled await does not stop the transfer already running in its thread (the
    timeouts bound it); `aclose()` waits for running calls and drops queued ones.
    """

    def __init__(self, settings: BucketSettings, *, max_workers: int = 8, **bucket_kw: Any) -> None:
        self.sync = Bucket(settings, **bucket_kw)
        self.name = self.sync.name
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="bucket")

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a blocking function (a `Bucket` method, `publish_checkpoint`, …) off the loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(
            None, functools.partial(self._pool.shutdown, wait=True, cancel_futures=True))
        self.sync.close()

    async def __aenter__(self) -> AsyncBucket:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def ensure(self) -> None:
        await self.run(self.sync.ensure)

    async def ping(self) -> None:
        await self.run(self.sync.ping)

    async def put_bytes(self, key: str, data: bytes,
                        content_type: str = "application/octet-stream") -> None:
        await self.run(self.sync.put_bytes, key, data, content_type)

    async def get_bytes(self, key: str) -> bytes:
        return await self.run(self.sync.get_bytes, key)

    async def put_json(self, key: str, obj: BaseModel | Any) -> None:
        await self.run(self.sync.put_json, key, obj)

    async def get_json(self, key: str) -> Any:
        return await self.run(self.sync.get_json, key)

    async def put_file(self, key: str, path: str | Path) -> FileDigest:
        return await self.run(self.sync.put_file, key, path)

    async def get_file(self, key: str, path: str | Path) -> FileDigest:
        return await self.run(self.sync.get_file, key, path)

    async def list(self, prefix: str = "", recursive: bool = True) -> list[ObjectInfo]:
        return await self.run(self.sync.list, prefix, recursive)

    async def exists(self, key: str) -> bool:
        return await self.run(self.sync.exists, key)

    async def delete(self, key: str) -> None:
        await self.run(self.sync.delete, key)

    async def delete_prefix(self, prefix: str) -> int:
        return await self.run(self.sync.delete_prefix, prefix)
