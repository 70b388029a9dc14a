"""The real vLLM (CPU build, 0.32) in the loop: one server for the module, on a tiny Llama built
on the spot, started as `nextstate up --engine vllm` starts it, with the internal token.

- every route but the probes needs the token (vLLM's own --api-key leaves the reload routes open);
- turns captured through the collector (a real process, `vllm` client) carry exactly the ids vLLM
  sampled, and log-probs within 1e-4 of vLLM's own re-scoring (prompt_logprobs, temperature 1)
  and of the trainer's recomputation (at temperatures 1 and 0.7); streamed and plain agree;
- the watcher (a real process) hot-reloads a checkpoint the trainer's code trained: the next
  response carries its version and different log-probs; a corrupt and an incompatible
  version are refused without the engine being asked to load anything (vLLM's access log
  shows one reload only), and the engine keeps serving the good one;
- a reload that fails in vLLM (a folder that is not there) answers 500 and leaves vLLM
  half-reloaded — it would die of its next generation: the client puts the weights it
  loaded last back before it resumes, and vLLM serves exactly what it served before.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import torch
from openai import OpenAI

from services.trainer.batching import collate
from services.trainer.model import load_causal_lm, save_hf_folder, window_logprobs
from services.trainer.step import LossConfig, OptimConfig, Trainer, make_optimizer
from shared import checkpoints as ckpt
from shared.engine_client import VLLMClient, join_stream
from shared.schemas import PolicyLoaded, SamplingParams, TrainSample, Turn
from shared.store import Bucket
from tests.conftest import settings_from
from tests.support.servers import ServiceProcess, free_port
from tests.support.tiny_model import build_tiny_model
from tests.support.vllm_server import TOKEN, VLLMServer, require_vllm, tiny_vllm_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

EOS = 2  # <|im_end|> in the tiny tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_vllm_model(tmp_path_factory.mktemp("vllm-model") / "tiny")


@pytest.fixture(scope="module")
def vllm(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    spec = require_vllm()
    server = VLLMServer(model, tmp_path_factory.mktemp("vllm-log") / "vllm.log", spec)
    try:
        yield server.start()
    finally:
        server.stop()


def poll(cond: Callable[[], Any], timeout: float, what: str, logs: Callable[[], str] = str) -> Any:
    """Call `cond` until it returns something truthy (returned); fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}\n{logs()}"
        time.sleep(0.2)
    return got


def client(server: VLLMServer) -> VLLMClient:
    return VLLMClient(server.url, api_key=TOKEN, timeout=120)


def test_every_route_but_the_probes_needs_the_token(vllm: VLLMServer) -> None:
    for path in ("/pause", "/collective_rpc", "/update_weight_version", "/resume"):
        assert httpx.post(f"{vllm.url}{path}", timeout=10).status_code == 401, path
    for path in ("/weight_info", "/v1/models", "/metrics"):
        assert httpx.get(f"{vllm.url}{path}", timeout=10).status_code == 401, path
    assert httpx.get(f"{vllm.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{vllm.url}/weight_info", headers={"authorization": f"Bearer {TOKEN}"},
                     timeout=10).json() == {"weight_version": "default"}


# -- capture ------------------------------------------------------------------------------------
@pytest.fixture
def collector(vllm: VLLMServer, model: Path, env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    proc = ServiceProcess("collector", {
        **env, "NEXTSTATE_INTERNAL__TOKEN": TOKEN, "NEXTSTATE_COLLECTOR__ENGINE_KIND": "vllm",
        "NEXTSTATE_COLLECTOR__ENGINE_URL": vllm.url, "NEXTSTATE_COLLECTOR__TOKENIZER": str(model),
        "NEXTSTATE_COLLECTOR__PORT": str(port),
        "NEXTSTATE_COLLECTOR__SPOOL_PATH": str(Path(tempfile.mkdtemp()) / "spool.jsonl"),
    })  # fmt: skip
    try:
        proc.start().wait_http(f"http://127.0.0.1:{port}/readyz", timeout=120)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.stop()


def turns(redis_url: str, prefix: str, n: int) -> list[Turn]:
    r = redis.Redis.from_url(redis_url, decode_responses=True)

    def got() -> list[Turn] | None:
        rows = [Turn.from_json(f["data"]) for _, f in r.xrange(f"{prefix}:turns")]
        return rows if len(rows) >= n else None

    return poll(got, 60, f"{n} captured turns")


def test_captured_turns_carry_what_vllm_sampled(
    vllm: VLLMServer, model: Path, collector: str, env: dict[str, str], redis_url: str,
) -> None:  # fmt: skip
    api = OpenAI(base_url=collector, api_key="unused", timeout=120, max_retries=0)
    asks = [(1.0, "hello there, what is the weather in paris"), (0.7, "tell me about tokyo"),
            (1.0, "please fix the file")]
    for temperature, text in asks:
        for stream in (False, True):  # the same request twice: plain, then streamed
            kwargs: dict[str, Any] = dict(model="policy", messages=[{"role": "user", "content": text}],
                                          max_tokens=12, temperature=temperature, seed=11,
                                          extra_headers={"X-Session-Done": "1"})  # fmt: skip
            if stream:
                for _ in api.chat.completions.create(stream=True, **kwargs):
                    pass
            else:
                api.chat.completions.create(**kwargs)
    captured = turns(redis_url, env["NEXTSTATE_REDIS__PREFIX"], 2 * len(asks))
    assert len(captured) == 2 * len(asks)
    plain, streamed = captured[0::2], captured[1::2]
    for a, b in zip(plain, streamed, strict=True):  # streaming and non-streaming agree
        assert (a.prompt_ids, a.response_ids) == (b.prompt_ids, b.response_ids)
        assert max(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs, strict=True)) < 1e-5
        assert a.weight_version == b.weight_version == "0"

    async def vllm_side() -> list[tuple[list[int], list[float]]]:
        out = []
        async with client(vllm) as engine:
            for t in plain:
                again = await engine.generate(t.prompt_ids, t.sampling, stop_token_ids=[EOS])
                rescored = await engine.score(t.prompt_ids + t.response_ids, len(t.prompt_ids))
                out.append((again.output_ids, rescored))
        return out

    samples = []
    for t, (again, rescored) in zip(plain, asyncio.run(vllm_side()), strict=True):
        assert len(t.response_ids) > 0 and len(t.response_logprobs) == len(t.response_ids)
        assert t.response_ids == again  # exactly what vLLM samples for that prompt and seed
        if t.sampling.temperature == 1.0:  # vLLM re-scores with the raw (temperature 1) distribution
            gap = max(abs(x - y) for x, y in zip(t.response_logprobs, rescored, strict=True))
            assert gap < 1e-4, f"captured log-probs differ from vLLM's prompt_logprobs by {gap}"
        samples.append(TrainSample(
            session_id=t.session_id, tokens=t.prompt_ids + t.response_ids, response_length=len(t.response_ids),
            loss_mask=[1] * len(t.response_ids), reward=1.0, rollout_logprobs=t.response_logprobs,
            temperature=t.sampling.temperature,
        ))  # fmt: skip
    mb = collate(samples, "rl")
    assert mb is not None
    with torch.no_grad():
        ours = window_logprobs(load_causal_lm(model, torch.device("cpu"), torch.float32), mb)
    m = mb.mask.bool()
    gap = (ours[m] - mb.old_logprobs[m]).abs().max().item()
    assert gap < 1e-4, f"the trainer's log-probs differ from vLLM's by {gap}"


# -- hot reload ------------------------------------------------------------------------------------
def trained(model: Path, dest: Path) -> Path:
    """`model` after one real policy-gradient step of the trainer's code, as an HF folder."""
    net = load_causal_lm(model, torch.device("cpu"), torch.float32)
    prompt = [260, 447, 274, 318, 474, 429, 485]
    samples = [TrainSample(session_id="s", tokens=[*prompt, 300 + i, 301, 302], response_length=3,
                           loss_mask=[1, 1, 1], reward=1.0, rollout_logprobs=[-6.0] * 3, temperature=1.0)
               for i in range(4)]  # fmt: skip
    optim = OptimConfig(lr=5e-2)
    Trainer(net, make_optimizer(net, optim), LossConfig(kl_beta=0.0), optim, micro_batch_tokens=64).step(samples)
    save_hf_folder(net, {k: v.detach().clone() for k, v in net.state_dict().items()}, dest, model)
    return dest


def recomputed_gap(folder: Path, prompt: list[int], ids: list[int], logprobs: list[float]) -> float:
    """The largest gap between an engine's log-probs of `ids` (temperature 1) and the trainer's
    on `folder`'s weights."""
    sample = TrainSample(session_id="s", tokens=prompt + ids, response_length=len(ids), loss_mask=[1] * len(ids),
                         reward=1.0, rollout_logprobs=logprobs, temperature=1.0)  # fmt: skip
    mb = collate([sample], "rl")
    assert mb is not None
    with torch.no_grad():
        ours = window_logprobs(load_causal_lm(folder, torch.device("cpu"), torch.float32), mb)
    m = mb.mask.bool()
    return float((ours[m] - mb.old_logprobs[m]).abs().max().item())


def test_the_watcher_hot_reloads_a_trained_version_and_refuses_bad_ones(
    vllm: VLLMServer, model: Path, s3_env: dict[str, str], tmp_path: Path, redis_url: str,
) -> None:  # fmt: skip
    settings = settings_from(s3_env)
    run, prefix = s3_env["NEXTSTATE_RUN"], s3_env["NEXTSTATE_REDIS__PREFIX"]
    bucket = Bucket(settings.bucket)
    prompt, sampling = [260, 447, 274, 318, 474, 429, 485], SamplingParams(temperature=1.0, max_tokens=8, seed=5)

    async def sample() -> tuple[str, list[float]]:
        async with client(vllm) as engine:
            res = await join_stream(engine.stream(prompt, sampling))
            ids.append(res.output_ids)
            return res.weight_version, res.output_logprobs

    ids: list[list[int]] = []
    version0, before = asyncio.run(sample())
    reloads_before = vllm.count("POST /collective_rpc")
    v1 = trained(model, tmp_path / "v1")
    ckpt.publish_checkpoint(bucket, run, 1, v1, step=1)
    watcher = ServiceProcess("watcher", {
        **s3_env, "NEXTSTATE_INTERNAL__TOKEN": TOKEN, "NEXTSTATE_WATCHER__ENGINE_KIND": "vllm",
        "NEXTSTATE_WATCHER__ENGINE_URL": vllm.url, "NEXTSTATE_WATCHER__LOCAL_DIR": str(tmp_path / "local"),
        "NEXTSTATE_WATCHER__POLL_INTERVAL_S": "0.5", "NEXTSTATE_WATCHER__PORT": str(free_port()),
    }).start()  # fmt: skip
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        def loaded() -> list[PolicyLoaded]:
            return [PolicyLoaded.from_json(f["data"]) for _, f in r.xrange(f"{prefix}:policy")]

        poll(lambda: [e.version for e in loaded()] == [1], 120, "v1 loaded", watcher.logs)
        version1, after = asyncio.run(sample())
        assert (version0, version1) == ("0", "1")
        assert max(abs(a - b) for a, b in zip(before, after, strict=False)) > 1e-3, "the output did not change"
        assert vllm.count("POST /collective_rpc") == reloads_before + 1
        assert recomputed_gap(v1, prompt, ids[-1], after) < 1e-4  # the reloaded weights are v1's, whole

        # v2: a shard whose bytes differ from its manifest; v3: a model of other shapes.
        bad = trained(model, tmp_path / "v2")
        ckpt.publish_checkpoint(bucket, run, 2, bad, step=2)
        shard = bad / "model.safetensors"
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
        bucket.put_file(ckpt.version_prefix(run, 2) + "model.safetensors", shard)
        refused = poll(lambda: r.hgetall(f"{prefix}:refused-versions"), 120, "v2 refused", watcher.logs)
        assert "2" in refused and "checksum" in refused["2"], refused
        ckpt.publish_checkpoint(bucket, run, 3, build_tiny_model(tmp_path / "v3", seed=3, hidden=64), step=3)
        refused = poll(lambda: (x := r.hgetall(f"{prefix}:refused-versions")) and "3" in x and x,
                       120, "v3 refused", watcher.logs)
        assert "incompatible" in refused["3"] and "hidden_size" in refused["3"], refused
        # Never sent to the engine: still one reload, still serving v1, still healthy.
        assert vllm.count("POST /collective_rpc") == reloads_before + 1
        assert asyncio.run(sample()) == (version1, after)
        assert [e.version for e in loaded()] == [1]
    finally:
        assert watcher.stop() in (0, None), watcher.logs()


def test_a_failed_reload_leaves_vllm_serving_what_it_served(vllm: VLLMServer, model: Path, tmp_path: Path) -> None:
    prompt, sampling = [301, 12, 77, 410, 260, 9], SamplingParams(temperature=1.0, max_tokens=8, seed=9)
    good = trained(model, tmp_path / "good")

    async def scenario() -> None:
        async with client(vllm) as engine:
            ok, message = await engine.update_weights(str(good), "41")
            assert ok, message
            before = await engine.generate(prompt, sampling)
            failures = vllm.count("POST /collective_rpc", 500)
            ok, message = await engine.update_weights(str(tmp_path / "no-such-version"), "42")
            assert not ok and "could not reload" in message and "as version 41" in message, message
            assert vllm.count("POST /collective_rpc", 500) == failures + 1  # vLLM did fail it
            for _ in range(3):  # a half-reloaded vLLM would die of the first of these
                again = await engine.generate(prompt, sampling)
                assert (again.output_ids, again.weight_version) == (before.output_ids, "41")
                assert max(abs(a - b) for a, b in zip(again.output_logprobs, before.output_logprobs, strict=True)) < 1e-5
            assert await engine.weight_version() == "41" and await engine.health()

    asyncio.run(scenario())
