"""Unit tests need nothing running: the fixtures that start redis-server or SeaweedFS
(tests/conftest.py) fail here, saying where such a test belongs."""

from __future__ import annotations

from typing import NoReturn

import pytest

WHERE = "unit tests need nothing running: a test that starts {} belongs in tests/integration"


@pytest.fixture(scope="session")
def redis_server() -> NoReturn:
    pytest.fail(WHERE.format("redis-server (redis_url, env, settings)"), pytrace=False)


@pytest.fixture(scope="session")
def s3() -> NoReturn:
    pytest.fail(WHERE.format("SeaweedFS (s3, s3_env, s3_settings)"), pytrace=False)
