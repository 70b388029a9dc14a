"""Imports: `POST /receive` and `nextstate import` (file and --mock) against the real buffer
process, with the tiny model's chat template; Turns land on a real Redis `turns` stream.
The buffer requires an internal token; the requests and the CLI send it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.ctl.importer import mock_records
from shared.auth import bearer
from shared.chat import ChatTemplate
from shared.schemas import Turn
from shared.settings import Settings
from shared.streams import Bus
from tests.conftest import settings_from
from tests.integration.test_buffer_service import process_env
from tests.support.servers import REPO, ServiceProcess
from tests.support.tiny_model import build_tokenizer

pytestmark = pytest.mark.integration

SEEDS = REPO / "tests" / "data" / "seeds.jsonl"
TOKEN = "import-test-internal-token-01"


@dataclass
class Buffer:
    url: str
    settings: Settings
    proc: ServiceProcess


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer and chat template alone (no torch model to build)."""
    path = tmp_path_factory.mktemp("tiny-tok")
    build_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def buffer(redis_url: str, tokenizer_dir: Path) -> Iterator[Buffer]:
    """One buffer process (with a tokenizer) for this module; tests use their own session ids."""
    unique = uuid.uuid4().hex[:10]
    env = {"NEXTSTATE_ENV": "test", "NEXTSTATE_RUN": f"run-{unique}",
           "NEXTSTATE_REDIS__URL": redis_url, "NEXTSTATE_REDIS__PREFIX": f"t-{unique}"}
    penv, url = process_env({**env, "NEXTSTATE_INTERNAL__TOKEN": TOKEN}, tokenizer=tokenizer_dir,
                            receive_max_records=5)
    proc = ServiceProcess("buffer", penv).start().wait_http(f"{url}/readyz", timeout=60)
    yield Buffer(url, settings_from(env), proc)
    proc.stop()


@pytest.fixture(scope="module")
def template(tokenizer_dir: Path) -> ChatTemplate:
    return ChatTemplate.from_pretrained(tokenizer_dir)


@pytest.fixture
async def bus(buffer: Buffer) -> AsyncIterator[Bus]:
    async with Bus(buffer.settings) as b:
        yield b


async def turns(bus: Bus, sessions: set[str] | None = None) -> list[Turn]:
    rows = await bus.redis.xrange(bus.keys.turns)
    out = [Turn.from_json(f["data"]) for _, f in rows]
    return [t for t in out if sessions is None or t.session_id in sessions]


def record(session: str, *turns: dict[str, Any]) -> dict[str, Any]:
    return {"session_id": session, "turns": list(turns)}


def assert_tokenized(t: Turn, template: ChatTemplate) -> None:
    """Prompt ids are the chat template's rendering tokenized; the response ends its turn."""
    rendered = template.render(t.messages)
    assert t.prompt_ids == template.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    eot = template.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert t.response_ids[-1] == eot
    assert template.decode(t.response_ids) == t.response["content"]
    assert t.response_logprobs is None
    assert (t.source, t.closed_by, t.turn_type) == ("import", "import", "main")


def import_cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.ctl.importer", *args, "--url", url],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "NEXTSTATE_INTERNAL__TOKEN": TOKEN},
    )


async def test_receive_publishes_tokenized_turns(buffer: Buffer, bus: Bus, template: ChatTemplate) -> None:
    s1, s2 = f"r-{uuid.uuid4().hex[:6]}", f"r-{uuid.uuid4().hex[:6]}"
    body = [
        record(s1, {"prompt": "What is the weather in Paris?", "response": "Sunny, 21 degrees.",
                    "next_state": "thanks"},
               {"type": "side", "prompt": "title?", "response": "Weather"},
               {"prompt": "And in Tokyo?", "response": "Rain.", "trainable": False},
               {"prompt": "And London?", "response": "Cloudy."}),
        record(s2, {"prompt": "hi", "response": "hello", "next_state": "that's wrong, try again"}),
    ]
    async with httpx.AsyncClient(base_url=buffer.url, timeout=30, headers=bearer(TOKEN)) as client:
        resp = await client.post("/receive", json=body)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert (out["records"], out["published"], out["side"], out["untrainable"]) == (2, 3, 1, 1)
        got = await turns(bus, {s1, s2})
        assert [t.id for t in got] == out["turn_ids"]
        assert [(t.session_id, t.turn_index) for t in got] == [(s1, 0), (s1, 3), (s2, 0)]
        for t in got:
            assert_tokenized(t, template)
        assert got[0].messages == [{"role": "user", "content": "What is the weather in Paris?"}]
        assert got[0].next_state == [{"role": "user", "content": "thanks"}]
        assert got[1].next_state is None
        # The same request again: the same turn ids (the bus dedupes them downstream).
        again = (await client.post("/receive", json=body)).json()
        assert again["turn_ids"] == out["turn_ids"]


async def test_bad_requests_are_refused_and_publish_nothing(buffer: Buffer, bus: Bus) -> None:
    s = f"bad-{uuid.uuid4().hex[:6]}"
    good = record(s, {"prompt": "p", "response": "r"})
    async with httpx.AsyncClient(base_url=buffer.url, timeout=30, headers=bearer(TOKEN)) as client:
        resp = await client.post("/receive", json=[good, record(s, {"prompt": "p"})])
        assert resp.status_code == 400
        assert "record 1: turns.0.response: Field required" in resp.json()["error"]["message"]
        resp = await client.post("/receive", content=b"{not json", headers={"content-type": "application/json"})
        assert resp.status_code == 400 and "not JSON" in resp.json()["error"]["message"]
        resp = await client.post("/receive", json=[good] * 6)
        assert resp.status_code == 413 and "at most 5" in resp.json()["error"]["message"]
    assert await turns(bus, {s}) == []


async def test_import_cli_feeds_a_seeds_file(buffer: Buffer, bus: Bus, template: ChatTemplate) -> None:
    lines = [json.loads(line) for line in SEEDS.read_text().splitlines() if line.strip()]
    sessions = {r["session_id"] for r in lines}
    before = len(await turns(bus, sessions))
    out = import_cli(buffer.url, str(SEEDS), "--chunk", "3")
    assert out.returncode == 0, out.stderr
    progress = out.stdout.strip().splitlines()
    assert progress[0].startswith("records 3 ") and progress[1].startswith("records 4 ")
    assert progress[-1] == ("imported 4 records: 6 turns published to turns, "
                            "1 side and 1 untrainable turns skipped")
    got = (await turns(bus, sessions))[before:]
    assert len(got) == 6
    assert sorted((t.session_id, t.turn_index) for t in got) == sorted([
        ("seed-refactor", 0), ("seed-weather", 0), ("seed-weather", 1), ("seed-weather", 2),
        ("seed-untrainable", 1), ("seed-single", 0)])
    for t in got:
        assert_tokenized(t, template)
    for t in got:  # no conversation text in the progress output
        assert t.response["content"] not in out.stdout


async def test_import_cli_names_the_bad_line(buffer: Buffer, tmp_path: Path) -> None:
    s = f"cli-{uuid.uuid4().hex[:6]}"
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(record(s, {"prompt": "p", "response": "r"})) + "\n"
                    + json.dumps(record(s, {"prompt": "p", "respons": "r"})) + "\n")
    out = import_cli(buffer.url, str(path), "--chunk", "1")
    assert out.returncode == 1
    assert "lines 2-2" in out.stderr and "turns.0.response: Field required" in out.stderr
    assert out.stdout.startswith("records 1 ")


async def test_import_mock_n_sessions(buffer: Buffer, bus: Bus) -> None:
    seed = uuid.uuid4().int % 10_000
    expected = list(mock_records(7, seed))
    sessions = {r["session_id"] for r in expected}
    out = import_cli(buffer.url, "--mock", "7", "--seed", str(seed), "--chunk", "4")
    assert out.returncode == 0, out.stderr
    got = await turns(bus, sessions)
    assert {t.session_id for t in got} == sessions and len(sessions) == 7
    # every main turn arrives, in order, with its next state exactly when the record had one
    want = {r["session_id"]: [("next_state" in t) for t in r["turns"] if t["type"] == "main"]
            for r in expected}
    have: dict[str, list[bool]] = {}
    for t in sorted(got, key=lambda t: (t.session_id, t.turn_index)):
        have.setdefault(t.session_id, []).append(t.next_state is not None)
    assert have == want
