"""Shell tasks in the episode's sandbox directory: the `terminal` environment.

A task (services/envs/tasks/terminal.json) is a prompt, the files the sandbox starts with,
and a check script (bash or python) that `verify` runs in the sandbox once the model is
done: reward 1 when it exits 0, else 0. The model has one tool, `shell`, which runs a
command with `bash -c` in that directory. The check never appears in the conversation;
each task's `solution` is a reference command the tests use to prove the task solvable.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

from services.envs.base import (
    Environment,
    Message,
    Split,
    Task,
    Verdict,
    function_tool,
    opening,
    pick,
    setup_files,
)
from services.envs.sandbox import Sandbox, SandboxError

SYSTEM = (
    "You are working in a Linux shell. Your working directory holds the files of the task. "
    "Run commands with the `shell` tool (bash; each call starts in that directory, and nothing "
    "but files carries over between calls). There is no network. When the task is done, say so "
    "briefly without calling a tool."
)

CHECKERS = {"bash": ["bash", "-c"], "python": ["python3", "-I", "-c"]}


@cache
def _all_tasks() -> tuple[Task, ...]:
    raw = json.loads(resources.files("services.envs").joinpath("tasks/terminal.json").read_text("utf-8"))
    out = []
    for t in raw["tasks"]:
        if t["check"]["lang"] not in CHECKERS:
            raise ValueError(f"terminal task {t['id']}: check language must be one of {sorted(CHECKERS)}")
        data = {"files": t["files"], "check": t["check"], "solution": t["solution"]}
        out.append(Task(id=t["id"], env="terminal", prompt=t["prompt"], data=data, split=t["split"]))
    return tuple(out)


class TerminalEnv(Environment):
    name = "terminal"

    def __init__(self) -> None:
        self.task: Task | None = None
        self.sandbox: Sandbox | None = None

    @classmethod
    def tasks(cls, split: Split, n: int | None = None, seed: int = 0) -> list[Task]:
        return pick([t for t in _all_tasks() if t.split == split], n, seed)

    def tools(self) -> list[Message]:
        return [function_tool("shell", "Run a bash command in the working directory; returns its "
                              "output (stdout, then stderr) and exit code.",
                              {"command": ("string", "the command line, run with bash -c")})]

    async def reset(self, task: Task, sandbox: Sandbox) -> list[Message]:
        if task.env != self.name:
            raise ValueError(f"task {task.id} is for {task.env!r}, not {self.name!r}")
        self.task, self.sandbox, self.done = task, sandbox, False
        await setup_files(sandbox, task.data["files"])
        return opening(SYSTEM, task)

    def _sandbox(self) -> Sandbox:
        if self.sandbox is None:
            raise SandboxError("the terminal environment was used before reset")
        return self.sandbox

    async def tool_shell(self, command: str) -> str:
        return (await self._sandbox().arun(["bash", "-c", command])).observation()

    async def verify(self, messages: Sequence[Message] | None = None) -> Verdict:
        if self.task is None:
            raise ValueError("verify called before reset")
        check = self.task.data["check"]
        result = await self._sandbox().arun([*CHECKERS[check["lang"]], check["script"]])
        details: dict[str, Any] = {"exit_code": result.exit_code, "check_output": result.observation()[-2000:]}
        return Verdict.of(result.exit_code == 0, **details)
