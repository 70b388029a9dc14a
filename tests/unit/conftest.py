"""Unit tests need nothing running: the fixtures that start redis-server or SeaweedFS
(tests/conftest.py) fail here, saying where such a test belongs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NoReturn

import pytest

WHERE = "unit tests need nothing running: a test that starts {} belongs in tests/integration"


@pytest.fixture(scope="session")
def redis_server() -> NoReturn:
    pytest.fail(WHERE.format("redis-server (redis_url, env, settings)"), pytrace=False)


@pytest.fixture(scope="session")
def s3() -> NoReturn:
    pytest.fail(WHERE.format("SeaweedFS (s3, s3_env, s3_settings)"), pytrace=False)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for the test (what a step costs, not how the 2 cores share it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
