"""The agent loop (services/envs/episode.py) against a stand-in policy server: how an
episode ends, how its session is closed, what it records."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from services.envs.base import Environment, load_environment, load_tasks
from services.envs.episode import EpisodeResult, PolicyUnavailable, closing_text, run_episode
from services.envs.sandbox import Sandbox, SandboxConfig
from tests.support.echo_env import EchoEnv
from tests.support.servers import free_port
from tests.support.standin_policy import StandinPolicy

ECHO = "tests.support.echo_env:EchoEnv"


@pytest.fixture
def policy() -> Iterator[StandinPolicy]:
    with StandinPolicy(latency_s=0.0, tool_turns=2) as p:
        yield p


def episode(url: str, tmp_path: Path, max_steps: int = 8, session: str = "env:test.a1.x",
            env: Environment | None = None) -> EpisodeResult:
    async def go() -> EpisodeResult:
        env_ = env or load_environment(ECHO)
        task = load_tasks(env_, "train")[0]
        async with AsyncOpenAI(base_url=url, api_key="k", max_retries=0, timeout=5.0) as client:
            with Sandbox(SandboxConfig()) as sandbox:
                return await run_episode(client, env_, task, sandbox, session, model="m", max_steps=max_steps,
                                         max_tokens=16, temperature=1.0)

    return asyncio.run(go())


def test_answered_episode_is_closed_with_the_verdict_as_next_state(policy: StandinPolicy, tmp_path: Path) -> None:
    result = episode(policy.url, tmp_path)
    assert (result.ended, result.steps, result.verdict.passed) == ("answered", 3, True)
    assert result.policy_versions == [7]
    # two tool calls, each answered by a tool message, then the final answer
    roles = [m["role"] for m in result.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert result.messages[3]["content"] == "ping"
    seen = policy.requests
    assert [s.session_id for s in seen] == ["env:test.a1.x"] * 4
    assert [s.done for s in seen] == [False, False, False, True]  # one closing request
    assert seen[-1].messages == len(result.messages) + 1  # + the verdict as a user message
    assert closing_text(result.verdict).endswith("passed.")


def test_step_budget_closes_after_the_last_tool_results(policy: StandinPolicy, tmp_path: Path) -> None:
    result = episode(policy.url, tmp_path, max_steps=2)
    assert (result.ended, result.steps) == ("max_steps", 2)
    assert [s.done for s in policy.requests] == [False, False, True]
    assert result.messages[-1]["role"] == "tool"  # its tool call still ran (verify sees it)
    assert policy.requests[-1].messages == len(result.messages)  # the tool result: the next state
    assert result.verdict.passed


class DoneAfterEcho(EchoEnv):
    async def tool_echo(self, text: str) -> str:
        self.done = True
        return await super().tool_echo(text)


def test_done_environment_closes_after_the_tool_results(policy: StandinPolicy, tmp_path: Path) -> None:
    result = episode(policy.url, tmp_path, env=DoneAfterEcho())
    assert (result.ended, result.steps, result.verdict.passed) == ("done", 1, True)
    assert [s.done for s in policy.requests] == [False, True]
    assert policy.requests[-1].messages == len(result.messages)  # ends on the tool result


def test_unreachable_policy_raises(tmp_path: Path) -> None:
    with pytest.raises(PolicyUnavailable):
        episode(f"http://127.0.0.1:{free_port()}/v1", tmp_path)
