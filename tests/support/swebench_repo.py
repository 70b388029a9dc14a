"""A tiny SWE-bench instance built for tests, in the dataset's own format.

`build(root)` makes `root/repos/acme__calc`, a git repository whose base commit has a bug
(`add` subtracts) and a passing test, then a later commit (so HEAD is not the base), and
`root/instances.jsonl` with one instance: the issue, the base commit, a `test_patch` (made
by git: it changes checks/test_ops.py and adds checks/test_new.py) and FAIL_TO_PASS /
PASS_TO_PASS as JSON-encoded lists, Django-style and dotted unittest ids. `FIXED` is the
repair; `PYTEST_IDS` are the same tests as pytest node ids.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUGGY = "def add(a, b):\n    return a - b\n\n\ndef zero():\n    return 0\n"
FIXED = "def add(a, b):\n    return a + b\n\n\ndef zero():\n    return 0\n"
TESTS = ("import unittest\n\nfrom calc import ops\n\n\nclass OpsTest(unittest.TestCase):\n"
         "    def test_zero(self):\n        self.assertEqual(ops.zero(), 0)\n")
ADDED = "\n    def test_add(self):\n        self.assertEqual(ops.add(2, 3), 5)\n"
NEW = ("import unittest\n\nfrom calc import ops\n\n\nclass NewTest(unittest.TestCase):\n"
       "    def test_add_negative(self):\n        self.assertEqual(ops.add(-2, -3), -5)\n")
OTHER = ("import unittest\n\n\nclass OtherTest(unittest.TestCase):\n"
         "    def test_ok(self):\n        self.assertTrue(True)\n")
FAIL_TO_PASS = ["test_add (checks.test_ops.OpsTest)", "checks.test_new.NewTest.test_add_negative"]
PASS_TO_PASS = ["test_zero (checks.test_ops.OpsTest)\nOps.zero is zero.", "checks.test_other.OtherTest.test_ok"]
PYTEST_IDS = {"FAIL_TO_PASS": ["checks/test_ops.py::OpsTest::test_add", "checks/test_new.py::NewTest::test_add_negative"],
              "PASS_TO_PASS": ["checks/test_ops.py::OpsTest::test_zero", "checks/test_other.py::OtherTest::test_ok"]}


@dataclass
class Built:
    repos: Path
    repo: Path
    instances: Path
    instance: dict[str, Any]
    base: str


def git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com", "PATH": "/usr/bin:/bin", "HOME": str(repo),
           "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout


def build(root: Path, **fields: Any) -> Built:
    repos = root / "repos"
    repo = repos / "acme__calc"
    (repo / "calc").mkdir(parents=True)
    (repo / "checks").mkdir()
    (repo / "calc" / "__init__.py").write_text("")
    (repo / "calc" / "ops.py").write_text(BUGGY)
    (repo / "checks" / "__init__.py").write_text("")
    (repo / "checks" / "test_ops.py").write_text(TESTS)
    (repo / "checks" / "test_other.py").write_text(OTHER)
    (repo / "README.md").write_text("calc\n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "calc with add")
    base = git(repo, "rev-parse", "HEAD").strip()
    # The test patch, as git writes it: a changed test file and a new one.
    (repo / "checks" / "test_ops.py").write_text(TESTS + ADDED)
    (repo / "checks" / "test_new.py").write_text(NEW)
    git(repo, "add", "-A")
    test_patch = git(repo, "diff", "--cached", base)
    git(repo, "reset", "-q", "--hard", base)
    (repo / "README.md").write_text("calc, later\n")  # HEAD moves past the base commit
    git(repo, "commit", "-q", "-am", "later work")
    instance = {
        "instance_id": "acme__calc-1", "repo": "acme/calc", "base_commit": base,
        "problem_statement": "calc.ops.add(2, 3) returns -1 instead of 5.",
        "test_patch": test_patch, "patch": "(the gold patch: never shown)", "version": "0.1",
        "FAIL_TO_PASS": json.dumps(FAIL_TO_PASS), "PASS_TO_PASS": json.dumps(PASS_TO_PASS),
        "split": "train", **fields,
    }
    instances = root / "instances.jsonl"
    instances.write_text(json.dumps(instance) + "\n")
    return Built(repos, repo, instances, instance, base)
