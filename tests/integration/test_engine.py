"""The CPU engine as a real process over real HTTP: /generate, streaming, scoring, stops,
concurrency, the OpenAI endpoint, bad input, pause, and the SGLang client against it.

One engine process serves the whole module (tests that change its weights or kill it
live in test_engine_ops.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from services.ctl.infra import free_port
from shared.engine_client import EngineClient, SGLangClient, join_stream
from shared.errors import EngineRejected
from shared.schemas import SamplingParams
from tests.support.servers import ServiceProcess, wait_until

pytestmark = pytest.mark.integration

PROMPT = [260, 447, 274, 318, 474, 429, 485]


def start_engine(model: Path, **env: str) -> tuple[ServiceProcess, str]:
    """`python -m services.engine --model … --port …` on a free port, ready on /health."""
    port = free_port()
    proc = ServiceProcess(
        "engine",
        env={"NEXTSTATE_ENV": "test", "NEXTSTATE_ENGINE__THREADS": "1", **env},
        args=["--model", str(model), "--port", str(port)],
    )
    url = f"http://127.0.0.1:{port}"
    try:
        proc.start().wait_http(f"{url}/health", timeout=90)
    except Exception:
        proc.stop()
        raise
    return proc, url


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[str]:
    proc, url = start_engine(tiny_model, NEXTSTATE_ENGINE__MAX_RUNNING="8")
    yield url
    assert proc.stop() == 0, proc.logs()


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model))


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=60)


def sse_events(url: str, body: dict[str, Any]) -> list[Any]:
    """Raw server-sent events of a streamed /generate, checking the framing."""
    with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_bytes()).decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    assert all(f.startswith("data: ") for f in frames[:-1])
    return [json.loads(f[len("data: ") :]) for f in frames[:-2]]


# -- /generate ----------------------------------------------------------------------------


def test_generate_returns_sglang_shapes(engine: str, tokenizer: Any) -> None:
    sampling: dict[str, Any] = {"max_new_tokens": 12, "temperature": 0.8, "seed": 3, "ignore_eos": True}
    body: dict[str, Any] = {"input_ids": PROMPT, "sampling_params": sampling, "return_logprob": True}
    r = post(engine, body)
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 12 == meta["completion_tokens"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["weight_version"] == "0"
    assert isinstance(meta["id"], str) and meta["e2e_latency"] > 0
    lps = meta["output_token_logprobs"]
    assert [e[1] for e in lps] == out["output_ids"]
    assert all(e[0] <= 0 and e[2] is None for e in lps)
    # without logprob_start_len only the last prompt token is listed, with no value (SGLang)
    assert meta["input_token_logprobs"] == [[None, PROMPT[-1], None]]
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    # same seed, same tokens; `sampling_seed` is SGLang's name for it
    body["sampling_params"] = {**sampling, "seed": None, "sampling_seed": 3}
    assert post(engine, body).json()["output_ids"] == out["output_ids"]


def test_text_input_and_default_max_new_tokens(engine: str, tokenizer: Any) -> None:
    out = post(engine, {"text": "hello the weather", "sampling_params": {"ignore_eos": True}}).json()
    assert out["meta_info"]["prompt_tokens"] == len(tokenizer("hello the weather")["input_ids"])
    assert len(out["output_ids"]) == 128  # SGLang's default max_new_tokens


def test_stream_is_cumulative_and_ends_like_the_plain_response(engine: str) -> None:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 20, "temperature": 1.0, "seed": 11, "ignore_eos": True},
        "return_logprob": True,
    }
    plain = post(engine, body).json()
    events = sse_events(engine, body)
    assert len(events) == 20
    for i, ev in enumerate(events, 1):
        assert ev["output_ids"] == plain["output_ids"][:i]  # cumulative, as SGLang by default
        assert ev["meta_info"]["completion_tokens"] == i
        assert len(ev["meta_info"]["output_token_logprobs"]) == i
        assert plain["text"].startswith(ev["text"])
        assert (ev["meta_info"]["finish_reason"] is None) == (i < 20)
    last = events[-1]
    assert last["text"] == plain["text"]
    assert last["meta_info"]["output_token_logprobs"] == plain["meta_info"]["output_token_logprobs"]


async def test_client_stream_joins_to_the_generate_result(engine: str) -> None:
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=25, seed=21)
    async with SGLangClient(engine, timeout=30) as client:
        plain = await client.generate(PROMPT, sampling)
        chunks = [c async for c in client.stream(PROMPT, sampling)]
    assert sum(len(c.new_ids) for c in chunks) == len(plain.output_ids)
    assert all(len(c.new_ids) == len(c.new_logprobs) for c in chunks)
    assert "".join(c.new_text for c in chunks) == plain.text
    assert chunks[-1].done and not any(c.done for c in chunks[:-1])
    assert chunks[-1].weight_version == "0"

    async def replay() -> Any:
        for c in chunks:
            yield c

    joined = await join_stream(replay())
    assert joined.output_ids == plain.output_ids
    assert joined.output_logprobs == plain.output_logprobs
    assert (joined.text, joined.finish_reason) == (plain.text, plain.finish_reason)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_scoring_reproduces_the_sampled_logprobs(engine: str, temperature: float) -> None:
    """What OPD relies on: score(prompt + response) == the log-probs reported when sampling."""
    async with SGLangClient(engine, timeout=30) as client:
        sampling = SamplingParams(temperature=temperature, max_tokens=40, seed=5)
        res = await client.generate(PROMPT, sampling)
        scores = await client.score(PROMPT + res.output_ids, len(PROMPT), temperature=temperature)
    assert len(scores) == len(res.output_ids) == len(res.output_logprobs)
    assert scores == pytest.approx(res.output_logprobs, abs=1e-4)


def test_input_logprobs_layout_and_max_new_tokens_zero(engine: str) -> None:
    ids = [*PROMPT, 17, 144, 400]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    out = post(engine, body).json()
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["output_token_logprobs"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == ids
    assert entries[0][0] is None and all(e[0] < 0 for e in entries[1:])
    # a later start gives the same values for the same positions
    later = post(engine, {**body, "logprob_start_len": 4}).json()["meta_info"]["input_token_logprobs"]
    assert later[0] == [None, ids[4], None]
    assert [e[0] for e in later[1:]] == pytest.approx([e[0] for e in entries[5:]], abs=1e-5)
    top = post(engine, {**body, "top_logprobs_num": 3}).json()["meta_info"]
    assert top["input_top_logprobs"][0] is None and len(top["input_top_logprobs"][1]) == 3


def test_stop_token_ids_and_eos_end_with_matched_token(engine: str, tokenizer: Any) -> None:
    ref = post(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}}).json()
    ids = ref["output_ids"]
    stop_id = ids[6]
    first = ids.index(stop_id)
    out = post(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30, "temperature": 0, "stop_token_ids": [stop_id]}, "return_logprob": True}).json()
    assert out["output_ids"] == ids[: first + 1]  # the stop token is kept in the ids
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["text"] == tokenizer.decode(ids[:first], skip_special_tokens=True)  # but not in the text
    assert len(out["meta_info"]["output_token_logprobs"]) == first + 1


def test_stop_string_trims_the_text(engine: str, tokenizer: Any) -> None:
    ref = post(engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}}).json()
    ids = ref["output_ids"]
    texts = [tokenizer.decode(ids[:k], skip_special_tokens=True) for k in range(len(ids) + 1)]
    # a stop string made of the text a middle token adds
    k_tok = next(k for k in range(4, len(ids)) if texts[k + 1][len(texts[k]) :].strip() and "\ufffd" not in texts[k + 1])
    stop = texts[k_tok + 1][len(texts[k_tok]) :]
    k_stop = next(k for k in range(len(ids) + 1) if stop in texts[k])
    sampling: dict[str, Any] = {"max_new_tokens": 30, "temperature": 0, "stop": [stop]}
    body: dict[str, Any] = {"input_ids": PROMPT, "sampling_params": sampling}
    out = post(engine, body).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ids[:k_stop]
    assert out["text"] == texts[k_stop][: texts[k_stop].find(stop)]
    kept = post(engine, {**body, "sampling_params": {**sampling, "no_stop_trim": True}}).json()
    assert kept["text"] == texts[k_stop]
    events = sse_events(engine, body)  # streamed text never shows a part of the stop string
    assert events[-1]["text"] == out["text"]
    assert all(out["text"].startswith(ev["text"]) for ev in events)


async def until_queued(url: str, n: int) -> None:
    """Wait until `n` requests wait in the engine's queue (generation paused)."""

    def queued() -> bool:
        return bool(httpx.get(f"{url}/get_server_info", timeout=5).json()["waiting"] == n)

    await asyncio.to_thread(wait_until, queued, 30, f"{n} request(s) to wait in the queue")


async def all_at_once(client: SGLangClient, url: str, calls: list[Any]) -> list[Any]:
    """Run the calls concurrently, all admitted together: generation is paused until every
    one of them waits in the engine's queue (however slowly they arrive)."""
    await client.pause()
    try:
        tasks = [asyncio.create_task(c) for c in calls]
        await until_queued(url, len(calls))
    finally:
        await client.resume()
    return list(await asyncio.gather(*tasks))


async def run_three_ways(url: str) -> list[tuple[Any, Any, Any]]:
    """Eight seeded requests of different lengths: one after another, all at once, and all
    at once streamed."""
    samplings = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30 + 5 * i, seed=100 + i) for i in range(8)]
    prompts = [PROMPT[: 3 + i % 4] for i in range(8)]
    pairs = list(zip(prompts, samplings, strict=True))
    async with SGLangClient(url, timeout=60) as client:
        sequential = [await client.generate(p, s) for p, s in pairs]
        concurrent = await all_at_once(client, url, [client.generate(p, s) for p, s in pairs])
        streamed = await all_at_once(client, url, [join_stream(client.stream(p, s)) for p, s in pairs])
    return list(zip(sequential, concurrent, streamed, strict=True))


def decode_batch_sizes(url: str) -> dict[str, float]:
    """The engine's histogram of decode batch sizes: {le: cumulative count}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    prefix = 'nextstate_engine_decode_batch_size_bucket{le="'
    return {line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}  # fmt: skip


async def test_concurrent_requests_decode_in_one_batch_and_match_their_sequential_results(engine: str) -> None:
    before = decode_batch_sizes(engine)
    for a, b, c in await run_three_ways(engine):
        # Batched decode steps reassociate the matmuls: the same tokens, log-probs to ~1e-7.
        assert a.output_ids == b.output_ids == c.output_ids
        assert a.text == b.text == c.text
        for x, y, z in zip(a.output_logprobs, b.output_logprobs, c.output_logprobs, strict=True):
            assert abs(x - y) < 1e-5 and abs(x - z) < 1e-5
    after = decode_batch_sizes(engine)
    # all eight join after their prompts; every step has all eight until the shortest ends
    steps = after["+Inf"] - before["+Inf"]
    assert steps - (after["4.0"] - before["4.0"]) >= 2 * 29, "concurrent requests did not share decode steps"


async def test_unbatched_engine_is_bit_exact_under_load(tiny_model: Path) -> None:
    proc, url = start_engine(tiny_model, NEXTSTATE_ENGINE__MAX_RUNNING="8", NEXTSTATE_ENGINE__BATCH_DECODE="false")
    try:
        for a, b, c in await run_three_ways(url):
            assert a.output_ids == b.output_ids == c.output_ids
            assert a.output_logprobs == b.output_logprobs == c.output_logprobs
            assert a.text == b.text == c.text
        assert decode_batch_sizes(url)["+Inf"] == 0
    finally:
        assert proc.stop() == 0, proc.logs()


async def test_a_client_that_goes_away_frees_its_slot(engine: str) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}, "stream": True}
    async with httpx.AsyncClient(timeout=30) as http, http.stream("POST", f"{engine}/generate", json=body) as r:
        lines = r.aiter_lines()
        async for line in lines:
            if line.startswith("data:"):
                break

    def idle() -> bool:
        info = httpx.get(f"{engine}/get_server_info", timeout=5).json()
        return bool(info["running"] == 0 and info["waiting"] == 0)

    await asyncio.to_thread(wait_until, idle, 10, "the engine to drop the abandoned request")


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"sampling_params": {"max_new_tokens": 3}}, "exactly one of text or input_ids"),
        ({"input_ids": [1, 2], "text": "x"}, "exactly one of text or input_ids"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [1, 99999]}, "input_ids must be in"),
        ({"input_ids": [[1, 2], [3]]}, "batched"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "bogus"),
        ({"input_ids": [1], "sampling_params": {"n": 2}}, "n=2"),
        ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "regex"),
        ({"input_ids": [1], "logprob_start_len": -5}, "logprob_start_len"),
        ({"input_ids": [1], "image_data": "abc"}, "image_data"),
        ({"input_ids": list(range(10)) * 205}, "context length"),
    ],
)
def test_bad_input_is_a_400_naming_the_problem(engine: str, body: dict[str, Any], needle: str) -> None:
    r = post(engine, body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["code"] == 400 and needle in err["message"]


def test_malformed_json_is_a_400(engine: str) -> None:
    r = httpx.post(f"{engine}/generate", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["message"]


async def test_client_maps_a_400_to_engine_rejected(engine: str) -> None:
    async with SGLangClient(engine, timeout=10) as client:
        with pytest.raises(EngineRejected) as err:
            await client.generate([1, 99999], SamplingParams(max_tokens=2))
        assert err.value.status_code == 400 and "input_ids" in str(err.value)
        with pytest.raises(ValueError):
            await client.score([1, 2, 3], 0)
        assert await client.score([1, 2, 3], 3) == []


# -- info, health, metrics, pause -----------------------------------------------------------


async def test_info_health_and_metrics(engine: str, tiny_model: Path) -> None:
    client: EngineClient = SGLangClient(engine, timeout=10)
    async with client:
        info = await client.model_info()
        assert info["model_path"] == str(tiny_model) and info["is_generation"] is True
        assert info["weight_version"] == await client.weight_version() == "0"
        assert await client.health()
    async with httpx.AsyncClient(base_url=engine, timeout=30) as http:
        assert (await http.get("/get_model_info")).json() == info
        assert (await http.get("/health_generate")).status_code == 200
        metrics = (await http.get("/metrics")).text
    for name in ("nextstate_engine_requests_total", "nextstate_engine_generated_tokens_total",
                 "nextstate_engine_queue_depth", "nextstate_engine_request_latency_seconds"):  # fmt: skip
        assert name in metrics


async def test_pause_holds_new_requests_until_continue(engine: str) -> None:
    async with SGLangClient(engine, timeout=30) as client:
        await client.pause()
        try:
            task = asyncio.create_task(client.generate(PROMPT, SamplingParams(max_tokens=5, seed=1)))
            await until_queued(engine, 1)
            assert not task.done()
        finally:
            await client.resume()
        res = await asyncio.wait_for(task, 30)
        assert len(res.output_ids) == 5 and res.finish_reason == "length"


# -- OpenAI ---------------------------------------------------------------------------------


async def test_openai_chat_completions_through_the_sdk(engine: str) -> None:
    sdk = openai.AsyncOpenAI(base_url=f"{engine}/v1", api_key="unused", timeout=30, max_retries=0)
    try:
        models = await sdk.models.list()
        name = models.data[0].id
        resp = await sdk.chat.completions.create(
            model=name,
            messages=[{"role": "system", "content": "judge"}, {"role": "user", "content": "hi"}],
            max_tokens=16,
            temperature=0.7,
            seed=4,
        )
        again = await sdk.chat.completions.create(
            model=name,
            messages=[{"role": "system", "content": "judge"}, {"role": "user", "content": "hi"}],
            max_tokens=16,
            temperature=0.7,
            seed=4,
        )
        assert isinstance(resp.choices[0].message.content, str)
        assert resp.choices[0].message.content == again.choices[0].message.content
        assert resp.choices[0].finish_reason in ("stop", "length")
        assert resp.usage is not None and 0 < resp.usage.completion_tokens <= 16
        stream = await sdk.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True,
            temperature=0.7, seed=4,
        )  # fmt: skip
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert len(parts) >= 1
        with pytest.raises(openai.BadRequestError) as err:
            await sdk.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], n=2)
        assert "n=1" in str(err.value)
        with pytest.raises(openai.BadRequestError):
            await sdk.chat.completions.create(model=name, messages=[])
    finally:
        await sdk.close()
