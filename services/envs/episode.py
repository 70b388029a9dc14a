"""One episode: the agent loop between the policy (through the collector) and an environment.

    result = await run_episode(client, env, task, sandbox, session_id, model="policy",
                               max_steps=8, max_tokens=512, temperature=1.0)

The policy is reached like any agent reaches it: the official `openai` client against the
collector, every request with `X-Session-Id: <session_id>`, so each step is captured as a
`Turn` exactly like live traffic. Per step: the model answers, offered `env.tools()`; each
tool call runs with `env.step` and goes back as a `tool` message — the next request carries
them, and so closes the turn with the tool results as its next state.

The episode ends when the model answers without a tool call (`answered`), when the
environment says `done` after a step (`done`), or after `max_steps` policy calls
(`max_steps`; the tool calls of the last one still run, so `verify` sees their effect).
Then `env.verify(messages)` gives the verdict, and one *closing request* (max_tokens 1,
`X-Session-Done: 1`) ends the session. Its messages give the last real turn its next state:

- `done`, `max_steps`: the conversation as it is, ending with the last step's tool results;
- `answered`: plus the environment's verdict as a user message (`The episode is over:
  the task's check passed.`), the final answer's next state.

So every real turn of an episode has a next state, and the one turn without one is the
closing request's own (one token, `closed_by=session_done`, the session's last turn): it
is not the policy acting in the environment, and must not train. (The collector cannot
close a pending turn otherwise: only a later main request on the same conversation, or its
TTL, does; a request sent with `X-Session-Done` is emitted at once without a next state,
and which call is the last is known only once the model answered.)
`X-Policy-Version` of every response is collected (`policy_versions`, in order, distinct).

Errors: a failed policy call (after the client's own retries, `request_retries`) raises
`PolicyUnavailable`; the job decides (services/envs/jobs.py). What the model gets wrong is
never an error: the environment answers with an error observation.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from openai import APIError, AsyncOpenAI

from services.envs.base import Environment, Message, Task, Verdict
from services.envs.sandbox import Sandbox
from shared.errors import NextstateError

log = logging.getLogger(__name__)

Ended = Literal["answered", "done", "max_steps"]
SESSION_ID = "X-Session-Id"
SESSION_DONE = "X-Session-Done"


class PolicyUnavailable(NextstateError):
    """The policy endpoint (the collector) failed a call after its retries."""


@dataclass
class EpisodeResult:
    messages: list[Message]
    verdict: Verdict
    steps: int  # policy calls, the closing request not counted
    ended: Ended
    policy_versions: list[int] = field(default_factory=list)
    wall_s: float = 0.0


def closing_text(verdict: Verdict) -> str:
    """The next state of a final answer: what the environment says of it."""
    return f"The episode is over: the task's check {'passed' if verdict.passed else 'failed'}."


def assistant_message(message: Any) -> Message:
    """The assistant message to send back, from the client's `ChatCompletionMessage`."""
    out: Message = {"role": "assistant", "content": message.content or ""}
    calls = message.tool_calls or []
    if calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in calls if getattr(c, "function", None) is not None
        ]
    return out


class Policy:
    """The collector seen from one episode: its session headers and version record."""

    def __init__(self, client: AsyncOpenAI, session_id: str, *, model: str, max_tokens: int,
                 temperature: float) -> None:
        self.client = client
        self.session_id = session_id
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.versions: list[int] = []

    async def ask(self, messages: list[Message], tools: list[Message], *, done: bool = False,
                  max_tokens: int | None = None) -> Any:
        headers = {SESSION_ID: self.session_id, **({SESSION_DONE: "1"} if done else {})}
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        try:
            raw = await self.client.chat.completions.with_raw_response.create(
                model=self.model, messages=messages,  # type: ignore[arg-type]
                max_tokens=max_tokens or self.max_tokens, temperature=self.temperature,
                extra_headers=headers, **kwargs,
            )
        except APIError as exc:
            raise PolicyUnavailable(f"the policy at {self.client.base_url} failed: {exc}") from exc
        version = raw.headers.get("x-policy-version", "")
        if version.isdigit() and int(version) not in self.versions:
            self.versions.append(int(version))
        completion = raw.parse()
        if not completion.choices:
            raise PolicyUnavailable(f"the policy at {self.client.base_url} answered without a choice")
        return completion.choices[0].message


async def run_episode(client: AsyncOpenAI, env: Environment, task: Task, sandbox: Sandbox, session_id: str, *,
                      model: str, max_steps: int, max_tokens: int, temperature: float,
                      close_session: bool = True) -> EpisodeResult:
    """Run one episode of `task` in `env` (its sandbox fresh and owned by the caller).
    `close_session=False` (an evaluation, against an engine: nothing is captured) sends no
    closing request."""
    t0 = time.monotonic()
    policy = Policy(client, session_id, model=model, max_tokens=max_tokens, temperature=temperature)
    messages: list[Message] = list(await env.reset(task, sandbox))
    tools = env.tools()
    steps = 0
    ended: Ended | None = None
    while ended is None:
        last = steps + 1 >= max_steps
        reply = await policy.ask(messages, tools)
        steps += 1
        messages.append(assistant_message(reply))
        calls = messages[-1].get("tool_calls", [])
        if not calls:
            ended = "answered"
            break
        for call in calls:
            observation = await env.step(call["function"]["name"], call["function"]["arguments"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": observation})
        if last:
            ended = "max_steps"
        elif env.done:
            ended = "done"
    verdict = await env.verify(messages)
    if close_session:
        closing = [*messages, {"role": "user", "content": closing_text(verdict)}] if ended == "answered" else messages
        await policy.ask(closing, tools, done=True, max_tokens=1)
    log.debug("episode ended", extra={"session": session_id, "task": task.id, "ended": ended, "steps": steps})
    assert ended is not None
    return EpisodeResult(messages=messages, verdict=verdict, steps=steps, ended=ended,
                         policy_versions=policy.versions, wall_s=time.monotonic() - t0)
