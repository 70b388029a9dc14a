"""Where the browser environment's Chromium is: the system's, never a downloaded one.

`NEXTSTATE_ENVS__CHROMIUM` when set (an executable file), else the first of `chromium`,
`chromium-browser` on the PATH (Debian's package: /usr/bin/chromium, which `make`
installs). The env workers drive it (services/envs/browser_driver.py); `nextstate`'s
`infra check` reports it.
"""

from __future__ import annotations

import os
import shutil

CHROMIUM_ENV = "NEXTSTATE_ENVS__CHROMIUM"
CHROMIUM_NAMES = ("chromium", "chromium-browser")


def chromium_binary() -> str | None:
    """The Chromium to drive, or None when there is none (or the override is not executable)."""
    override = os.environ.get(CHROMIUM_ENV, "").strip()
    if override:
        return override if os.path.isfile(override) and os.access(override, os.X_OK) else None
    return next((found for name in CHROMIUM_NAMES if (found := shutil.which(name))), None)
