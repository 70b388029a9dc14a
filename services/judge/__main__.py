"""`python -m services.judge`: one judge worker; start several to share the `judge` group.

Configuration comes from `NEXTSTATE_*` / `NEXTSTATE_JUDGE__*` (services/judge/settings.py).
Invalid settings or a plugin that cannot be loaded: a message on stderr, exit code 2.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any

from services.judge.settings import JudgeSettings
from shared.errors import SettingsError
from shared.settings import load_settings
from shared.telemetry import configure_logging


def main() -> int:
    try:
        settings = load_settings(JudgeSettings)
    except SettingsError as exc:
        print(f"judge: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log, "judge")
    from services.judge.service import run

    try:
        run_forever(run(settings))
    except SettingsError as exc:
        print(f"judge: {exc}", file=sys.stderr)
        return 2
    return 0


def run_forever(main_coro: Coroutine[Any, Any, None]) -> None:
    """asyncio.run on uvloop when it is installed (it is, with uvicorn[standard])."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coro)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main_coro)


if __name__ == "__main__":
    sys.exit(main())
