"""A user's environment, loaded as `tests.support.echo_env:EchoEnv`: the smallest thing
that satisfies `services.envs.base.Environment`. Passes when the model echoes the word."""

from __future__ import annotations

from collections.abc import Sequence

from services.envs.base import (
    Environment,
    Message,
    Split,
    Task,
    Verdict,
    function_tool,
    opening,
    pick,
)
from services.envs.sandbox import Sandbox

TASKS = [
    Task(id=f"echo-{i}", env="echo", prompt=f"Echo the word {w!r} with the echo tool.", data={"word": w},
         split="train" if i < 3 else "heldout")
    for i, w in enumerate(["ping", "pong", "kite", "lark"])
]


class EchoEnv(Environment):
    name = "echo"

    def __init__(self) -> None:
        self.word = ""
        self.heard: list[str] = []

    @classmethod
    def tasks(cls, split: Split, n: int | None = None, seed: int = 0) -> list[Task]:
        return pick([t for t in TASKS if t.split == split], n, seed)

    def tools(self) -> list[Message]:
        return [function_tool("echo", "Say a word back.", {"text": ("string", "the word")})]

    async def reset(self, task: Task, sandbox: Sandbox) -> list[Message]:
        self.word, self.heard = task.data["word"], []
        return opening("Use the tools.", task)

    async def tool_echo(self, text: str) -> str:
        self.heard.append(text)
        return text

    async def verify(self, messages: Sequence[Message] | None = None) -> Verdict:
        return Verdict.of(self.word in self.heard, heard=self.heard)


class NotAnEnvironment:
    """Has the methods, not the base class: refused."""

    def tools(self) -> list[Message]:
        return []
