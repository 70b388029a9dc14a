"""A repository with a bug and failing tests: the `swe` environment.

Its tasks are the shipped mini repositories (below), or, with NEXTSTATE_ENVS__SWE_BENCH_PATH
set, SWE-bench-format instances over local clones (swebench.py says how those are read,
set up and graded: FAIL_TO_PASS must pass and PASS_TO_PASS still pass once the test_patch
is applied over the model's changes). The tools and the sandbox are the same for both.

A shipped task (one file in services/envs/tasks/swe/) is an issue text, the repository's
files, and the test modules that must pass. The model reads, writes and lists files (paths
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

import asyncio
import json
import secrets
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

from services.envs import swebench
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
from services.envs.sandbox import Sandbox, SandboxError, SandboxLimits
from services.envs.settings import EnvsConfig, current

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
BENCH_SYSTEM = (
    "You are resolving an issue in the repository in your working directory, checked out at the "
    "commit the issue was filed against. Use the tools to list, read and write its files and to run "
    "its tests. Change the code so that the issue is resolved; hidden tests will check it. When you "
    "are done, say so briefly without calling a tool."
)


def bench_task(inst: swebench.Instance, heldout_share: float) -> Task:
    """A SWE-bench instance as a task: the issue is the prompt; the instance rides along
    (its gold patch is not part of it: `Instance` ignores that field)."""
    return Task(id=inst.instance_id, env="swe", prompt=inst.problem_statement,
                data={"swe_bench": inst.model_dump(mode="json", exclude={"split"})},
                split=swebench.split_of(inst, heldout_share))


def bench_limits(cfg: EnvsConfig) -> SandboxLimits:
    """What one command of a SWE-bench episode may use: a real repository's tests need more
    than the mini tasks' (the extraction of its tree writes large files)."""
    seconds = cfg.swe_bench_test_timeout_s
    return SandboxLimits(cpu_seconds=max(1, int(seconds)), memory_bytes=cfg.swe_bench_memory_mb << 20,
                         file_size_bytes=1 << 30, max_processes=256, wall_seconds=seconds, open_files=1024)


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
        self.instance: swebench.Instance | None = None  # a SWE-bench task's instance

    @classmethod
    def tasks(cls, split: Split, n: int | None = None, seed: int = 0) -> list[Task]:
        cfg = current()
        if cfg.swe_bench_path is not None:
            share = cfg.swe_bench_heldout_share
            found = [bench_task(i, share) for i in swebench.cached_instances(str(cfg.swe_bench_path))]
            return pick([t for t in found if t.split == split], n, seed)
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
        if "swe_bench" in task.data:
            self.instance = swebench.Instance.model_validate(task.data["swe_bench"])
            await self._check_out(self.instance, sandbox)
            return opening(BENCH_SYSTEM, task)
        self.instance = None
        await setup_files(sandbox, task.data["files"])
        return opening(SYSTEM, task)

    async def _check_out(self, inst: swebench.Instance, sandbox: Sandbox) -> None:
        """The repository at the instance's base commit, written into the sandbox by `tar`
        as the sandbox's uid."""
        cfg = current()
        repo = swebench.locate(cfg.swe_bench_repos, inst)
        tree = await asyncio.to_thread(swebench.archive, repo, inst.base_commit)
        result = await sandbox.arun(["tar", "-x", "--no-same-owner", "-f", "-"], stdin=tree,
                                    limits=bench_limits(cfg))
        if result.exit_code != 0:
            raise SandboxError(f"could not write {inst.repo} at {inst.base_commit} into {sandbox.path}: "
                               f"{result.observation()[-1000:]}")

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
        if self.instance is not None:
            argv, limits = swebench.run_tests_argv(self.instance), bench_limits(current())
            return (await self._sandbox().arun(argv, limits=limits)).observation()
        return (await self._sandbox().arun(["python3", "-B", "-m", "unittest"])).observation()

    async def verify(self, messages: Sequence[Message] | None = None) -> Verdict:
        if self.task is None:
            raise ValueError("verify called before reset")
        if self.instance is not None:
            return await self._verify_instance(self.instance)
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

    async def _verify_instance(self, inst: swebench.Instance) -> Verdict:
        """The test_patch's files as the patch leaves them (over what the model did to them),
        then FAIL_TO_PASS and PASS_TO_PASS: reward 1 when every one passes."""
        cfg, sandbox = current(), self._sandbox()
        repo = swebench.locate(cfg.swe_bench_repos, inst)
        after = await asyncio.to_thread(swebench.patched_tests, repo, inst.base_commit, inst.test_patch)
        restored = await write_files(sandbox, {p: text for p, text in after.items() if text is not None})
        gone = [p for p, text in after.items() if text is None]
        if restored.exit_code == 0 and gone:
            restored = await sandbox.arun(["rm", "-f", "--", *gone])
        if restored.exit_code != 0:
            return Verdict.of(False, error=f"could not apply the test patch: {restored.observation()}")
        nonce = secrets.token_hex(16)
        stdin = f"{nonce}\n{json.dumps(inst.tests())}\n"
        result = await sandbox.arun(["python3", "-I", "-B", "-c", swebench.RUNNER], stdin=stdin,
                                    limits=bench_limits(cfg))
        g = swebench.grade(inst, result.stdout, nonce)
        details: dict[str, Any] = {
            "instance_id": inst.instance_id, "complete": g.complete, "exit_code": result.exit_code,
            "fail_to_pass": {t: g.statuses.get(t, "not run") for t in inst.FAIL_TO_PASS[:50]},
            "pass_to_pass": {"passed": len(inst.PASS_TO_PASS) - len(g.broken), "of": len(inst.PASS_TO_PASS),
                             "broken": g.broken[:20]},
            "output": result.stderr[-2000:],
        }
        if result.killed_by:
            details["killed_by"] = result.killed_by
        return Verdict.of(g.passed, **details)
