"""Fixtures several integration test modules share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shared.settings import Settings
from shared.store import Bucket


@pytest.fixture
def bucket(s3_settings: Settings) -> Iterator[Bucket]:
    """The test's bucket on the session's SeaweedFS, created if missing."""
    b = Bucket(s3_settings.bucket)
    b.ensure()
    yield b
    b.close()
