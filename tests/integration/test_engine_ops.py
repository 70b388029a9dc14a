"""Operating the engine: hot weight reloads (good, broken, during a stream), the queue
bound, and what the client raises when the engine is stalled, killed or stopping.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shared.engine_client import ChunkJoiner, GenerateResult, SGLangClient
from shared.errors import EngineTimeout, EngineUnavailable
from shared.schemas import SamplingParams
from tests.integration.test_engine import PROMPT, start_engine
from tests.support.servers import REPO, ServiceProcess, wait_until
from tests.support.tiny_model import build_tiny_model

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
LONG = {"temperature": 1.0, "max_tokens": 400, "seed": 9, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-ops")
    other = build_tiny_model(root / "other", seed=1)
    broken = root / "broken"
    shutil.copytree(tiny_model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    narrow = build_tiny_model(root / "narrow", seed=2, hidden=32)
    wide_vocab = root / "wide-vocab"
    shutil.copytree(other, wide_vocab)
    _resize_vocab(wide_vocab, 600)
    return {"base": tiny_model, "other": other, "broken": broken, "narrow": narrow, "vocab": wide_vocab}


def _resize_vocab(folder: Path, vocab: int) -> None:
    """Same architecture and sizes, another vocabulary: a checkpoint that must be refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    config.vocab_size = vocab
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))  # type: ignore[no-untyped-call]
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == vocab


@pytest.fixture(scope="module")
def engine(models: dict[str, Path]) -> Iterator[tuple[ServiceProcess, str]]:
    proc, url = start_engine(models["base"], NEXTSTATE_ENGINE__MAX_RUNNING="1", NEXTSTATE_ENGINE__MAX_QUEUE="1")
    yield proc, url
    proc.stop()


async def _update(client: SGLangClient, path: Path, version: str, *, abort: bool = False) -> tuple[bool, str]:
    return await client.update_weights(str(path), version, abort_all_requests=abort)


async def test_reload_changes_outputs_and_version_and_back(engine: tuple[ServiceProcess, str], models: dict[str, Path]) -> None:
    _, url = engine
    async with SGLangClient(url, timeout=60) as client:
        base = await client.generate(PROMPT, GREEDY)
        assert base.weight_version == "0"
        ok, msg = await _update(client, models["other"], "1")
        assert ok, msg
        info = await client.model_info()
        assert info["weight_version"] == "1" == await client.weight_version()
        assert info["model_path"] == str(models["other"])
        other = await client.generate(PROMPT, GREEDY)
        assert other.weight_version == "1"
        assert other.output_ids != base.output_ids
        ok, msg = await _update(client, models["base"], "2")
        assert ok, msg
        again = await client.generate(PROMPT, GREEDY)
        assert (again.output_ids, again.weight_version) == (base.output_ids, "2")


@pytest.mark.parametrize(
    ("which", "needle"),
    [("broken", "cannot load"), ("narrow", "hidden_size differs"), ("vocab", "vocab_size differs"), ("missing", "does not exist")],
)
async def test_a_bad_checkpoint_is_refused_and_the_old_weights_keep_serving(
    engine: tuple[ServiceProcess, str], models: dict[str, Path], which: str, needle: str
) -> None:
    _, url = engine
    path = models.get(which, models["base"].parent / "no-such-model")
    async with SGLangClient(url, timeout=60) as client:
        version = await client.weight_version()
        before = await client.generate(PROMPT, GREEDY)
        ok, msg = await _update(client, path, "bad")
        assert not ok and needle in msg, msg
        assert await client.weight_version() == version
        after = await client.generate(PROMPT, GREEDY)
        assert (after.output_ids, after.weight_version) == (before.output_ids, version)


async def _reference(client: SGLangClient) -> GenerateResult:
    return await client.generate(PROMPT, LONG)


async def test_a_reload_waits_for_a_streaming_request(engine: tuple[ServiceProcess, str], models: dict[str, Path]) -> None:
    """Without abort the stream finishes on the weights it started with, then the swap happens."""
    _, url = engine
    async with SGLangClient(url, timeout=120) as client:
        await _update(client, models["base"], "10")
        ref = await _reference(client)
        joiner = ChunkJoiner()
        update: asyncio.Task[tuple[bool, str]] | None = None
        async for chunk in client.stream(PROMPT, LONG):
            joiner.add(chunk)
            assert chunk.weight_version == "10"
            if update is None and len(joiner.ids) >= 5:
                update = asyncio.create_task(_update(client, models["other"], "11"))
        assert update is not None
        streamed = joiner.result()
        assert streamed.output_ids == ref.output_ids  # one set of weights from start to end
        assert streamed.output_logprobs == ref.output_logprobs
        assert streamed.finish_reason == "length"
        ok, msg = await update
        assert ok, msg
        assert (await client.generate(PROMPT, GREEDY)).weight_version == "11"


async def test_a_reload_with_abort_ends_a_stream_mid_way(engine: tuple[ServiceProcess, str], models: dict[str, Path]) -> None:
    _, url = engine
    async with SGLangClient(url, timeout=120) as client:
        await _update(client, models["base"], "20")
        ref = await _reference(client)
        joiner = ChunkJoiner()
        update: asyncio.Task[tuple[bool, str]] | None = None
        async for chunk in client.stream(PROMPT, LONG):
            joiner.add(chunk)
            if update is None and len(joiner.ids) >= 5:
                await client.pause()  # freeze it in place, so the abort surely finds it running
                update = asyncio.create_task(_update(client, models["other"], "21", abort=True))
        assert update is not None
        ok, msg = await update
        await client.resume()
        assert ok, msg
        cut = joiner.result()
        assert cut.finish_reason == "abort" and cut.weight_version == "20"
        assert 5 <= len(cut.output_ids) < len(ref.output_ids)
        assert cut.output_ids == ref.output_ids[: len(cut.output_ids)]
        assert cut.output_logprobs == ref.output_logprobs[: len(cut.output_ids)]
        assert (await client.generate(PROMPT, GREEDY)).weight_version == "21"


async def test_a_paused_engine_refuses_a_waiting_reload_with_requests_in_flight(
    engine: tuple[ServiceProcess, str], models: dict[str, Path]
) -> None:
    _, url = engine
    async with SGLangClient(url, timeout=60) as client:
        stream = client.stream(PROMPT, LONG)
        first = await anext(stream)
        await client.pause()
        try:
            ok, msg = await _update(client, models["base"], "30")
            assert not ok and "paused" in msg
        finally:
            await client.resume()
        rest = [c async for c in stream]
        assert rest[-1].finish_reason == "length" and first.weight_version == rest[-1].weight_version


async def test_a_full_queue_answers_503(engine: tuple[ServiceProcess, str]) -> None:
    _, url = engine
    async with SGLangClient(url, timeout=60) as client:
        await client.pause()
        try:
            waiting = [asyncio.create_task(client.generate(PROMPT, GREEDY)) for _ in range(2)]

            def queued() -> bool:
                return bool(httpx.get(f"{url}/get_server_info", timeout=5).json()["waiting"] == 2)

            await asyncio.to_thread(wait_until, queued, 10, "two queued requests")
            r = await asyncio.to_thread(httpx.post, f"{url}/generate", json={"input_ids": PROMPT}, timeout=10)
            assert r.status_code == 503 and "queue is full" in r.json()["message"]
            with pytest.raises(EngineUnavailable, match="503"):
                await client.generate(PROMPT, GREEDY)
        finally:
            await client.resume()
        assert all(len(r.output_ids) == 24 for r in await asyncio.gather(*waiting))


async def test_a_stalled_engine_times_out(engine: tuple[ServiceProcess, str]) -> None:
    proc, url = engine
    assert proc.proc is not None
    async with SGLangClient(url, timeout=1.0, connect_timeout=1.0) as client:
        await client.generate(PROMPT, GREEDY)  # warm connection
        os.kill(proc.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(EngineTimeout):
                await client.generate(PROMPT, GREEDY)
            with pytest.raises(EngineTimeout):
                async for _ in client.stream(PROMPT, GREEDY):
                    pass
            assert not await client.health()
        finally:
            os.kill(proc.proc.pid, signal.SIGCONT)
        assert await client.health()


async def test_a_killed_engine_is_unavailable_mid_stream_and_after(models: dict[str, Path]) -> None:
    proc, url = start_engine(models["base"])
    assert proc.proc is not None
    try:
        async with SGLangClient(url, timeout=30) as client:
            with pytest.raises(EngineUnavailable):
                async for chunk in client.stream(PROMPT, LONG):
                    if chunk.completion_tokens >= 3 and proc.proc.poll() is None:
                        # (ServiceProcess.kill leaves its log file open; stop() below closes it)
                        os.kill(proc.proc.pid, signal.SIGKILL)
                        await asyncio.to_thread(proc.proc.wait, 10)
            with pytest.raises(EngineUnavailable):
                await client.generate(PROMPT, GREEDY)
            assert not await client.health()
    finally:
        proc.stop()


async def test_sigterm_aborts_in_flight_work_and_exits_zero(models: dict[str, Path]) -> None:
    proc, url = start_engine(models["base"], NEXTSTATE_ENGINE__SHUTDOWN_GRACE_S="0.2")
    assert proc.proc is not None
    try:
        async with SGLangClient(url, timeout=30) as client:
            chunks = []
            big = {**LONG, "max_tokens": 1900}
            async for chunk in client.stream(PROMPT, big):
                chunks.append(chunk)
                if len(chunks) == 3:
                    proc.proc.send_signal(signal.SIGTERM)
            assert chunks[-1].finish_reason == "abort"
        assert await asyncio.to_thread(proc.proc.wait, 15) == 0, proc.logs()
    finally:
        proc.stop()


def _run_engine_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NEXTSTATE_")}
    return subprocess.run(
        [sys.executable, "-m", "services.engine", *args],
        cwd=REPO, env={**clean, **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_missing_or_bad_configuration_fails_at_start_and_says_what_to_fix(tmp_path: Path) -> None:
    missing = _run_engine_cli()
    assert missing.returncode == 2 and "NEXTSTATE_ENGINE__MODEL" in missing.stderr
    bad_port = _run_engine_cli("--model", str(tmp_path), NEXTSTATE_ENGINE__PORT="http")
    assert bad_port.returncode == 2 and "NEXTSTATE_ENGINE__PORT" in bad_port.stderr
    no_folder = _run_engine_cli("--model", str(tmp_path / "nope"), "--port", "0")
    assert no_folder.returncode == 1 and "does not exist" in no_folder.stderr
