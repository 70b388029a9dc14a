"""SWE-bench-format instances for the `swe` environment, from local files only.

An instance is one object of a SWE-bench JSON list or JSONL file, with the dataset's fields:

    {"instance_id": "owner__name-123", "repo": "owner/name", "base_commit": "<sha>",
     "problem_statement": "...", "test_patch": "diff --git a/tests/...",
     "FAIL_TO_PASS": "[\\"test_x.py::test_new\\"]", "PASS_TO_PASS": "[...]"}

FAIL_TO_PASS and PASS_TO_PASS are JSON-encoded lists of test ids, as SWE-bench stores them
(a plain list is taken too). Other fields (`patch`, `hints_text`, `version`, ...) are
ignored: the gold patch never reaches the model. `split` (train | heldout), when present,
places the instance; otherwise a hash of its id does (`swe_bench_heldout_share`).

The repositories are local: `swe_bench_repos` holds one git clone per `repo`, named
`owner__name` (SWE-bench's spelling) or `owner/name`, holding every base commit. Nothing is
fetched; `check` (the worker's start) names any repository or commit that is missing.

What an episode does with an instance (services/envs/swe.py):
- `archive`: the repository at `base_commit` as a tar (`git archive`, on the worker: the
  clone is only read), which the sandbox extracts as its own uid;
- `patched_tests`: the content of every file the `test_patch` touches once it is applied to
  `base_commit` (None: the patch deletes it), computed in a scratch folder. Grading writes
  these over whatever the model left, so editing the tests does not count;
- `RUNNER`: runs FAIL_TO_PASS + PASS_TO_PASS in the sandbox and prints, after a nonce read
  from stdin before any test code loads, one status letter per id (`grade` reads it): a
  test passes when it passed or failed as expected, as SWE-bench counts.

Test ids: a pytest node id (`path/test_x.py::Class::test[param]`) runs under pytest, which
the sandbox's python3 must have; any other id is unittest's, loaded from the repository
root: dotted (`pkg.tests.test_x.Class.test_method`) or Django's `test_method
(pkg.tests.test_x.Class)` (its first line: SWE-bench's Django ids may carry a docstring).
The sandbox's python3 also needs whatever the repository's tests import: for real SWE-bench
repositories, a Docker sandbox image holding the repository's environment.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shared.errors import NextstateError

GIT_TIMEOUT_S = 300.0
PASSING = frozenset("px")  # passed, expected failure (xfail)
STATUS = {"p": "passed", "x": "xfail", "f": "failed", "e": "error", "s": "skipped", "m": "not run"}


class SweBenchError(NextstateError):
    """The SWE-bench instances or their repositories are not usable: the message names the
    file, instance or repository, and what to fix."""


class Instance(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    instance_id: str = Field(min_length=1, max_length=256)
    repo: str = Field(pattern=r"^[\w.-]+/[\w.-]+$")
    base_commit: str = Field(pattern=r"^[0-9a-fA-F]{7,64}$")
    problem_statement: str = Field(min_length=1)
    test_patch: str = Field(min_length=1)
    FAIL_TO_PASS: list[str] = Field(min_length=1)
    PASS_TO_PASS: list[str] = Field(default_factory=list)
    split: Literal["train", "heldout"] | None = None

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _json_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                return json.loads(v)
            except ValueError:
                raise ValueError("must be a JSON-encoded list of test ids, as SWE-bench stores it "
                                 '(e.g. "[\\"test_x.py::test_y\\"]")') from None
        return v

    def tests(self) -> list[str]:
        """FAIL_TO_PASS then PASS_TO_PASS, each id once."""
        return list(dict.fromkeys([*self.FAIL_TO_PASS, *self.PASS_TO_PASS]))

    def pytest_style(self) -> bool:
        return any("::" in t for t in self.tests())


# -- loading ---------------------------------------------------------------------------------
def _files(path: Path) -> list[Path]:
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl") and p.is_file())
        if not found:
            raise SweBenchError(f"{path} holds no .json or .jsonl file of SWE-bench instances")
        return found
    if not path.is_file():
        raise SweBenchError(f"{path} does not exist (a SWE-bench .json list, .jsonl file or a folder of them)")
    return [path]


def _objects(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, object) of every instance in one file."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SweBenchError(f"cannot read {path}: {exc}") from None
    if path.suffix == ".jsonl":
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    yield f"{path}:{number}", json.loads(line)
                except ValueError as exc:
                    raise SweBenchError(f"{path}:{number} is not JSON: {exc}") from None
        return
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise SweBenchError(f"{path} is not JSON: {exc}") from None
    items = data if isinstance(data, list) else [data]
    for i, obj in enumerate(items):
        yield f"{path} [{i}]", obj


def load_instances(path: Path) -> list[Instance]:
    """Every instance under `path`, validated; a bad one raises naming its file and field."""
    out: dict[str, Instance] = {}
    for file in _files(path):
        for where, obj in _objects(file):
            try:
                inst = Instance.model_validate(obj)
            except ValidationError as exc:
                name = obj.get("instance_id", "?") if isinstance(obj, dict) else "?"
                problems = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'instance'}: {e['msg']}"
                                     for e in exc.errors())
                raise SweBenchError(f"{where} (instance {name}): {problems}") from None
            if inst.instance_id in out:
                raise SweBenchError(f"{where}: instance id {inst.instance_id} appears twice")
            out[inst.instance_id] = inst
    if not out:
        raise SweBenchError(f"{path} holds no SWE-bench instance")
    return list(out.values())


def split_of(inst: Instance, heldout_share: float) -> Literal["train", "heldout"]:
    if inst.split is not None:
        return inst.split
    h = int(hashlib.sha256(inst.instance_id.encode()).hexdigest()[:8], 16) / 0x1_0000_0000
    return "heldout" if h < heldout_share else "train"


@cache
def cached_instances(path: str) -> tuple[Instance, ...]:
    return tuple(load_instances(Path(path)))


# -- the repositories -------------------------------------------------------------------------
def repo_dir(repos: Path, repo: str) -> Path | None:
    owner, name = repo.split("/", 1)
    for candidate in (repos / f"{owner}__{name}", repos / owner / name):
        if (candidate / ".git").exists() or (candidate / "HEAD").is_file():
            return candidate
    return None


def _git(repo: Path, *args: str, stdin: bytes | None = None, cwd: Path | None = None) -> bytes:
    """git in `repo` (or, with `cwd`, outside any repository), reading only."""
    argv = ["git", "-c", f"safe.directory={repo}", "-C", str(repo), *args] if cwd is None else ["git", *args]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_TERMINAL_PROMPT": "0",
           "GIT_CONFIG_NOSYSTEM": "1", "HOME": tempfile.gettempdir(), "LANG": "C.UTF-8"}
    if cwd is not None:
        env["GIT_CEILING_DIRECTORIES"] = str(cwd.parent)
    try:
        proc = subprocess.run(argv, input=stdin, capture_output=True, timeout=GIT_TIMEOUT_S, cwd=cwd, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SweBenchError(f"git {args[0]} failed to run: {exc}") from None
    if proc.returncode != 0:
        where = f"in {repo}" if cwd is None else "on the test_patch"
        raise SweBenchError(f"git {args[0]} {where} failed: {proc.stderr.decode(errors='replace').strip()[:500]}")
    return proc.stdout


def check(instances: Sequence[Instance], repos: Path | None) -> None:
    """Every instance's repository is under `repos` and holds its base commit; else one
    SweBenchError naming what is missing (at most ten of them) and what to do."""
    if repos is None:
        raise SweBenchError("NEXTSTATE_ENVS__SWE_BENCH_REPOS is not set: give the folder holding one git "
                            "clone per instance repository (owner__name); nothing is downloaded")
    if not repos.is_dir():
        raise SweBenchError(f"NEXTSTATE_ENVS__SWE_BENCH_REPOS={repos} is not a folder")
    problems: list[str] = []
    by_repo: dict[str, list[Instance]] = {}
    for inst in instances:
        by_repo.setdefault(inst.repo, []).append(inst)
    for repo, members in sorted(by_repo.items()):
        path = repo_dir(repos, repo)
        if path is None:
            problems.append(f"{repo}: no clone at {repos / repo.replace('/', '__')} (needed by "
                            f"{members[0].instance_id}{' and others' if len(members) > 1 else ''})")
            continue
        asked = "".join(f"{m.base_commit}^{{commit}}\n" for m in members).encode()
        answers = _git(path, "cat-file", "--batch-check", stdin=asked).decode().splitlines()
        problems += [f"{repo}: base commit {m.base_commit} of {m.instance_id} is not in {path} (fetch it there)"
                     for m, a in zip(members, answers, strict=False) if a.endswith("missing")]
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise SweBenchError("SWE-bench instances the local repositories cannot serve: "
                            + "; ".join(problems[:10]) + more)


def locate(repos: Path | None, inst: Instance) -> Path:
    path = repo_dir(repos, inst.repo) if repos is not None else None
    if path is None:
        raise SweBenchError(f"instance {inst.instance_id}: repository {inst.repo} is not under "
                            f"NEXTSTATE_ENVS__SWE_BENCH_REPOS ({repos}); clone it there as "
                            f"{inst.repo.replace('/', '__')}")
    return path


def archive(repo: Path, commit: str) -> bytes:
    """The tree of `commit` as a tar."""
    return _git(repo, "archive", "--format=tar", commit)


def touched(test_patch: str, scratch: Path) -> list[str]:
    """The paths a patch creates, changes, deletes or renames (both names), as git reads it."""
    (scratch / "test.patch").write_text(test_patch, encoding="utf-8")
    out = _git(scratch, "apply", "--numstat", "-z", "test.patch", cwd=scratch).split(b"\0")
    paths: list[str] = []
    tokens = iter(out)
    for token in tokens:
        if not token:
            continue
        parts = token.decode().split("\t", 2)
        if len(parts) == 3 and parts[2]:
            paths.append(parts[2])
        elif len(parts) == 3:  # a rename: the old and the new name follow
            paths += [next(tokens).decode(), next(tokens).decode()]
    return list(dict.fromkeys(paths))


@cache
def patched_tests(repo: Path, commit: str, test_patch: str) -> dict[str, str | None]:
    """Path -> content after `test_patch` on `commit` (None: the patch deletes it)."""
    with tempfile.TemporaryDirectory(prefix="ns-swebench-") as tmp:
        scratch = Path(tmp)
        paths = touched(test_patch, scratch)
        tree = scratch / "tree"
        tree.mkdir()
        listed = _git(repo, "ls-tree", "-r", "--name-only", "-z", commit, "--", *paths) if paths else b""
        existing = [p.decode() for p in listed.split(b"\0") if p]
        if existing:
            tar = _git(repo, "archive", "--format=tar", commit, "--", *existing)
            with tarfile.open(fileobj=io.BytesIO(tar)) as t:
                t.extractall(tree, filter="data")
        _git(tree, "apply", "--whitespace=nowarn", str(scratch / "test.patch"), cwd=tree)
        out: dict[str, str | None] = {}
        for p in paths:
            f = tree / p
            try:
                out[p] = f.read_text(encoding="utf-8") if f.is_file() else None
            except UnicodeDecodeError:
                raise SweBenchError(f"the test_patch touches {p}, which is not UTF-8 text: binary test "
                                    "files are not supported") from None
        return out


# -- running the tests -------------------------------------------------------------------------
# In the sandbox, as its uid: `python3 -I -B -c RUNNER`, stdin: the nonce, then the ids as a
# JSON list. Every test's output goes to stderr; stdout gets one line, after the last test:
# the nonce and one letter per id (p passed, x xfail, f failed, e error, s skipped, m not run).
RUNNER = r"""
import json, os, re, shutil, sys
nonce = sys.stdin.readline().strip()
ids = json.loads(sys.stdin.readline())
result = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
for top, dirs, _ in os.walk("."):
    for d in [d for d in dirs if d == "__pycache__"]:
        shutil.rmtree(os.path.join(top, d), ignore_errors=True)
        dirs.remove(d)
sys.path.insert(0, os.getcwd())
status = {}
unit = {}
for i in ids:
    if "::" not in i:
        first = i.splitlines()[0].strip() if i.strip() else i
        m = re.fullmatch(r"([\w]+) \(([\w.]+)\)", first)
        unit[i] = m.group(2) + "." + m.group(1) if m else first
if unit:
    import unittest
    seen = {}
    class Recorder(unittest.TextTestResult):
        def addSuccess(self, t): super().addSuccess(t); seen.setdefault(t.id(), "p")
        def addFailure(self, t, e): super().addFailure(t, e); seen[t.id()] = "f"
        def addError(self, t, e): super().addError(t, e); seen[t.id()] = "e"
        def addSkip(self, t, r): super().addSkip(t, r); seen.setdefault(t.id(), "s")
        def addExpectedFailure(self, t, e): super().addExpectedFailure(t, e); seen.setdefault(t.id(), "x")
        def addUnexpectedSuccess(self, t): super().addUnexpectedSuccess(t); seen[t.id()] = "f"
        def addSubTest(self, t, s, e):
            super().addSubTest(t, s, e)
            if e is not None: seen[t.id()] = "f"
    suite = unittest.TestSuite()
    for name in dict.fromkeys(unit.values()):
        try:
            suite.addTest(unittest.defaultTestLoader.loadTestsFromName(name))
        except Exception as exc:
            print(f"cannot load {name}: {exc!r}", file=sys.stderr)
    unittest.TextTestRunner(stream=sys.stderr, resultclass=Recorder, verbosity=1).run(suite)
    for i, name in unit.items():
        status[i] = seen.get(name, "m")
nodes = [i for i in ids if "::" in i]
if nodes:
    try:
        import pytest
    except ImportError:
        print("pytest is not installed for the sandbox's python3: pytest ids cannot run", file=sys.stderr)
        for i in nodes: status[i] = "e"
    else:
        seen = {}
        class Plugin:
            def pytest_runtest_logreport(self, report):
                prev = seen.get(report.nodeid)
                if report.failed:
                    seen[report.nodeid] = "f" if report.when == "call" else "e"
                elif report.skipped and prev not in ("f", "e"):
                    seen[report.nodeid] = "x" if hasattr(report, "wasxfail") else "s"
                elif report.when == "call" and prev is None:
                    seen[report.nodeid] = "p"
        pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", *nodes], plugins=[Plugin()])
        for i in nodes: status[i] = seen.get(i, "m")
result.write(nonce + " " + "".join(status.get(i, "m") for i in ids) + "\n")
result.flush()
"""


@dataclass(frozen=True)
class Grade:
    passed: bool
    statuses: dict[str, str]  # test id -> STATUS value
    failing: list[str]  # FAIL_TO_PASS ids that did not pass
    broken: list[str]  # PASS_TO_PASS ids that did not pass
    complete: bool  # the runner got to its last line


def grade(inst: Instance, stdout: str, nonce: str) -> Grade:
    """The verdict from the runner's stdout: every FAIL_TO_PASS and PASS_TO_PASS id passed."""
    ids = inst.tests()
    line = next((x for x in reversed(stdout.splitlines()) if x.startswith(nonce + " ")), None)
    codes = line.split(" ", 1)[1] if line is not None else ""
    complete = len(codes) == len(ids)
    statuses = {i: STATUS.get(c, "not run") for i, c in zip(ids, codes, strict=False)} if complete else {}
    ok = {i for i, c in zip(ids, codes, strict=False) if c in PASSING} if complete else set()
    failing = [t for t in inst.FAIL_TO_PASS if t not in ok]
    broken = [t for t in inst.PASS_TO_PASS if t not in ok]
    return Grade(complete and not failing and not broken, statuses, failing, broken, complete)


def run_tests_argv(inst: Instance) -> list[str]:
    """What the model's `run_tests` tool runs: the instance's test framework, everything."""
    if inst.pytest_style():
        return ["python3", "-B", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    return ["python3", "-B", "-m", "unittest"]
