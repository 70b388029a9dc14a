"""A web browser on a small local website: the `browser` environment.

Each episode gets its own `Site` (services/envs/browser_site.py: an HTTP server on
127.0.0.1 that serves the pages and records what they post) and a fresh context of one
headless Chromium per environment instance (services/envs/browser_driver.py), launched at
the first `reset`, kept across resets, closed by `close`. The browser reaches nothing but
the site; the episode's `Sandbox` is not used: the confined browser is this environment's
sandbox.

Tasks (services/envs/tasks/browser/tasks.json) name a start page, the site's accounts and
initial settings, a goal and a reference solution (for the tests). The model reads the page
(`read_page`: its text and its interactive elements with ids) and acts on elements by id
(`click`, `type`, `select`) or opens a path (`goto`, `back`); each action has a Playwright
timeout of a few seconds, and what it got wrong is an error observation. `verify` checks
the goal against the server's record (`check_goal`), never the conversation.

Playwright's sync API runs on a thread of the environment's own, so `close()` (sync in the
Environment API) shuts the browser down before it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from importlib import resources
from typing import Any, TypeVar

from services.envs.base import (
    Environment,
    Message,
    Split,
    Task,
    ToolError,
    Verdict,
    function_tool,
    opening,
    pick,
)
from services.envs.browser_driver import Browser, site_path
from services.envs.browser_site import Site, check_goal
from services.envs.sandbox import Sandbox
from shared.chromium import CHROMIUM_ENV, chromium_binary
from shared.errors import NextstateError

__all__ = ["BrowserEnv", "BrowserUnavailable", "chromium_binary"]

T = TypeVar("T")

STEP_TIMEOUT_S = 30.0  # a browser thread that answers nothing for this long is given up on

SYSTEM = (
    "You are using a web browser on a small website. The tools: read_page shows the current "
    "page's text and its interactive elements with ids such as e3; click, type and select act "
    "on an element by its id; goto opens a path on the site (such as /index.html); back goes "
    "back. Ids change when the page changes: read the page again after you navigate. The "
    "browser cannot reach any other website. When the task is done, say so briefly without "
    "calling a tool."
)


class BrowserUnavailable(NextstateError):
    """No Chromium or no Playwright on this machine: the browser environment cannot run."""


@cache
def _all_tasks() -> tuple[Task, ...]:
    raw = json.loads(resources.files("services.envs").joinpath("tasks/browser/tasks.json").read_text("utf-8"))
    out = []
    for t in raw["tasks"]:
        data = {k: t[k] for k in ("start", "accounts", "settings", "goal", "solution")}
        out.append(Task(id=t["id"], env="browser", prompt=t["prompt"], data=data, split=t["split"]))
    return tuple(out)


class BrowserEnv(Environment):
    name = "browser"

    def __init__(self) -> None:
        self.task: Task | None = None
        self.site: Site | None = None
        self._browser: Browser | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="browser-env")

    @classmethod
    def tasks(cls, split: Split, n: int | None = None, seed: int = 0) -> list[Task]:
        return pick([t for t in _all_tasks() if t.split == split], n, seed)

    def tools(self) -> list[Message]:
        element = ("string", "an element id from read_page, such as e3")
        return [
            function_tool("read_page", "The current page: its address, visible text and interactive "
                          "elements with their ids.", {}),
            function_tool("click", "Click an element (link, button, checkbox, switch).", {"element": element}),
            function_tool("type", "Replace the text of an input field or text area with `text`.",
                          {"element": element, "text": ("string", "the text to enter")}),
            function_tool("select", "Choose an option of a drop-down list, by its text or value.",
                          {"element": element, "option": ("string", "the option's text or value")}),
            function_tool("goto", "Open a page of this site by its path.",
                          {"path": ("string", "a path on the site, such as /index.html")}),
            function_tool("back", "Go back to the previous page.", {}),
        ]

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn` on the browser thread; a thread that does not answer in STEP_TIMEOUT_S is
        an error observation (Playwright's own timeouts are far shorter)."""
        call = asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
        try:
            return await asyncio.wait_for(call, STEP_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ToolError(f"the browser did not answer within {STEP_TIMEOUT_S:.0f} s") from None

    def _launch(self) -> Browser:
        executable = chromium_binary()
        if executable is None:
            raise BrowserUnavailable(
                f"no Chromium found: install Debian's chromium (apt-get install chromium) or set "
                f"{CHROMIUM_ENV} to a Chromium binary")
        try:
            return Browser(executable)
        except ImportError as e:
            raise BrowserUnavailable("Playwright is not installed: pip install 'nextstate[envs]'") from e

    async def reset(self, task: Task, sandbox: Sandbox | None = None) -> list[Message]:
        """A fresh site and browser context for `task`. The sandbox is not used: the browser,
        confined to the site, is this environment's sandbox."""
        if task.env != self.name:
            raise ValueError(f"task {task.id} is for {task.env!r}, not {self.name!r}")
        if self.site is not None:
            self.site.close()
        self.task, self.done = task, False
        self.site = Site(task.data.get("accounts", {}), task.data.get("settings", {}),
                         task.data.get("pages")).start()
        start = task.data.get("start", "/index.html")
        for attempt in (1, 2):  # a browser that died since the last episode is launched anew
            if self._browser is not None and not await self._run(self._browser.connected):
                await self._drop_browser()
            if self._browser is None:
                self._browser = await self._run(self._launch)
            try:
                await self._run(self._browser.open, self.site.origin, start)
                break
            except ToolError as e:
                await self._drop_browser()
                if attempt == 2:
                    raise BrowserUnavailable(f"the browser could not open the task's site: {e}") from e
        return opening(SYSTEM, task)

    async def _drop_browser(self) -> None:
        browser, self._browser = self._browser, None
        if browser is not None:
            with contextlib.suppress(Exception):  # it is going away either way
                await self._run(browser.close)

    def _open(self) -> Browser:
        if self._browser is None or self.done:
            raise ToolError("the browser is not open: the episode has not started or is over")
        return self._browser

    async def tool_read_page(self) -> str:
        return await self._run(self._open().read_page)

    async def tool_click(self, element: str) -> str:
        return await self._run(self._open().click, element)

    async def tool_type(self, element: str, text: str) -> str:
        return await self._run(self._open().type, element, text)

    async def tool_select(self, element: str, option: str) -> str:
        return await self._run(self._open().select, element, option)

    async def tool_goto(self, path: str) -> str:
        browser = self._open()
        site_path(path)  # refused before the browser thread is asked
        return await self._run(browser.goto, path)

    async def tool_back(self) -> str:
        return await self._run(self._open().back)

    @property
    def blocked(self) -> list[str]:
        """Requests to other origins the browser aborted during this episode."""
        return list(self._browser.blocked) if self._browser is not None else []

    async def verify(self, messages: Sequence[Message] | None = None) -> Verdict:
        if self.task is None or self.site is None:
            raise ValueError("verify called before reset")
        passed, details = check_goal(self.task.data["goal"], self.site)
        return Verdict.of(passed, **details, blocked_requests=len(self.blocked))

    def close(self) -> None:
        """Close the browser and stop the site (waits for the browser thread, a second or less)."""
        super().close()
        try:
            if self._browser is not None:
                self._thread.submit(self._browser.close).result(timeout=15)
        finally:
            self._browser = None
            self._thread.shutdown(wait=False)
            if self.site is not None:
                self.site.close()
                self.site = None
