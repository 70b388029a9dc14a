"""How long `nextstate up` takes to come up and to stop, against the way it used to start.

Three arms, interleaved round by round so that a burst of other load hits each alike, every
one a real `nextstate up` (its own Redis and SeaweedFS, the engine on a tiny model, collector,
rule judge, buffer, trainer, watcher; `--eval` adds the evaluation engine and evaluator):

- `one-by-one`: the baseline, each service started only once the one before is ready, and
  the services that only tokenize loading their tokenizer through AutoTokenizer (which
  imports torch) — how `up` started before;
- `autotokenizer`: services started in groups, tokenizers still through AutoTokenizer;
- `groups`: as shipped, in groups, with `shared.chat.load_tokenizer`'s shortcut.

The baselines run the same `up` with the old behaviour patched back in
(`Supervisor.start_together` awaiting one process at a time, `plain_backend_folder` saying
no). Reported: median seconds from launch to "OpenAI endpoint", from Ctrl-C to exit,
and each arm's start as a ratio of the baseline's.

    python bench/up_start.py [--rounds 3] [--eval]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.tiny_model import build_tiny_model

SEQUENTIAL = """
import services.ctl.supervisor as sup

async def one_by_one(self, procs):
    return [await self.start(p) for p in procs]

async def start(self, p):
    self._groups.append([p])
    return await self._start(p)

sup.Supervisor.start_together = one_by_one
sup.Supervisor.start = start
"""
# Every Python process of the stack, once `shared.chat` is imported: the shortcut says no.
AUTOTOKENIZER = """
import importlib.abc, importlib.util, sys

class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "shared.chat":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            module.plain_backend_folder = lambda folder: False

        spec.loader.exec_module = patched
        return spec

sys.meta_path.insert(0, Hook())
"""
ARMS = {"one-by-one": (True, True), "autotokenizer": (False, True), "groups": (False, False)}


def launcher(sequential: bool) -> str:
    """`nextstate` itself, with the old one-by-one start patched into `up` when asked."""
    patch = SEQUENTIAL if sequential else ""
    return patch + "\nimport sys\nfrom services.ctl.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"


def shim(root: Path, arm: str) -> Path:
    """A folder for PYTHONPATH whose sitecustomize.py (run by every Python process of the
    stack) puts AutoTokenizer back when the arm asks for it."""
    folder = root / "shims" / arm
    folder.mkdir(parents=True)
    if ARMS[arm][1]:
        (folder / "sitecustomize.py").write_text(AUTOTOKENIZER)
    return folder


def one(model: Path, root: Path, arm: str, n: int, extra: list[str]) -> tuple[float, float]:
    home = root / f"{arm}-{n}"
    home.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEXTSTATE_")}
    env.update(NEXTSTATE_HOME=str(home), NEXTSTATE_RUN=f"{arm}-{n}", NEXTSTATE_REDIS__PREFIX=f"b{n}",
               PYTHONPATH=str(root / "shims" / arm) + os.pathsep + str(REPO))  # fmt: skip
    argv = [sys.executable, "-c", launcher(ARMS[arm][0]), "up", "--model", str(model), "--home", str(home),
            *extra]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    up_s = None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        if "OpenAI endpoint" in line:
            up_s = time.monotonic() - started
            break
    if up_s is None:
        proc.wait(30)
        raise RuntimeError(f"{arm}: up did not come up:\n{''.join(lines[-40:])}")
    stopping = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    proc.communicate(timeout=120)
    return up_s, time.monotonic() - stopping


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--eval", action="store_true", help="with the evaluation engine and evaluator")
    a = ap.parse_args()
    extra = [] if a.eval else ["--no-eval"]
    with tempfile.TemporaryDirectory(prefix="bench-up-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model")
        for arm in ARMS:
            shim(root, arm)
        starts: dict[str, list[float]] = {arm: [] for arm in ARMS}
        stops: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for n in range(a.rounds):
            order = list(ARMS)[n % len(ARMS):] + list(ARMS)[:n % len(ARMS)]  # no arm always first
            for arm in order:
                up_s, stop_s = one(model, root, arm, n, extra)
                starts[arm].append(up_s)
                stops[arm].append(stop_s)
                print(f"round {n + 1} {arm:<14} up {up_s:5.1f} s  stop {stop_s:4.1f} s", flush=True)
    base = statistics.median(starts["one-by-one"])
    print(f"\n`nextstate up {' '.join(extra)}` on a tiny model, {a.rounds} rounds, medians:")
    print(f"{'arm':<14} {'up (s)':>7} {'x baseline':>10} {'stop (s)':>9}")
    for arm in ARMS:
        up_s = statistics.median(starts[arm])
        print(f"{arm:<14} {up_s:7.1f} {up_s / base:10.2f} {statistics.median(stops[arm]):9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
