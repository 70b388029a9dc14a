"""The browser environment, run for real: Debian's Chromium driven by Playwright.

Every shipped task is solved by its reference solution through `step` (elements found by
name in read_page's listing) and not solved by doing nothing; the browser reaches nothing
but the episode's site (goto refuses other addresses, page scripts and links to another
origin are blocked before they leave); bad element ids are error observations. One
browser serves the whole module (each reset gives a fresh site and browser context).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import playwright  # noqa: F401
import pytest

from services.envs.base import Task, load_environment
from services.envs.browser import BrowserEnv, chromium_binary

# Playwright is in the envs extra (part of [all]): a missing one fails here, never skips.
# Chromium is Debian's, which `make venv` installs as root with apt-get; without it the
# browser environment is unavailable, and these tests say so (docs/environments.md).
pytestmark = pytest.mark.skipif(
    chromium_binary() is None, reason="no Chromium: apt-get install chromium, or set NEXTSTATE_ENVS__CHROMIUM")

TASKS = BrowserEnv.tasks("train") + BrowserEnv.tasks("heldout")
LISTED = re.compile(r'\[(e\d+)\] \S+ "(.*?)"')


@pytest.fixture(scope="module")
def env() -> Iterator[BrowserEnv]:
    environment = BrowserEnv()
    yield environment
    environment.close()


async def element(env: BrowserEnv, name: str) -> str:
    """The id read_page gives the element named `name`."""
    page = await env.step("read_page", {})
    for line in page.splitlines():
        m = LISTED.match(line)
        if m and m.group(2) == name:
            return m.group(1)
    raise AssertionError(f"no element named {name!r} in:\n{page}")


async def act(env: BrowserEnv, tool: str, args: dict[str, Any]) -> str:
    if "element" in args:
        args = {**args, "element": await element(env, args["element"])}
    observation = await env.step(tool, args)
    assert not observation.startswith("Error"), f"{tool} {args}: {observation}"
    return observation


def test_tasks_and_tools() -> None:
    assert isinstance(load_environment("browser"), BrowserEnv)
    train, heldout = BrowserEnv.tasks("train"), BrowserEnv.tasks("heldout")
    assert len(train) >= 6 and len(heldout) >= 4
    assert len({t.id for t in TASKS}) == len(TASKS)
    names = {t["function"]["name"] for t in BrowserEnv().tools()}
    assert names == {"read_page", "click", "type", "select", "goto", "back"}


@pytest.mark.parametrize("task", TASKS, ids=[t.id for t in TASKS])
async def test_reference_solution_passes_and_doing_nothing_fails(env: BrowserEnv, task: Task) -> None:
    await env.reset(task)
    idle = await env.verify()
    assert not idle.passed and idle.reward == 0.0

    for tool, args in task.data["solution"]:
        await act(env, tool, args)
    verdict = await env.verify()
    assert verdict.passed and verdict.reward == 1.0, verdict.details
    assert verdict.details["blocked_requests"] == 0


def by_id(task_id: str) -> Task:
    return next(t for t in TASKS if t.id == task_id)


async def test_wrong_actions_fail(env: BrowserEnv) -> None:
    await env.reset(by_id("browser-login"))
    await act(env, "goto", {"path": "/login.html"})
    await act(env, "type", {"element": "Username", "text": "mara"})
    await act(env, "type", {"element": "Password", "text": "tulip-24"})
    await act(env, "click", {"element": "Sign in"})
    assert "Wrong username or password" in await env.step("read_page", {})
    assert not (await env.verify()).passed

    await env.reset(by_id("browser-dark-mode"))  # the right switch, and one too many
    await act(env, "goto", {"path": "/settings.html"})
    await act(env, "click", {"element": "Dark mode"})
    await act(env, "click", {"element": "Share usage data"})
    verdict = await env.verify()
    assert not verdict.passed and verdict.details["wrong"] == ["share_usage"]

    await env.reset(by_id("browser-price"))  # a wrong first answer is not mended by a second
    for answer in ("490", "49"):
        await act(env, "goto", {"path": "/answer.html"})
        await act(env, "type", {"element": "Your answer", "text": answer})
        await act(env, "click", {"element": "Submit answer"})
    assert not (await env.verify()).passed


async def test_goto_outside_the_site_is_refused(env: BrowserEnv) -> None:
    await env.reset(by_id("browser-login"))
    for target in ("http://example.com/", "https://127.0.0.1:1/", "//example.com/x",
                   "javascript:alert(1)", "file:///etc/passwd", "index.html", "about:blank"):
        observation = await env.step("goto", {"path": target})
        assert observation.startswith("Error: goto:") and "cannot reach any other website" in observation
    assert "Page: /index.html" in await env.step("read_page", {})
    assert env.blocked == []


class _Witness(BaseHTTPRequestHandler):
    """Another local server: records every request that reaches it."""

    hits: ClassVar[list[str]]

    def do_GET(self) -> None:
        self.hits.append(self.path)
        self.send_response(200)
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def witness() -> Iterator[tuple[int, list[str]]]:
    handler = type("Witness", (_Witness,), {"hits": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server.server_address[1], handler.hits
    server.shutdown()
    server.server_close()
    thread.join()


async def test_requests_to_another_origin_are_blocked(env: BrowserEnv, witness: tuple[int, list[str]]) -> None:
    port, hits = witness
    other = f"http://127.0.0.1:{port}"
    probe = (f"<title>probe</title><img src='{other}/img'><a href='{other}/link'>away</a><p id=r>waiting</p>"
             f"<script>new WebSocket('ws://127.0.0.1:{port}/socket');"
             f"fetch('{other}/fetch').then(() => r.textContent = 'reached',"
             f" () => r.textContent = 'blocked')</script>")
    task = Task(id="probe", env="browser", prompt="", data={
        "start": "/probe.html", "pages": {"/probe.html": probe}, "goal": {"event": "none", "expect": {}}})
    await env.reset(task)
    deadline = time.monotonic() + 10
    while "waiting" in (page := await env.step("read_page", {})) and time.monotonic() < deadline:
        pass  # read_page itself waits on the browser: the fetch's failure lands within a few reads
    assert "blocked" in page and "reached" not in page
    await act(env, "click", {"element": "away"})  # a link out: the navigation is aborted
    assert hits == []
    assert {f"{other}/img", f"{other}/fetch", f"{other}/link"} <= set(env.blocked)


async def test_bad_calls_are_error_observations(env: BrowserEnv) -> None:
    await env.reset(by_id("browser-contact"))
    await act(env, "goto", {"path": "/contact.html"})
    for bad in ("e999", "button", "", "[data-ns-id=e1]"):
        assert (await env.step("click", {"element": bad})).startswith("Error: click:")
    home = await element(env, "Home")
    typed = await env.step("type", {"element": home, "text": "x"})  # a link is not a text field
    assert typed.startswith("Error: type:")
    assert (await env.step("type", {"element": "e1"})).startswith("Error: type: missing required argument")
    assert (await env.step("scroll", {})).startswith("Error: there is no tool 'scroll'")
    topic, email = await element(env, "Topic"), await element(env, "Your email")
    wrong = await env.step("select", {"element": topic, "option": "Refunds"})
    assert wrong.startswith("Error: select:") and "General question | Billing" in wrong
    assert (await env.step("select", {"element": email, "option": "x"})).startswith("Error: select:")
    missing = await env.step("goto", {"path": "/no-such-page.html"})
    assert "HTTP 404" in missing
