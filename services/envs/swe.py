"""A small repository with a bug and a failing test: the `swe` environment.

A task (one file in services/envs/tasks/swe/) is an issue text, the repository's files,
and the test modules that must pass. The model reads, writes and lists files (paths
relative to the repository, never absolute or with `..`) and runs the tests; everything,
file access included, runs in the sandbox as its uid, so a symlink the model's code
planted cannot lead the worker out. Tests are plain `unittest`: the sandbox sees only
the system's python3 and its standard library.

`verify` first puts the task's own test files back (what the model did to them does not
count), then runs the required modules in an isolated interpreter that prints a nonce it
read from stdin only when every test ran and passed, so a program that exits 0 early, or
prints a success line of its own, does not pass. Reward 1 on a pass, else 0. Each task's
`solution` holds the fixed files the tests use to prove it solvable.
"""

from __future__ import annotations

import json
import secrets
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
    error,
    function_tool,
    opening,
    pick,
    relative_path,
    setup_files,
    write_files,
)
from services.envs.sandbox import Sandbox, SandboxError

SYSTEM = (
    "You are fixing a bug in a small Python repository, which is your working directory. "
    "Use the tools to list, read and write its files and to run its tests (python3 -m unittest; "
    "standard library only). Fix the code, not the tests: test files are restored before "
    "grading. When the tests pass, say so briefly without calling a tool."
)

# Runs the required test modules; prints the nonce (read from stdin before any test code
# is imported) only when every test ran and passed. Compiled files are removed first (run
# with -B, it writes none): a .pyc whose source changed within the same second would
# otherwise stand in for the new source.
RUNNER = r"""
import os, shutil, sys, unittest
nonce = sys.stdin.readline().strip()
for top, dirs, _ in os.walk("."):
    for d in [d for d in dirs if d == "__pycache__"]:
        shutil.rmtree(os.path.join(top, d), ignore_errors=True)
        dirs.remove(d)
sys.path.insert(0, ".")
suite = unittest.defaultTestLoader.loadTestsFromNames(sys.argv[1:])
result = unittest.TextTestRunner(stream=sys.stderr, verbosity=1).run(suite)
if result.wasSuccessful() and result.testsRun > 0:
    sys.stdout.write(f"{nonce} {result.testsRun}\n")
"""
LIST = ["find", ".", "-path", "./.tmp", "-prune", "-o", "-type", "f", "-print"]


@cache
def _all_tasks() -> tuple[Task, ...]:
    folder = resources.files("services.envs").joinpath("tasks/swe")
    out = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".json"):
            continue
        t = json.loads(entry.read_text("utf-8"))
        data = {"files": t["files"], "tests": t["tests"], "solution": t["solution"]}
        out.append(Task(id=t["id"], env="swe", prompt=t["prompt"], data=data, split=t["split"]))
    return tuple(out)


def test_files(task: Task) -> dict[str, str]:
    """The task's files that hold its tests: restored before verify runs them."""
    return {p: text for p, text in task.data["files"].items() if p.startswith("tests/")}


class SweEnv(Environment):
    name = "swe"

    def __init__(self) -> None:
        self.task: Task | None = None
        self.sandbox: Sandbox | None = None

    @classmethod
    def tasks(cls, split: Split, n: int | None = None, seed: int = 0) -> list[Task]:
        return pick([t for t in _all_tasks() if t.split == split], n, seed)

    def tools(self) -> list[Message]:
        return [
            function_tool("list_files", "List the repository's files.", {}),
            function_tool("read_file", "Read a file of the repository.",
                          {"path": ("string", "path relative to the repository root")}),
            function_tool("write_file", "Create or overwrite a file of the repository with `content`.",
                          {"path": ("string", "path relative to the repository root"),
                           "content": ("string", "the whole new content of the file")}),
            function_tool("run_tests", "Run the repository's tests (python3 -m unittest); returns "
                          "their output.", {}),
        ]

    async def reset(self, task: Task, sandbox: Sandbox) -> list[Message]:
        if task.env != self.name:
            raise ValueError(f"task {task.id} is for {task.env!r}, not {self.name!r}")
        self.task, self.sandbox, self.done = task, sandbox, False
        await setup_files(sandbox, task.data["files"])
        return opening(SYSTEM, task)

    def _sandbox(self) -> Sandbox:
        if self.sandbox is None:
            raise SandboxError("the swe environment was used before reset")
        return self.sandbox

    async def tool_list_files(self) -> str:
        result = await self._sandbox().arun(LIST)
        if result.exit_code != 0:
            return error(f"list_files: {result.observation()}")
        paths = sorted(line.removeprefix("./") for line in result.stdout.splitlines() if line)
        return "\n".join(paths) or "(no files)"

    async def tool_read_file(self, path: str) -> str:
        path = relative_path(path)
        result = await self._sandbox().arun(["cat", "--", path])
        if result.exit_code != 0:
            return error(f"read_file: {result.stderr.strip() or result.observation()}")
        return result.stdout or "(empty file)"

    async def tool_write_file(self, path: str, content: str) -> str:
        path = relative_path(path)
        result = await write_files(self._sandbox(), {path: content})
        if result.exit_code != 0:
            return error(f"write_file: could not write {path}: {result.observation()}")
        return f"Wrote {len(content)} characters to {path}."

    async def tool_run_tests(self) -> str:
        return (await self._sandbox().arun(["python3", "-B", "-m", "unittest"])).observation()

    async def verify(self, messages: Sequence[Message] | None = None) -> Verdict:
        if self.task is None:
            raise ValueError("verify called before reset")
        sandbox = self._sandbox()
        restored = await write_files(sandbox, test_files(self.task))
        if restored.exit_code != 0:
            return Verdict.of(False, error=f"could not restore the tests: {restored.observation()}")
        nonce = secrets.token_hex(16)
        tests: list[str] = self.task.data["tests"]
        result = await sandbox.arun(["python3", "-I", "-B", "-c", RUNNER, *tests], stdin=nonce + "\n")
        ran = [line.split(" ")[1] for line in result.stdout.splitlines() if line.startswith(nonce + " ")]
        passed = result.exit_code == 0 and bool(ran)
        details: dict[str, Any] = {"tests": tests, "exit_code": result.exit_code,
                                   "tests_run": int(ran[-1]) if ran else None,
                                   "output": result.stderr[-2000:]}
        return Verdict.of(passed, **details)
