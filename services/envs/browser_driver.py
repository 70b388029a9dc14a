"""Chromium driven through Playwright for the `browser` environment, confined to one site.

`Browser` wraps Playwright's sync API: every method runs on one thread (the environment's
browser thread), and a Playwright error comes back as a ToolError carrying its first line.
Chromium is the system's (Debian's `chromium`, or NEXTSTATE_ENVS__CHROMIUM): Playwright
is pointed at it, and no browser is ever downloaded.

Confinement: each `open` makes a fresh context whose route handler aborts every request
not to the site's origin (other ports on 127.0.0.1 included) and whose web sockets never
connect; service workers are blocked. Chromium runs with extensions, sync, component
updates and background networking off, a dead proxy (loopback bypasses it) and a host
resolver that resolves nothing, so its own background traffic has nowhere to go either.

The model sees a page as its text and a numbered list of interactive elements (ids kept in
a `data-ns-id` attribute for the document's life) and acts on those ids. After an action
`Browser` waits (bounded) until the page has loaded and no request was in flight for a
moment, so the next read sees the result.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from services.envs.base import ToolError

if TYPE_CHECKING:
    from playwright.sync_api import BrowserContext, Locator, Page, Request, Route

T = TypeVar("T")

ACTION_TIMEOUT_MS = 3_000
NAVIGATION_TIMEOUT_MS = 5_000
QUIET_S = 0.06  # the page has settled after this long without a request in flight
TEXT_LIMIT = 4_000
ELEMENT_ID = re.compile(r"e[0-9]{1,5}")
LAUNCH_ARGS = [
    "--disable-extensions", "--disable-component-extensions-with-background-pages",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-domain-reliability", "--no-first-run", "--no-pings",
    "--disable-gpu", "--disable-dev-shm-usage", "--renderer-process-limit=2",
    "--proxy-server=127.0.0.1:9",  # loopback bypasses it; anything else meets a closed port
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]

# Numbers the visible interactive elements (data-ns-id, kept for the document's life) and
# describes each: role, accessible-ish name, value, state, options, link target.
ELEMENTS_JS = r"""
() => {
  const sel = 'a[href], button, input:not([type=hidden]), select, textarea, summary, ' +
              '[role=button], [role=switch], [role=checkbox], [role=link], [role=tab]';
  let next = window.__nsNext || 1;
  const out = [];
  for (const el of document.querySelectorAll(sel)) {
    const r = el.getBoundingClientRect(), st = getComputedStyle(el);
    if ((r.width === 0 && r.height === 0) || st.visibility === 'hidden') continue;
    if (!el.dataset.nsId) el.dataset.nsId = 'e' + next++;
    const tag = el.tagName.toLowerCase(), type = (el.getAttribute('type') || '').toLowerCase();
    const inputRole = {checkbox: 'checkbox', radio: 'radio', submit: 'button', button: 'button', reset: 'button'};
    const role = el.getAttribute('role') ||
      {a: 'link', button: 'button', select: 'combobox', textarea: 'textbox', summary: 'button'}[tag] ||
      (tag === 'input' ? (inputRole[type] || 'textbox') : tag);
    const labels = el.labels ? Array.from(el.labels).map(l => l.innerText.trim()).join(' ') : '';
    const name = el.getAttribute('aria-label') || labels ||
      (tag === 'input' && inputRole[type] === 'button' ? el.value : '') ||
      (el.innerText || '').trim() || el.getAttribute('placeholder') || el.getAttribute('name') || '';
    const e = {id: el.dataset.nsId, role, name: name.replace(/\s+/g, ' ').slice(0, 80)};
    if (role === 'textbox') e.value = el.value;
    if (role === 'checkbox' || role === 'radio') e.checked = el.checked;
    if (role === 'switch') e.checked = el.getAttribute('aria-checked') === 'true';
    if (tag === 'select') {
      e.value = el.selectedOptions.length ? el.selectedOptions[0].text : '';
      e.options = Array.from(el.options).map(o => o.text);
    }
    if (tag === 'a') e.href = el.getAttribute('href');
    if (el.disabled) e.disabled = true;
    out.push(e);
  }
  window.__nsNext = next;
  return out;
}
"""

OPTIONS_JS = "el => el.tagName === 'SELECT' ? Array.from(el.options).map(o => [o.value, o.text]) : null"


def describe(element: dict[str, Any]) -> str:
    """One line of read_page's element list: `[e3] button "Sign in"`."""
    line = f"[{element['id']}] {element['role']} {json.dumps(element['name'], ensure_ascii=False)}"
    if "checked" in element:
        line += " (on)" if element["checked"] else " (off)"
    if "value" in element:
        line += f" value={json.dumps(element['value'], ensure_ascii=False)}"
    if "options" in element:
        line += " options: " + " | ".join(element["options"])
    if "href" in element:
        line += f" -> {element['href']}"
    if element.get("disabled"):
        line += " (disabled)"
    return line


def site_path(path: str) -> str:
    """A path on the site (`/x.html?a=1`) for goto; anything with a scheme or a host is refused."""
    text = path.strip()
    parts = urlsplit(text)
    if parts.scheme or parts.netloc or not text.startswith("/") or text.startswith("//") or "\\" in text:
        raise ToolError(f"goto takes a path on this site such as /index.html, not {path!r}; "
                        "the browser cannot reach any other website")
    return text


class Browser:
    """Chromium through Playwright's sync API. Every method runs on the environment's
    single browser thread; Playwright errors surface as ToolError with their first line."""

    def __init__(self, executable: str) -> None:
        from playwright.sync_api import sync_playwright

        self._playwright = sync_playwright().start()
        try:
            self._browser = self._playwright.chromium.launch(
                executable_path=executable, headless=True, args=LAUNCH_ARGS, timeout=30_000)
        except Exception:
            self._playwright.stop()
            raise
        self._context: BrowserContext | None = None
        self._page_: Page | None = None
        self.origin = ""
        self.blocked: list[str] = []
        self._inflight = 0
        self._last_request = 0.0

    def open(self, origin: str, start: str) -> None:
        """A fresh context (no cookies, storage or history) on `origin`, at `start`."""
        self._call(self.close_context)
        self.origin, self.blocked = origin, []
        self._context = context = self._call(lambda: self._browser.new_context(
            service_workers="block", accept_downloads=False, viewport={"width": 1024, "height": 768}))
        context.set_default_timeout(ACTION_TIMEOUT_MS)
        context.set_default_navigation_timeout(NAVIGATION_TIMEOUT_MS)
        self._call(lambda: context.route("**/*", self._route))
        # Web sockets bypass `route`; this handler never connects one (Playwright >= 1.48).
        self._call(lambda: context.route_web_socket(re.compile(".*"), lambda ws: ws.close()))
        self._page_ = page = self._call(context.new_page)
        page.on("request", self._on_request)
        page.on("requestfinished", self._on_done)
        page.on("requestfailed", self._on_done)
        self._call(lambda: page.goto(origin + start, wait_until="load"))

    @property
    def _page(self) -> Page:
        if self._page_ is None:
            raise ToolError("the browser has no page open")
        return self._page_

    def connected(self) -> bool:
        return bool(self._browser.is_connected())

    def _route(self, route: Route) -> None:
        url = route.request.url
        if url == self.origin or url.startswith(self.origin + "/"):
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort("blockedbyclient")

    def _on_request(self, _: Request) -> None:
        self._inflight += 1
        self._last_request = time.monotonic()

    def _on_done(self, _: Request) -> None:
        self._inflight = max(0, self._inflight - 1)

    def _call(self, action: Callable[[], T]) -> T:
        from playwright.sync_api import Error

        try:
            return action()
        except Error as e:
            raise ToolError(str(e.message).strip().splitlines()[0]) from None

    def _settle(self) -> None:
        """Wait (bounded) until the page has loaded and no request was in flight for QUIET_S."""
        start = time.monotonic()
        self._last_request = max(self._last_request, start)
        deadline = start + NAVIGATION_TIMEOUT_MS / 1000
        page = self._page
        while time.monotonic() < deadline:
            if self._inflight == 0 and time.monotonic() - self._last_request >= QUIET_S:
                break
            self._call(lambda: page.wait_for_timeout(15))
        self._call(lambda: page.wait_for_load_state("load"))

    def where(self) -> str:
        page = self._page
        url = page.url
        path = url[len(self.origin):] or "/" if url.startswith(self.origin) else url
        title = self._call(page.title)
        return f"{path} ({title!r})"

    def _element(self, element: str) -> Locator:
        if not ELEMENT_ID.fullmatch(element.strip()):
            raise ToolError(f"{element!r} is not an element id: use an id such as e3 from read_page")
        locator = self._page.locator(f'[data-ns-id="{element.strip()}"]')
        if self._call(locator.count) == 0:
            raise ToolError(f"there is no element {element.strip()} on this page (ids come from "
                            "read_page and change when the page changes); call read_page")
        return locator.first

    def read_page(self) -> str:
        page = self._page
        text = self._call(lambda: page.inner_text("body"))
        if len(text) > TEXT_LIMIT:
            text = text[:TEXT_LIMIT] + f"\n[... {len(text) - TEXT_LIMIT} more characters]"
        elements: list[dict[str, Any]] = self._call(lambda: page.evaluate(ELEMENTS_JS))
        listing = "\n".join(describe(e) for e in elements) or "(none)"
        return f"Page: {self.where()}\n\n{text.strip()}\n\nInteractive elements:\n{listing}"

    def click(self, element: str) -> str:
        target = self._element(element)
        self._call(lambda: target.click())
        self._settle()
        return f"Clicked {element.strip()}. Now at {self.where()}."

    def type(self, element: str, text: str) -> str:
        target = self._element(element)
        self._call(lambda: target.fill(text))
        return f"Typed {len(text)} characters into {element.strip()}."

    def select(self, element: str, option: str) -> str:
        target = self._element(element)
        options: list[list[str]] | None = self._call(lambda: target.evaluate(OPTIONS_JS))
        if options is None:
            raise ToolError(f"{element.strip()} is not a drop-down list")
        if not any(option in pair for pair in options):
            texts = " | ".join(text for _, text in options)
            raise ToolError(f"{element.strip()} has no option {option!r}; its options: {texts}")
        self._call(lambda: target.select_option(option))
        self._settle()
        return f"Selected {option!r} in {element.strip()}."

    def goto(self, path: str) -> str:
        page = self._page
        response = self._call(lambda: page.goto(self.origin + site_path(path), wait_until="load"))
        self._settle()
        status = f" (HTTP {response.status})" if response is not None and response.status >= 400 else ""
        return f"Now at {self.where()}{status}."

    def back(self) -> str:
        page = self._page
        if self._call(lambda: page.go_back(wait_until="load")) is None:
            raise ToolError("there is no earlier page to go back to")
        self._settle()
        return f"Now at {self.where()}."

    def close_context(self) -> None:
        if self._context is not None:
            context, self._context, self._page_ = self._context, None, None
            context.close()

    def close(self) -> None:
        try:
            self.close_context()
            self._browser.close()
        finally:
            self._playwright.stop()
