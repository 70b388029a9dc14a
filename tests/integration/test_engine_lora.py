"""LoRA adapters in the CPU engine, as a real process: load and unload by name, the default
(newest) adapter for requests that name none, the version each output reports, adapters
mixed in one decode batch, an adapter unloaded under a running request, refusals — and the
trainer recomputing the engine's log-probs of base + adapter (the PPO ratio is 1)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.trainer.batching import collate
from services.trainer.model import (
    LoraSpec,
    add_lora,
    load_causal_lm,
    read_adapter_weights,
    window_logprobs,
)
from services.trainer.step import LossConfig, OptimConfig, Trainer, make_optimizer
from shared.schemas import TrainSample
from tests.integration.test_engine import start_engine
from tests.support.tiny_model import build_tiny_adapter

pytestmark = pytest.mark.integration

PROMPT = [260, 447, 274, 318, 474, 429, 485]


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    found = {name: build_tiny_adapter(tiny_model, root / name, seed=seed)
             for name, seed in (("1", 1), ("2", 2))}
    bad = root / "truncated"
    bad.mkdir()
    (bad / "adapter_config.json").write_bytes((found["1"] / "adapter_config.json").read_bytes())
    data = (found["1"] / "adapter_model.safetensors").read_bytes()
    (bad / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    big = root / "rank-64"
    build_tiny_adapter(tiny_model, big, rank=64)
    return {**found, "truncated": bad, "rank-64": big}


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[str]:
    proc, url = start_engine(tiny_model, NEXTSTATE_ENGINE__MAX_RUNNING="8", NEXTSTATE_ENGINE__MAX_LORA_RANK="16",
                             NEXTSTATE_ENGINE__MAX_LORAS="2")
    yield url
    assert proc.stop() == 0, proc.logs()


def call(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def generate(url: str, seed: int = 7, **extra: Any) -> dict[str, Any]:
    r = call(url, "/generate", {"input_ids": PROMPT, "return_logprob": True, **extra,
                               "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": seed}})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def logprobs(out: dict[str, Any]) -> list[float]:
    return [float(e[0]) for e in out["meta_info"]["output_token_logprobs"]]


def test_adapters_load_by_name_and_the_newest_serves_requests_that_name_none(
    engine: str, adapters: dict[str, Path], tiny_model: Path
) -> None:
    base = generate(engine)
    assert base["meta_info"]["weight_version"] == "0"
    r = call(engine, "/load_lora_adapter", {"lora_name": "1", "lora_path": str(adapters["1"])})
    assert r.status_code == 200 and r.json() == {
        "success": True, "error_message": "", "loaded_adapters": {"1": str(adapters["1"])}}
    assert httpx.get(f"{engine}/get_weight_version").json() == {"weight_version": "1"}
    one = generate(engine)
    assert one["meta_info"]["weight_version"] == "1"
    assert logprobs(one) != logprobs(base)
    assert logprobs(generate(engine, lora_path="1")) == logprobs(one)
    named_base = generate(engine, lora_path="0")  # the base, by its version
    assert named_base["meta_info"]["weight_version"] == "0" and logprobs(named_base) == logprobs(base)

    # The trainer's log-probs of base + this adapter are the engine's: on-policy, ratio 1.
    samples = []
    for seed, temperature in ((7, 1.0), (8, 0.7), (9, 1.3)):
        r = call(engine, "/generate", {"input_ids": PROMPT, "return_logprob": True, "sampling_params": {
            "temperature": temperature, "max_new_tokens": 10, "sampling_seed": seed}})
        out = r.json()
        samples.append(TrainSample(
            session_id="s", tokens=PROMPT + out["output_ids"], response_length=len(out["output_ids"]),
            loss_mask=[1] * len(out["output_ids"]), reward=1.0, rollout_logprobs=logprobs(out),
            temperature=temperature, policy_version=1,
        ))  # fmt: skip
    config = json.loads((adapters["1"] / "adapter_config.json").read_text())
    model = add_lora(load_causal_lm(tiny_model, torch.device("cpu"), torch.float32),
                     LoraSpec(rank=config["r"], alpha=config["lora_alpha"]),
                     read_adapter_weights(adapters["1"]))
    mb = collate(samples, "rl")
    assert mb is not None
    with torch.no_grad():
        ours = window_logprobs(model, mb)
    m = mb.mask.bool()
    diff = (ours[m] - mb.old_logprobs[m]).abs().max().item()
    assert diff < 1e-4, f"trainer (base + adapter) and engine log-probs differ by {diff}"
    trainer = Trainer(model, make_optimizer(model, OptimConfig()), LossConfig(kl_beta=0.0), OptimConfig(),
                      micro_batch_tokens=64)
    metrics = trainer.step(samples)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and metrics["clip_frac"] == 0.0


async def test_a_decode_batch_mixes_adapters_and_an_unloaded_one_finishes_its_requests(
    engine: str, adapters: dict[str, Path]
) -> None:
    for name in ("1", "2"):
        r = call(engine, "/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters[name])})
        assert r.status_code == 200, r.text
    assert call(engine, "/update_weight_version", {"new_version": "2"}).json()["message"] == "weight version is 2"
    alone = {name: generate(engine, lora_path=name) for name in ("0", "1", "2")}
    async with httpx.AsyncClient(timeout=60) as http:
        answers = await asyncio.gather(*(http.post(f"{engine}/generate", json={
            "input_ids": PROMPT, "return_logprob": True, "lora_path": name,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 7}})
            for name in ("0", "1", "2", "1")))  # one decode batch, three sets of weights
    for name, answer in zip(("0", "1", "2", "1"), answers, strict=True):
        out = answer.json()
        assert out["meta_info"]["weight_version"] == name
        assert out["output_ids"] == alone[name]["output_ids"]
        assert max(abs(a - b) for a, b in zip(logprobs(out), logprobs(alone[name]), strict=True)) < 1e-5

    # A long request on "1" is running when "1" is unloaded: it finishes on "1"; new ones get "2".
    body = {"input_ids": PROMPT, "lora_path": "1", "stream": True, "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 60, "sampling_seed": 3, "ignore_eos": True}}
    async with httpx.AsyncClient(timeout=60) as http, http.stream("POST", f"{engine}/generate", json=body) as resp:
        lines = resp.aiter_lines()
        first = await anext(lines)
        assert first.startswith("data: ") and json.loads(first[6:])["meta_info"]["weight_version"] == "1"
        r = await http.post(f"{engine}/unload_lora_adapter", json={"lora_name": "1"})
        assert r.json()["loaded_adapters"] == {"2": str(adapters["2"])}
        refused = await http.post(f"{engine}/generate", json={"input_ids": PROMPT, "lora_path": "1"})
        assert refused.status_code == 400 and "not loaded" in refused.json()["message"]
        events = [json.loads(line[6:]) for line in [first, *[x async for x in lines]]
                  if line.startswith("data: ") and line != "data: [DONE]"]
    last = events[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length" and len(last["output_ids"]) == 60
    assert {e["meta_info"]["weight_version"] for e in events} == {"1"}
    assert generate(engine)["meta_info"]["weight_version"] == "2"
    assert call(engine, "/unload_lora_adapter", {"lora_name": "2"}).json()["loaded_adapters"] == {}
    assert generate(engine)["meta_info"]["weight_version"] == "0"


def test_bad_adapters_are_refused_and_the_served_one_stays(engine: str, adapters: dict[str, Path],
                                                           tiny_model: Path) -> None:
    assert call(engine, "/load_lora_adapter", {"lora_name": "1", "lora_path": str(adapters["1"])}).status_code == 200
    before = generate(engine)
    for path, why in ((adapters["truncated"], "cannot be read"), (adapters["rank-64"], "above this engine"),
                      (tiny_model, "adapter_config.json"), (adapters["1"].parent / "nothing", "does not exist")):
        r = call(engine, "/load_lora_adapter", {"lora_name": "9", "lora_path": str(path)})
        assert r.status_code == 400 and r.json()["success"] is False and why in r.json()["error_message"], r.text
        assert r.json()["loaded_adapters"] == {"1": str(adapters["1"])}
    r = call(engine, "/load_lora_adapter", {"lora_name": "1", "lora_path": str(adapters["2"])})
    assert r.status_code == 400 and "already loaded" in r.json()["error_message"]
    assert call(engine, "/load_lora_adapter", {"lora_name": "2", "lora_path": str(adapters["2"])}).status_code == 200
    r = call(engine, "/load_lora_adapter", {"lora_name": "3", "lora_path": str(adapters["2"])})
    assert r.status_code == 400 and "MAX_LORAS" in r.json()["error_message"]
    # /update_weight_version makes a loaded adapter the default again (a rollback's order).
    assert call(engine, "/update_weight_version", {"new_version": "1"}).status_code == 200
    assert logprobs(generate(engine)) == logprobs(before)
    # Full weights cannot replace the base under loaded adapters.
    r = call(engine, "/update_weights_from_disk", {"model_path": str(tiny_model), "weight_version": "5"})
    assert r.status_code == 400 and "unload them first" in r.json()["message"]
    models = httpx.get(f"{engine}/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in models[1:]] == [("1", models[0]["id"]), ("2", models[0]["id"])]
    for name in ("1", "2"):
        assert call(engine, "/unload_lora_adapter", {"lora_name": name}).status_code == 200
    r = call(engine, "/unload_lora_adapter", {"lora_name": "1"})
    assert r.status_code == 400 and "not loaded" in r.json()["error_message"]
