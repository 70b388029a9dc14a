"""The supervisor's small rules: restart backoff, exit statuses, telling a bind failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.ctl import infra
from services.ctl.infra import is_bind_failure, redis_argv
from services.ctl.supervisor import Backoff, exit_status


def test_backoff_doubles_up_to_the_cap() -> None:
    b = Backoff(base_s=1.0, cap_s=60.0, jitter=0.0)
    assert [b.delay(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert b.delay(10_000) == 60  # no overflow however long the loop


def test_jitter_only_shortens_and_keeps_the_delay_growing() -> None:
    b = Backoff(base_s=1.0, cap_s=60.0, jitter=0.25)
    assert b.delay(3, rand=lambda: 0.0) == 4.0 and b.delay(3, rand=lambda: 1.0) == 3.0
    lows = [b.delay(n, rand=lambda: 1.0) for n in range(1, 7)]
    highs = [b.delay(n, rand=lambda: 0.0) for n in range(1, 7)]
    # The longest wait before restart n is shorter than the shortest before restart n + 1.
    assert all(high < low for high, low in zip(highs, lows[1:], strict=False))


def test_exit_status_names_signals() -> None:
    assert exit_status(0) == 0 and exit_status(7) == 7
    assert exit_status(-9) == "SIGKILL" and exit_status(-15) == "SIGTERM"


@pytest.mark.parametrize("line", [
    # Python / uvicorn
    "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): address already in use",
    "OSError: [Errno 98] Address already in use",
    # redis-server
    "7079:M 30 Nov 2026 15:04:09.026 # Warning: Could not create server TCP listening socket "
    "127.0.0.1:56263: bind: Address already in use",
    # SeaweedFS weed mini
    "E1130 15:04:12.065115 mini.go:1244 Port allocation failed: port 52463 for S3 "
    "(specified by flag s3.port) is not available on 127.0.0.1 and cannot be used",
    "listen tcp 127.0.0.1:8333: bind: address already in use",
    "Error: listen EADDRINUSE: address already in use :::3000",
])
def test_bind_failures_are_recognised(line: str) -> None:
    assert is_bind_failure(f"starting\n{line}\nexiting")


@pytest.mark.parametrize("line", [
    "ModuleNotFoundError: No module named 'torch'",
    "redis: Failed to connect to 127.0.0.1:6379: Connection refused",
    "listening on port 8000",
])
def test_other_failures_are_not_bind_failures(line: str) -> None:
    assert not is_bind_failure(line)


def test_redis_persists_every_write_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(infra, "redis_server_binary", lambda: "redis-server")
    argv = " ".join(redis_argv(6390, Path("/data"), persist=True))
    assert "--appendonly yes --appendfsync always" in argv
    assert "--appendonly no" in " ".join(redis_argv(6390, Path("/data"), persist=False))
