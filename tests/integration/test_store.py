"""The bucket against a real S3 server (SeaweedFS): round trips, multipart, listing, errors, async."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from shared.errors import ObjectNotFound, StoreError
from shared.schemas import LatestPointer
from shared.settings import BucketSettings, Settings
from shared.store import AsyncBucket, Bucket, MiB
from tests.support.servers import free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def bucket(s3_settings: Settings) -> Iterator[Bucket]:
    with Bucket(s3_settings.bucket, part_size=5 * MiB) as b:
        yield b


@pytest.fixture
def pfx(unique: str) -> str:
    return f"test-store/{unique}/"


def test_bytes_round_trip_and_missing_key(bucket: Bucket, pfx: str, tmp_path: Path) -> None:
    key = pfx + "a.bin"
    assert not bucket.exists(key)
    with pytest.raises(ObjectNotFound) as err:
        bucket.get_bytes(key)
    assert err.value.key == key and isinstance(err.value, StoreError)

    bucket.put_bytes(key, b"\x00hello\xff")
    assert bucket.exists(key)
    assert bucket.get_bytes(key) == b"\x00hello\xff"
    bucket.put_bytes(key, b"")  # overwrite with an empty object: present, not missing
    assert bucket.get_bytes(key) == b""

    bucket.delete(key)
    assert not bucket.exists(key)
    bucket.delete(key)  # deleting a missing key is fine
    with pytest.raises(ObjectNotFound):
        bucket.get_file(key, tmp_path / "never-created" / "x")
    assert not (tmp_path / "never-created").exists()  # a missing object makes no folder


def test_json_round_trip(bucket: Bucket, pfx: str) -> None:
    bucket.put_json(pfx + "d.json", {"a": [1, 2.5, "x"], "b": None})
    assert bucket.get_json(pfx + "d.json") == {"a": [1, 2.5, "x"], "b": None}
    ptr = LatestPointer(version=7, manifest="m", committed_at=12.5)
    bucket.put_json(pfx + "p.json", ptr)
    assert LatestPointer.model_validate(bucket.get_json(pfx + "p.json")) == ptr
    bucket.put_bytes(pfx + "bad.json", b"{not json")
    with pytest.raises(StoreError, match="not JSON"):
        bucket.get_json(pfx + "bad.json")


def test_multipart_file_round_trip(bucket: Bucket, pfx: str, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    data = os.urandom(11 * MiB + 123)  # three 5 MiB parts
    src.write_bytes(data)
    up = bucket.put_file(pfx + "big.bin", src)
    assert (up.size, up.sha256) == (len(data), hashlib.sha256(data).hexdigest())

    [info] = bucket.list(pfx)
    assert info.key == pfx + "big.bin" and info.size == len(data)
    assert info.etag.endswith("-3"), f"expected a 3-part multipart etag, got {info.etag}"

    dst = tmp_path / "out" / "big.bin"
    down = bucket.get_file(pfx + "big.bin", dst)
    assert down == up
    assert dst.read_bytes() == data
    assert sorted(p.name for p in dst.parent.iterdir()) == ["big.bin"]  # no temp file left


def test_list_and_delete_prefix(bucket: Bucket, pfx: str) -> None:
    for k in ("x/1", "x/2", "x/sub/3", "y"):
        bucket.put_bytes(pfx + k, k.encode())
    bucket.put_bytes(pfx + "xother", b"not under x/")

    deep = bucket.list(pfx + "x/")
    assert [(o.key, o.size, o.is_prefix) for o in deep] == [
        (pfx + "x/1", 3, False), (pfx + "x/2", 3, False), (pfx + "x/sub/3", 7, False)]
    assert all(o.etag and o.last_modified for o in deep)
    shallow = bucket.list(pfx + "x/", recursive=False)
    assert [(o.key, o.is_prefix) for o in shallow] == [
        (pfx + "x/1", False), (pfx + "x/2", False), (pfx + "x/sub/", True)]

    assert bucket.delete_prefix(pfx + "x/") == 3
    assert bucket.list(pfx + "x/") == []
    assert [o.key for o in bucket.list(pfx)] == [pfx + "xother", pfx + "y"]
    with pytest.raises(ValueError):
        bucket.delete_prefix("")


def test_ensure_creates_missing_bucket(s3_settings: Settings, unique: str) -> None:
    cfg = s3_settings.bucket.model_copy(update={"name": f"ns-{unique}"})
    with Bucket(cfg) as b:
        with pytest.raises(StoreError, match="does not exist") as err:
            b.get_bytes("k")
        assert not isinstance(err.value, ObjectNotFound)
        with pytest.raises(StoreError, match="does not exist"):
            b.ping()
        b.ensure()
        b.ensure()  # idempotent
        b.ping()
        b.put_bytes("k", b"v")
        assert b.get_bytes("k") == b"v"


def test_bad_credentials(s3_settings: Settings) -> None:
    for update in ({"secret_key": SecretStr("wrong-secret")}, {"access_key": "nobody"}):
        cfg = s3_settings.bucket.model_copy(update=update)
        with Bucket(cfg) as b, pytest.raises(StoreError, match="SECRET_KEY") as err:
            b.get_bytes("anything")
        assert not isinstance(err.value, ObjectNotFound)


def _fast_fail(endpoint: str) -> BucketSettings:
    return BucketSettings(endpoint=endpoint, name="nextstate-test", timeout=0.5, region="us-east-1")


def test_unreachable_endpoint_fails_fast() -> None:
    with Bucket(_fast_fail(f"127.0.0.1:{free_port()}")) as b:  # nothing listens there
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="cannot reach"):
            b.get_bytes("k")
        assert time.monotonic() - t0 < 5


def test_silent_endpoint_times_out() -> None:
    """A server that accepts connections but never answers must not hang us."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)  # the kernel completes handshakes; nobody ever reads or answers
        with Bucket(_fast_fail(f"127.0.0.1:{srv.getsockname()[1]}")) as b:
            t0 = time.monotonic()
            with pytest.raises(StoreError, match=r"cannot reach.*ReadTimeout"):
                b.get_bytes("k")
            elapsed = time.monotonic() - t0
    assert 0.5 <= elapsed < 5, elapsed


async def test_async_bucket_keeps_the_loop_free(
    s3_settings: Settings, pfx: str, tmp_path: Path
) -> None:
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(8 * MiB))
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    async with AsyncBucket(s3_settings.bucket) as ab:
        beat = asyncio.create_task(heartbeat())
        try:
            up = await ab.put_file(pfx + "f.bin", src)
            down = await ab.get_file(pfx + "f.bin", tmp_path / "g.bin")
        finally:
            beat.cancel()
        assert up == down and ticks > 0  # the loop kept running during both transfers
        await ab.put_json(pfx + "j", {"v": 1})
        assert await ab.get_json(pfx + "j") == {"v": 1}
        assert await ab.exists(pfx + "j")
        results = await asyncio.gather(*(ab.get_bytes(pfx + "j") for _ in range(8)))
        assert set(results) == {b'{"v": 1}'}
        assert [o.key for o in await ab.list(pfx)] == [pfx + "f.bin", pfx + "j"]
        assert await ab.delete_prefix(pfx) == 2
        with pytest.raises(ObjectNotFound):
            await ab.get_bytes(pfx + "j")
