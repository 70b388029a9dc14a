"""The `swe` environment on SWE-bench-format instances (services/envs/swebench.py): a tiny
instance built in the dataset's format (tests/support/swebench_repo.py) read from a local
path over a local clone, set up in a real sandbox at its base commit, and graded by
FAIL_TO_PASS and PASS_TO_PASS after the test_patch — by agents that fix it (reward 1) and
that do not (reward 0): one that edits the tests, one that breaks a passing test, one that
does nothing. Then the agent loop itself (services/envs/episode.py) against a scripted
policy server, and the loading errors the worker's start reports.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from services.envs import swebench, tools_config
from services.envs.__main__ import check_sources
from services.envs.episode import run_episode
from services.envs.sandbox import Sandbox, SandboxLimits
from services.envs.settings import EnvsConfig, configure
from services.envs.swe import SweEnv
from shared.errors import SettingsError
from tests.support import swebench_repo as R
from tests.support.standin_policy import StandinPolicy

LIMITS = SandboxLimits(cpu_seconds=10, wall_seconds=20, memory_bytes=512 << 20, max_processes=32)


@pytest.fixture
def built(tmp_path: Path) -> Iterator[R.Built]:
    b = R.build(tmp_path)
    configure(EnvsConfig(swe_bench_path=b.instances, swe_bench_repos=b.repos, swe_bench_test_timeout_s=30,
                         swe_bench_memory_mb=1024))
    yield b
    configure(None)
    swebench.cached_instances.cache_clear()


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    with Sandbox(limits=LIMITS) as sb:
        yield sb


async def test_instances_replace_the_shipped_tasks(built: R.Built) -> None:
    (task,) = SweEnv.tasks("train")
    assert SweEnv.tasks("heldout") == []
    assert (task.id, task.env, task.prompt) == ("acme__calc-1", "swe", built.instance["problem_statement"])
    inst = swebench.Instance.model_validate(task.data["swe_bench"])
    assert inst.FAIL_TO_PASS == R.FAIL_TO_PASS and inst.PASS_TO_PASS == R.PASS_TO_PASS  # decoded
    assert "patch" not in task.data["swe_bench"]  # the gold patch never rides along
    swebench.check([inst], built.repos)


async def test_an_agent_that_fixes_it_gets_1(built: R.Built, sandbox: Sandbox) -> None:
    (task,) = SweEnv.tasks("train")
    env = SweEnv()
    messages = await env.reset(task, sandbox)
    assert messages[1]["content"] == task.prompt
    files = (await env.step("list_files", {})).splitlines()
    assert sorted(files) == ["README.md", "calc/__init__.py", "calc/ops.py", "checks/__init__.py",
                             "checks/test_ops.py", "checks/test_other.py"]  # the base commit's tree
    assert await env.step("read_file", {"path": "README.md"}) == "calc\n"  # not HEAD's
    assert await env.step("read_file", {"path": "calc/ops.py"}) == R.BUGGY
    assert "OK" in await env.step("run_tests", {})  # the model sees only the tests it has
    before = await env.verify()
    assert not before.passed and before.details["fail_to_pass"] == {
        R.FAIL_TO_PASS[0]: "failed", R.FAIL_TO_PASS[1]: "failed"}, before.details
    assert before.details["pass_to_pass"] == {"passed": 2, "of": 2, "broken": []}
    assert (await env.step("write_file", {"path": "calc/ops.py", "content": R.FIXED})).startswith("Wrote")
    after = await env.verify()
    assert after.passed and after.reward == 1.0, after.details
    assert set(after.details["fail_to_pass"].values()) == {"passed"} and after.details["complete"]


async def test_agents_that_do_not_fix_it_get_0(built: R.Built) -> None:
    (task,) = SweEnv.tasks("train")

    async def attempt(writes: dict[str, str]) -> dict[str, Any]:
        with Sandbox(limits=LIMITS) as sb:
            env = SweEnv()
            await env.reset(task, sb)
            for path, content in writes.items():
                await env.step("write_file", {"path": path, "content": content})
            verdict = await env.verify()
            assert verdict.reward == 0.0 and not verdict.passed, verdict.details
            return verdict.details

    nothing = await attempt({})
    assert set(nothing["fail_to_pass"].values()) == {"failed"}
    # Tests edited to pass, and the new test file written ahead: restored before grading.
    fake = "import unittest\n\n\nclass OpsTest(unittest.TestCase):\n    def test_add(self):\n        pass\n"
    cheat = await attempt({"checks/test_ops.py": fake, "checks/test_new.py": fake.replace("OpsTest", "NewTest")})
    assert cheat["fail_to_pass"][R.FAIL_TO_PASS[0]] == "failed"
    # add fixed, zero broken: a PASS_TO_PASS test fails.
    broke = await attempt({"calc/ops.py": R.FIXED.replace("return 0", "return 1")})
    assert set(broke["fail_to_pass"].values()) == {"passed"}
    assert broke["pass_to_pass"]["broken"] == [R.PASS_TO_PASS[0]]
    # An early exit printing its own success line does not pass.
    quitter = await attempt({"calc/ops.py": "import os\nprint('OK')\nos._exit(0)\n"})
    assert not quitter["complete"]


@dataclass
class ScriptedPolicy(StandinPolicy):
    """Calls the tools of `script` in order (one per answer), then answers in words."""

    script: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        out = super().answer(body)
        step = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
        if step < len(self.script) and body.get("tools"):
            name, args = self.script[step]
            out["choices"][0]["message"] = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args)}}]}
            out["choices"][0]["finish_reason"] = "tool_calls"
        return out


def test_the_agent_loop_on_an_instance(built: R.Built) -> None:
    (task,) = SweEnv.tasks("train")

    async def episode(script: list[tuple[str, dict[str, Any]]]) -> Any:
        with ScriptedPolicy(latency_s=0.0, tool_turns=0, script=script) as policy:
            async with AsyncOpenAI(base_url=policy.url, api_key="k", max_retries=0, timeout=10.0) as client:
                with Sandbox(limits=LIMITS) as sb:
                    return await run_episode(client, SweEnv(), task, sb, "env:swe.a1.x", model="m",
                                             max_steps=8, max_tokens=64, temperature=1.0)

    fixer = asyncio.run(episode([("read_file", {"path": "calc/ops.py"}),
                                 ("write_file", {"path": "calc/ops.py", "content": R.FIXED}),
                                 ("run_tests", {})]))
    assert (fixer.ended, fixer.steps, fixer.verdict.reward) == ("answered", 4, 1.0), fixer.verdict
    assert fixer.messages[3]["content"] == R.BUGGY  # the tool's observation: the base commit's file
    idler = asyncio.run(episode([("run_tests", {})]))
    assert (idler.ended, idler.verdict.reward) == ("answered", 0.0)


def test_the_runner_with_pytest_ids(tmp_path: Path) -> None:
    """pytest node ids run under pytest (this interpreter has it; the sandbox's may not)."""
    b = R.build(tmp_path, FAIL_TO_PASS=json.dumps(R.PYTEST_IDS["FAIL_TO_PASS"]),
                PASS_TO_PASS=json.dumps(R.PYTEST_IDS["PASS_TO_PASS"]))
    inst = swebench.Instance.model_validate(b.instance)
    assert inst.pytest_style() and swebench.run_tests_argv(inst)[:4] == ["python3", "-B", "-m", "pytest"]
    work = tmp_path / "work"
    work.mkdir()
    subprocess.run(["tar", "-x", "-f", "-"], input=swebench.archive(b.repo, b.base), cwd=work, check=True)
    for path, text in swebench.patched_tests(b.repo, b.base, inst.test_patch).items():
        assert text is not None
        (work / path).write_text(text)

    def run() -> swebench.Grade:
        stdin = f"n0nce\n{json.dumps(inst.tests())}\n"
        out = subprocess.run([sys.executable, "-I", "-B", "-c", swebench.RUNNER], input=stdin, cwd=work,
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
        return swebench.grade(inst, out.stdout, "n0nce")

    g = run()
    assert not g.passed and g.failing == inst.FAIL_TO_PASS and g.broken == [], g
    (work / "calc" / "ops.py").write_text(R.FIXED)
    g = run()
    assert g.passed and set(g.statuses.values()) == {"passed"}, g


def test_what_is_refused(tmp_path: Path) -> None:
    b = R.build(tmp_path)
    bad = {**b.instance, "FAIL_TO_PASS": "[not json"}
    (tmp_path / "bad.jsonl").write_text(json.dumps(b.instance) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(swebench.SweBenchError, match=r"bad.jsonl:2 \(instance acme__calc-1\): FAIL_TO_PASS: "
                                                     r".*JSON-encoded list of test ids"):
        swebench.load_instances(tmp_path / "bad.jsonl")
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps([b.instance, {**b.instance, "instance_id": "acme__calc-2", "split": None}]))
    assert [i.instance_id for i in swebench.load_instances(listed)] == ["acme__calc-1", "acme__calc-2"]
    (tmp_path / "twice.json").write_text(json.dumps([b.instance, b.instance]))
    with pytest.raises(swebench.SweBenchError, match="appears twice"):
        swebench.load_instances(tmp_path / "twice.json")
    inst = swebench.Instance.model_validate(b.instance)
    with pytest.raises(swebench.SweBenchError, match=r"acme/calc: no clone at .*acme__calc"):
        swebench.check([inst], tmp_path)
    gone = inst.model_copy(update={"base_commit": "0" * 40})
    with pytest.raises(swebench.SweBenchError, match=f"base commit {'0' * 40} of acme__calc-1 is not in"):
        swebench.check([gone], b.repos)
    with pytest.raises(swebench.SweBenchError, match="SWE_BENCH_REPOS is not set"):
        swebench.check([inst], None)


def test_the_worker_refuses_to_start_on_bad_sources(tmp_path: Path) -> None:
    """`python -m services.envs` reads its SWE-bench instances and tools config before anything
    else: a missing commit or a bad tool is a clear message and exit 2 (nothing else runs)."""
    b = R.build(tmp_path)
    gone = {**b.instance, "base_commit": "f" * 40}
    (tmp_path / "gone.jsonl").write_text(json.dumps(gone) + "\n")
    (tmp_path / "tools.json").write_text(json.dumps({"tools": [{"name": "x", "answer": {"template": "{y}"}}]}))

    def worker(**settings: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "NEXTSTATE_ENV": "test", "NEXTSTATE_REDIS__URL": "redis://127.0.0.1:1/0",
               **{f"NEXTSTATE_ENVS__{k.upper()}": v for k, v in settings.items()}}
        return subprocess.run([sys.executable, "-m", "services.envs"], env=env, capture_output=True, text=True,
                              timeout=120, cwd=Path(__file__).resolve().parents[2])

    out = worker(swe_bench_path=str(tmp_path / "gone.jsonl"), swe_bench_repos=str(b.repos),
                 tools_config=str(tmp_path / "tools.json"))
    assert out.returncode == 2 and f"base commit {'f' * 40} of acme__calc-1 is not in" in out.stderr, out.stderr
    with pytest.raises(tools_config.ToolsConfigError, match=r"tools\[0\] \(x\): answer names \{y\}"):
        check_sources(EnvsConfig(tools_config=tmp_path / "tools.json"))
    with pytest.raises(SettingsError, match="SWE_BENCH_REPOS is set without"):
        check_sources(EnvsConfig(swe_bench_repos=b.repos))
