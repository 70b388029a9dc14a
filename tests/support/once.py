"""What a whole test run builds once, however many pytest-xdist workers ask for it.

`built_once(factory, "tiny-model", build)` is a folder in the run's root (the base temporary
folder, or its parent, which every xdist worker of the run shares): the first worker to ask
builds it under a file lock, the others wait for it and reuse it. A build that failed
leaves no folder marked done, so the next one to ask tries again.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def run_root(factory: pytest.TempPathFactory) -> Path:
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    root = run_root(factory)
    folder = root / f"once-{name}"
    done = root / f"once-{name}.done"
    with open(root / f"once-{name}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder
