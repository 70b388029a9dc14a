"""Find the stack `nextstate up` started, so the CLI talks to it without any environment.

`up` writes `<home>/up/<run>/stack.json` (endpoints, no secrets) and `secrets.json` (the
credentials the CLI needs, owner-only). A command resolves its target in this order:
its flags, then `NEXTSTATE_*` variables, then the running stack's record — for the run
named by `NEXTSTATE_RUN` if set, else the most recently started stack that is still
running (its `up` process alive) — then the built-in defaults. It always says which on
stderr (`describe`), so an operator never reads the wrong deployment's streams.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.ctl.models import home


@dataclass(frozen=True)
class FoundStack:
    path: Path  # its stack.json
    record: dict[str, Any]
    secrets: dict[str, str] = field(default_factory=dict)

    @property
    def run(self) -> str:
        return str(self.record.get("run", ""))

    def service_url(self, name: str) -> str | None:
        url = (self.record.get("services") or {}).get(name, {}).get("url")
        return str(url) if url else None

    def describe(self) -> str:
        started = self.record.get("started_at")
        when = time.strftime("%H:%M:%S", time.localtime(float(started))) if started else "?"
        return (f"the stack of `nextstate up` (run {self.run}, pid {self.record.get('pid')}, "
                f"started {when}; {self.path})")


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def _load(path: Path) -> FoundStack | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("stopped") or not _alive(record.get("pid")):
        return None
    secrets: dict[str, str] = {}
    try:
        loaded = json.loads((path.parent / "secrets.json").read_text())
        if isinstance(loaded, dict):
            secrets = {str(k): str(v) for k, v in loaded.items()}
    except (OSError, ValueError):
        pass
    return FoundStack(path, record, secrets)


def find_stack(root: Path | None = None, run: str | None = None) -> FoundStack | None:
    """The running stack for `run` (default NEXTSTATE_RUN), else the newest running one."""
    base = (root or home()) / "up"
    run = run or os.environ.get("NEXTSTATE_RUN")
    if run:
        return _load(base / run / "stack.json")
    found = [s for p in base.glob("*/stack.json") if (s := _load(p)) is not None]
    return max(found, key=lambda s: float(s.record.get("started_at") or 0), default=None)


def endpoint(flag: str | None, env_var: str, service: str, default: str, suffix: str = "") -> str:
    """A service's URL for a CLI command: the flag, else `env_var`, else the running stack's
    (saying so on stderr), else `default`."""
    import sys

    if flag:
        return flag
    if os.environ.get(env_var):
        return os.environ[env_var]
    stack = find_stack()
    url = stack.service_url(service) if stack is not None else None
    if stack is not None and url:
        print(f"nextstate: {service} of {stack.describe()}", file=sys.stderr)
        return url + suffix
    return default
