"""The environment API and the three built-in environments, run for real in sandboxes.

Every shipped terminal and swe task is proven solvable (its reference solution passes
`verify`) and not solved from the start; toolcall's generated answers are recomputed from
the problem text, and a sample is solved through the `python` and `submit` tools.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

import pytest

from services.envs.base import (
    BUILTIN,
    Environment,
    EnvironmentNotFound,
    Task,
    Verdict,
    load_environment,
    load_tasks,
)
from services.envs.sandbox import Sandbox, SandboxLimits, capabilities
from services.envs.swe import SweEnv
from services.envs.terminal import TerminalEnv
from services.envs.toolcall import GENERATORS, ToolCallEnv, parse_number
from tests.support.echo_env import EchoEnv

LIMITS = SandboxLimits(cpu_seconds=5, wall_seconds=10, memory_bytes=256 << 20, max_processes=32)


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    with Sandbox(limits=LIMITS) as sb:
        yield sb


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


# --- the API: registry, tasks, tools ------------------------------------------------------


@pytest.mark.parametrize(("name", "cls"), [("toolcall", ToolCallEnv), ("terminal", TerminalEnv), ("swe", SweEnv)])
def test_builtin_environments_load_with_openai_tools(name: str, cls: type[Environment]) -> None:
    env = load_environment(name)
    assert type(env) is cls and env.name == name
    for tool in env.tools():
        assert tool["type"] == "function"
        fn = tool["function"]
        assert fn["name"] and fn["description"]
        assert fn["parameters"]["type"] == "object"
        assert set(fn["parameters"]["required"]) <= set(fn["parameters"]["properties"])
    assert set(BUILTIN) == {"toolcall", "terminal", "swe", "browser"}


async def test_user_environment_by_module_class(sandbox: Sandbox) -> None:
    env = load_environment("tests.support.echo_env:EchoEnv")
    assert isinstance(env, EchoEnv)
    task = load_tasks("tests.support.echo_env:EchoEnv", "train", n=1, seed=0)[0]
    messages = await env.reset(task, sandbox)
    assert [m["role"] for m in messages] == ["system", "user"] and messages[1]["content"] == task.prompt
    assert not (await env.verify()).passed
    assert await env.step("echo", {"text": task.data["word"]}) == task.data["word"]
    verdict = await env.verify()
    assert verdict.passed and verdict.reward == 1.0


@pytest.mark.parametrize("spec", ["nope", "tests.support.echo_env:NotAnEnvironment",
                                  "tests.support.echo_env:Missing", "no_such_module_xyz:Env", "json:"])
def test_bad_environment_specs_say_what_is_wrong(spec: str) -> None:
    with pytest.raises(EnvironmentNotFound, match="environment"):
        load_environment(spec)


@pytest.mark.parametrize("name", ["toolcall", "terminal", "swe", "tests.support.echo_env:EchoEnv"])
def test_task_loading_is_deterministic(name: str) -> None:
    for split in ("train", "heldout"):
        a, b = load_tasks(name, split, n=3, seed=11), load_tasks(name, split, n=3, seed=11)
        assert a == b and a and all(t.split == split for t in a)
    train, heldout = load_tasks(name, "train"), load_tasks(name, "heldout")
    assert not {t.id for t in train} & {t.id for t in heldout}
    assert len({t.id for t in train}) == len(train)
    assert all(t.env == load_environment(name).name for t in train + heldout)
    if name != "toolcall":  # a fixed set: the seed picks among its tasks (toolcall's makes new ones)
        assert {t.id for t in load_tasks(name, "train", n=2, seed=5)} <= {t.id for t in train}
    assert load_tasks(load_environment(name), "train", n=2, seed=5) == load_tasks(name, "train", n=2, seed=5)


def test_toolcall_tasks_depend_on_seed_and_split_only() -> None:
    first = ToolCallEnv.tasks("train", n=40, seed=3)
    assert ToolCallEnv.tasks("train", n=10, seed=3) == first[:10]
    assert [t.prompt for t in ToolCallEnv.tasks("train", n=40, seed=4)] != [t.prompt for t in first]
    train = {t.prompt for t in ToolCallEnv.tasks("train", n=200)}
    heldout = {t.prompt for t in ToolCallEnv.tasks("heldout", n=200)}
    assert len(train & heldout) <= 4  # different seeds; a small template may repeat by chance
    assert {t.data["kind"] for t in ToolCallEnv.tasks("train", n=200)} == set(GENERATORS)


def test_shipped_task_counts() -> None:
    assert (len(TerminalEnv.tasks("train")), len(TerminalEnv.tasks("heldout"))) == (13, 5)
    assert (len(SweEnv.tasks("train")), len(SweEnv.tasks("heldout"))) == (8, 4)


def test_verdict_reward_is_bounded() -> None:
    with pytest.raises(ValueError):
        Verdict(reward=1.5, passed=True)


@pytest.mark.parametrize(("arguments", "expected"), [
    ({}, "missing required argument(s): command"),
    ({"command": 5}, "argument 'command' must be a string, not int"),
    ({"command": "ls", "cwd": "/"}, "unknown argument(s): cwd"),
    ("{not json", "arguments are not valid JSON"),
    ([1, 2], "arguments must be a JSON object"),
])
async def test_bad_arguments_are_error_observations(sandbox: Sandbox, arguments: Any, expected: str) -> None:
    env = TerminalEnv()
    await env.reset(TerminalEnv.tasks("train")[0], sandbox)
    observation = await env.step("shell", arguments)
    assert observation.startswith("Error: shell: ") and expected in observation


async def test_unknown_tool_and_json_string_arguments(sandbox: Sandbox) -> None:
    env = TerminalEnv()
    await env.reset(TerminalEnv.tasks("train")[0], sandbox)
    assert (await env.step("rm_rf", {"path": "/"})).startswith("Error: there is no tool 'rm_rf'; the tools are: shell")
    assert await env.step("shell", '{"command": "echo hi; exit 3"}') == "hi\n[exit code 3]"


# --- toolcall -------------------------------------------------------------------------------

_NUM = re.compile(r"-?\d+(?:\.\d+)?")
REFERENCE: dict[str, Callable[[list[str]], str]] = {  # the answer as Python, from the problem's numbers
    "sum": lambda n: f"{n[0]} + {n[1]} + {n[2]}",
    "product": lambda n: f"{n[0]} * {n[1]} * {n[2]}",
    "discount": lambda n: f"{n[0]} * (100 - {n[1]}) / 100",
    "percent_of": lambda n: f"{n[0]} * {n[1]} / 100",
    "miles": lambda n: f"{n[0]} * {n[2]}",
    "minutes": lambda n: f"(60 * {n[0]} + {n[1]}) * {n[2]}",
    "distance": lambda n: f"{n[0]} * {n[1]} + {n[2]} * {n[3]} / 60",
    "average": lambda n: f"sum([{', '.join(n[1:])}]) / {n[0]}",
    "remainder": lambda n: f"{n[0]} % {n[1]}",
    "shopping": lambda n: f"{n[0]} - {n[1]} * {n[2]} + {n[3]}",
    "interest": lambda n: f"{n[0]} * (1 + {n[1]} * {n[2]} / 100)",
}


def reference(task: Task) -> str:
    return REFERENCE[task.data["kind"]](_NUM.findall(task.prompt))


def test_toolcall_answers_match_the_problem_text() -> None:
    for task in ToolCallEnv.tasks("train", n=200) + ToolCallEnv.tasks("heldout", n=100, seed=5):
        assert eval(reference(task)) == pytest.approx(float(task.data["answer"]), rel=1e-9), task


async def test_toolcall_solved_through_python_and_submit() -> None:
    sample = {t.data["kind"]: t for t in reversed(ToolCallEnv.tasks("heldout", n=200, seed=1))}
    assert len(sample) == len(GENERATORS)
    for task in sample.values():
        with Sandbox(limits=LIMITS) as sb:
            env = ToolCallEnv()
            await env.reset(task, sb)
            printed = await env.step("python", {"code": f"print(round({reference(task)}, 6))"})
            assert not env.done
            assert (await env.step("submit", {"answer": printed.strip()})).startswith("Submitted")
            assert env.done
            verdict = await env.verify()
            assert verdict.passed and verdict.reward == 1.0, (task, printed, verdict)
            assert verdict.details["source"] == "submit"


async def test_toolcall_wrong_missing_and_message_answers(sandbox: Sandbox) -> None:
    task = ToolCallEnv.tasks("train", n=1, seed=9)[0]
    answer = Fraction(task.data["answer"])
    env = ToolCallEnv()
    await env.reset(task, sandbox)
    assert not (await env.verify()).passed  # nothing said, nothing submitted
    text = f"So the total is {float(answer + 1)}. Final: \\boxed{{{task.data['answer']}}}"
    verdict = await env.verify([assistant("thinking"), {"role": "tool", "content": "1"}, assistant(text)])
    assert verdict.passed and verdict.details["source"] == "message"
    assert not (await env.verify([assistant(f"The answer is {float(answer) + 0.5}.")])).passed
    await env.step("submit", {"answer": float(answer) * 2 + 1})  # a number is accepted too
    assert not (await env.verify([assistant(text)])).passed  # the submission counts, not the message
    assert "already submitted" in await env.step("submit", {"answer": task.data["answer"]})
    assert not (await env.verify()).passed


async def test_toolcall_python_errors_are_observations(sandbox: Sandbox) -> None:
    env = ToolCallEnv()
    await env.reset(ToolCallEnv.tasks("train", n=1)[0], sandbox)
    observation = await env.step("python", {"code": "1 / 0"})
    assert "ZeroDivisionError" in observation and "[exit code 1]" in observation
    assert (await env.step("python", {"code": 42})).startswith("Error: python: argument 'code' must be a string")


@pytest.mark.parametrize(("text", "number"), [
    ("\\boxed{1,234.5}", Fraction("1234.5")), ("Answer: -3 apples", Fraction(-3)),
    ("12 apples, then 15 more, so 27", Fraction(27)), ("**Answer:** $84.15", Fraction("84.15")),
    ("no idea", None), ("", None),
])
def test_parse_number(text: str, number: Fraction | None) -> None:
    assert parse_number(text) == number


# --- terminal ------------------------------------------------------------------------------

TERMINAL_TASKS = TerminalEnv.tasks("train") + TerminalEnv.tasks("heldout")


async def test_every_terminal_task_fails_untouched_and_passes_with_its_solution() -> None:
    for task in TERMINAL_TASKS:
        with Sandbox(limits=LIMITS) as sb:
            env = TerminalEnv()
            messages = await env.reset(task, sb)
            assert messages[1]["content"] == task.prompt
            assert not (await env.verify()).passed, task.id
            observation = await env.step("shell", {"command": task.data["solution"]})
            verdict = await env.verify()
            assert verdict.passed and verdict.reward == 1.0, (task.id, observation, verdict.details)


async def test_terminal_wrong_work_does_not_pass(sandbox: Sandbox) -> None:
    task = next(t for t in TERMINAL_TASKS if t.id == "terminal-count-errors")
    env = TerminalEnv()
    await env.reset(task, sandbox)
    assert "ERROR" in await env.step("shell", {"command": "grep ERROR app.log | head -n 1"})
    await env.step("shell", {"command": "grep -c INFO app.log > count.txt"})
    verdict = await env.verify()
    assert not verdict.passed and verdict.reward == 0.0 and verdict.details["exit_code"] != 0


# --- swe -----------------------------------------------------------------------------------

SWE_TASKS = SweEnv.tasks("train") + SweEnv.tasks("heldout")


async def test_every_swe_task_fails_before_its_fix_and_passes_after() -> None:
    for task in SWE_TASKS:
        with Sandbox(limits=LIMITS) as sb:
            env = SweEnv()
            await env.reset(task, sb)
            before = await env.verify()
            assert not before.passed and before.details["tests_run"] is None, task.id
            for path, content in task.data["solution"].items():
                assert (await env.step("write_file", {"path": path, "content": content})).startswith("Wrote")
            after = await env.verify()
            assert after.passed and after.details["tests_run"] >= 2, (task.id, after.details)


async def test_swe_tools(sandbox: Sandbox) -> None:
    task = next(t for t in SWE_TASKS if t.id == "swe-inclusive-range")
    env = SweEnv()
    await env.reset(task, sandbox)
    assert (await env.step("list_files", {})).splitlines() == sorted(task.data["files"])
    assert await env.step("list_files", "") == await env.step("list_files", None)  # no arguments at all
    assert await env.step("read_file", {"path": "mathx/ranges.py"}) == task.data["files"]["mathx/ranges.py"]
    assert await env.step("read_file", {"path": "mathx/__init__.py"}) == "(empty file)"
    assert "FAILED" in await env.step("run_tests", {})
    await env.step("write_file", {"path": "notes/plan.txt", "content": "fix the range"})
    assert "notes/plan.txt" in await env.step("list_files", {})
    assert "Is a directory" in await env.step("write_file", {"path": "mathx", "content": "x"})
    assert "Not a directory" in await env.step("write_file", {"path": "README.md/x.py", "content": "x"})
    assert (await env.step("read_file", {"path": "README.md"})).startswith("# mathx")
    for path in ("/etc/passwd", "../../etc/passwd", "mathx/../../x", " ", ".", "./"):
        assert (await env.step("read_file", {"path": path})).startswith("Error: read_file: "), path
        assert (await env.step("write_file", {"path": path, "content": "x"})).startswith("Error: write_file: ")
    assert "No such file" in await env.step("read_file", {"path": "missing.py"})
    assert (await env.step("write_file", {"path": "a.py"})).startswith("Error: write_file: missing required")


async def test_swe_grading_ignores_edited_tests_and_early_exits(sandbox: Sandbox) -> None:
    task = next(t for t in SWE_TASKS if t.id == "swe-parity")
    env = SweEnv()
    await env.reset(task, sandbox)
    trivial = "import unittest\n\nclass T(unittest.TestCase):\n    def test_ok(self):\n        pass\n"
    await env.step("write_file", {"path": "tests/test_parity.py", "content": trivial})
    assert "OK" in await env.step("run_tests", {})  # the model fooled its own run …
    assert not (await env.verify()).passed  # … not the grader's
    await env.step("write_file", {"path": "numtools/parity.py",
                                  "content": "import os, sys\nprint('OK 5')\nsys.stdout.flush()\nos._exit(0)\n"})
    verdict = await env.verify()
    assert not verdict.passed and verdict.details["exit_code"] == 0


@pytest.mark.skipif(not capabilities()["uid_dropped"], reason="file access is confined by the sandbox's own uid")
async def test_swe_files_are_read_as_the_sandbox_uid(sandbox: Sandbox) -> None:
    task = next(t for t in SWE_TASKS if t.id == "swe-celsius")
    env = SweEnv()
    await env.reset(task, sandbox)
    plant = "import os\nos.symlink('/etc/shadow', 'leak')\nos.symlink('/root', 'home')\n"
    await env.step("write_file", {"path": "units/temperature.py", "content": plant})
    await env.step("run_tests", {})
    assert "Permission denied" in await env.step("read_file", {"path": "leak"})
    assert (await env.step("write_file", {"path": "home/evil.txt", "content": "x"})).startswith("Wrote")
    assert (sandbox.path / "home").is_dir() and not (sandbox.path / "home").is_symlink()
