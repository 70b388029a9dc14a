"""The `env:<name>` evaluation suite against real processes: Redis, the engine serving the
tool-calling tiny model (parsing tool calls as SGLang's `--tool-call-parser` does) and an
envs worker (`python -m services.envs`). The suite enqueues held-out episodes; the worker
runs them greedily against the evaluation engine — no collector, nothing on `outcomes` —
and the suite scores what comes back. Without a worker it fails at once; a worker that may
not call the engine named in the jobs records errors, and the suite fails saying why.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import openai
import pytest

from services.evaluator.settings import EvalConfig
from services.evaluator.suite import EvalContext
from services.evaluator.suites import resolve
from services.evaluator.suites.errors import SuiteError
from shared.settings import Settings
from shared.streams import Bus
from tests.support.collector_harness import engine_process
from tests.support.servers import ServiceProcess, free_port
from tests.support.tool_model import CALL_ARGS, QUESTIONS, TOOLS, build_tool_model

pytestmark = pytest.mark.integration

WEATHER = "tests.support.weather_env:WeatherEnv"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = build_tool_model(tmp_path_factory.mktemp("tool-model"))
    proc, url = engine_process(model, NEXTSTATE_ENGINE__TOOL_CALL_PARSER="hermes")
    try:
        proc.wait_http(f"{url}/health", timeout=120)
        yield url
    finally:
        proc.stop()


def context(settings: Settings, bus: Bus, engine: str, version: int) -> EvalContext:
    cfg = EvalConfig(samples=3, seed=0, job_timeout_s=120)
    return EvalContext(run=settings.run, version=version, engine_url=engine, headers={}, tokenizer="",
                       base_model="", cfg=cfg, bus=bus)


def worker(env: dict[str, str], engines: list[str]) -> ServiceProcess:
    port = free_port()
    proc = ServiceProcess("envs", {
        **env, "NEXTSTATE_ENVS__URL": f"http://127.0.0.1:{free_port()}/v1",  # no collector: never called
        "NEXTSTATE_ENVS__EVAL_ENGINES": json.dumps(engines), "NEXTSTATE_ENVS__MAX_TOKENS": "64",
        "NEXTSTATE_ENVS__REQUEST_RETRIES": "0", "NEXTSTATE_ENVS__PORT": str(port)}).start()
    proc.wait_http(f"http://127.0.0.1:{port}/healthz", timeout=60)
    return proc


def test_the_engine_parses_tool_calls_when_configured(engine: str) -> None:
    client = openai.OpenAI(base_url=f"{engine}/v1", api_key="none", timeout=60)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    done = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, temperature=0,  # type: ignore[arg-type]
                                          max_tokens=64)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == CALL_ARGS  # type: ignore[union-attr]
    chunks = list(client.chat.completions.create(model="m", messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                                 temperature=0, max_tokens=64, stream=True))
    names = [tc.function.name for c in chunks for tc in (c.choices[0].delta.tool_calls or [])
             if tc.function is not None and tc.function.name]
    args = "".join(tc.function.arguments or "" for c in chunks for tc in (c.choices[0].delta.tool_calls or [])
                   if tc.function is not None)
    assert names == ["get_weather"] and json.loads(args) == CALL_ARGS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Without tools the text is the text.
    plain = client.chat.completions.create(model="m", messages=messages, temperature=0, max_tokens=64)  # type: ignore[arg-type]
    assert plain.choices[0].message.tool_calls is None


async def registered(bus: Bus) -> None:
    """/healthz can answer before the rq worker has registered on its queue: wait for that."""
    deadline = time.monotonic() + 60
    while not await bus.redis.scard(f"rq:workers:{bus.keys.envs_queue}"):
        assert time.monotonic() < deadline, "the envs worker never registered on its queue"
        await asyncio.sleep(0.1)


async def test_held_out_episodes_scored_on_the_envs_workers(
    engine: str, env: dict[str, str], settings: Settings,
) -> None:
    suite = resolve(f"env:{WEATHER}")
    async with Bus(settings) as bus:
        t0 = time.monotonic()
        with pytest.raises(SuiteError, match="no envs worker"):
            await suite(context(settings, bus, engine, 0))
        assert time.monotonic() - t0 < 5  # at once, not after the job's budget

        proc = worker(env, [engine])
        try:
            await registered(bus)
            outcome = await suite(context(settings, bus, engine, 0))
            # 3 samples of a 2-task split: the repeated task counts once.
            assert (outcome.score, outcome.n) == (1.0, 2), outcome
            assert sorted(t.task for t in outcome.tasks) == [f"{WEATHER}/heldout-weather-{i}" for i in (0, 1)]
            assert all(t.passed and t.details["cities"] == [CALL_ARGS["city"]] and t.details["steps"] == 2
                       for t in outcome.tasks)
            assert outcome.metrics["errors"] == 0 and outcome.ci is not None
            # An evaluation is not training data: no outcome, no turn, nothing for the buffer.
            assert await bus.redis.xlen(bus.keys.outcomes) == 0
            assert await bus.redis.xlen(bus.keys.turns) == 0
            # The same evaluation again (a retried evaluation job) reads the episodes already run.
            t1 = time.monotonic()
            again = await suite(context(settings, bus, engine, 0))
            assert (again.score, again.n) == (1.0, 2) and time.monotonic() - t1 < 3
        finally:
            assert proc.stop() == 0, proc.logs()

        # A worker that may not send the credential to this engine: every episode errors.
        proc = worker(env, ["http://127.0.0.1:1"])
        try:
            await registered(bus)
            with pytest.raises(SuiteError, match=r"none of 3 episodes ran.*not an evaluation engine"):
                await suite(context(settings, bus, engine, 1))
        finally:
            assert proc.stop() == 0, proc.logs()
