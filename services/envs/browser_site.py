"""The local website the `browser` environment's tasks run on, and how a goal is checked.

One `Site` per episode: a small HTTP server on 127.0.0.1 (a free port, its own thread)
serving the pages shipped in services/envs/tasks/browser/site/ plus any pages a task adds,
and a JSON/form API the pages post to. The server is the judge's witness: every POST to
`/api/<action>` is recorded as an `Event` (its fields and the signed-in user), logins are
checked against the task's accounts, and settings are kept as state. `check_goal` reads
that record; what the model says in the conversation never counts.

    POST /api/login     username, password -> session cookie, redirect to /account.html
    POST /api/profile   display_name (signed in only)
    POST /api/settings  {key: bool, ...} merged into the settings; answers the new state
    POST /api/<other>   recorded as is
    GET  /api/state     {"user", "settings", "profile"} for the pages' scripts

A form post is answered with a redirect to its `_next` field (a local path) or /done.html,
a JSON post with JSON.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from importlib.abc import Traversable
from typing import Any
from urllib.parse import parse_qsl, urlsplit

log = logging.getLogger(__name__)

MAX_BODY = 64 * 1024
COOKIE = "ns_session"
TYPES = {"html": "text/html; charset=utf-8", "js": "text/javascript; charset=utf-8",
         "css": "text/css; charset=utf-8", "json": "application/json"}


@cache
def shipped_pages() -> dict[str, bytes]:
    """The site's files by URL path ("/index.html"), read once from the package."""
    pages: dict[str, bytes] = {}

    def walk(folder: Traversable, prefix: str) -> None:
        for entry in folder.iterdir():
            if entry.is_dir():
                walk(entry, f"{prefix}{entry.name}/")
            else:
                pages[f"{prefix}{entry.name}"] = entry.read_bytes()

    walk(resources.files("services.envs").joinpath("tasks/browser/site"), "/")
    return pages


@dataclass(frozen=True)
class Event:
    """One POST to /api/<action>: its fields, and who was signed in."""

    action: str
    fields: dict[str, Any]
    user: str | None


@dataclass
class SiteState:
    """What the pages did to the server; guarded by `lock` (requests run on threads)."""

    accounts: dict[str, str]
    settings: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    sessions: dict[str, str] = field(default_factory=dict)  # cookie token -> user
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def local_next(value: Any) -> str:
    """A redirect target from a form's `_next`: a path on this site, else /done.html."""
    if isinstance(value, str) and value.startswith("/") and not value.startswith("//") and "\\" not in value:
        return value
    return "/done.html"


class Site:
    """The episode's web server; `start()` it, read `origin`, `close()` it."""

    def __init__(self, accounts: Mapping[str, str], settings: Mapping[str, Any],
                 extra_pages: Mapping[str, str] | None = None) -> None:
        self.state = SiteState(accounts=dict(accounts), settings=dict(settings))
        self.pages = {**shipped_pages(), **{p: t.encode() for p, t in (extra_pages or {}).items()}}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def origin(self) -> str:
        if self._server is None:
            raise RuntimeError("the site is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> Site:
        handler = type("SiteHandler", (_Handler,), {"site": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="browser-site", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def events(self, action: str | None = None) -> list[Event]:
        with self.state.lock:
            return [e for e in self.state.events if action is None or e.action == action]

    def settings(self) -> dict[str, Any]:
        with self.state.lock:
            return dict(self.state.settings)


class _Handler(BaseHTTPRequestHandler):
    site: Site
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("site: " + format, *args)

    def _send(self, status: int, body: bytes = b"", content_type: str = "text/plain; charset=utf-8",
              headers: Mapping[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, value: Any, headers: Mapping[str, str] | None = None) -> None:
        self._send(200, json.dumps(value).encode(), TYPES["json"], headers)

    def _user(self) -> str | None:
        cookie = SimpleCookie(self.headers.get("Cookie", ""))
        token = cookie[COOKIE].value if COOKIE in cookie else None
        with self.site.state.lock:
            return self.site.state.sessions.get(token) if token else None

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/api/state":
            user = self._user()
            with self.site.state.lock:
                self._json({"user": user, "settings": self.site.state.settings,
                            "profile": self.site.state.profiles.get(user or "", {})})
            return
        body = self.site.pages.get("/index.html" if path == "/" else path)
        if body is None:
            self._send(404, b"Not found")
            return
        self._send(200, body, TYPES.get(path.rsplit(".", 1)[-1], "application/octet-stream"))

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        length = int(self.headers.get("Content-Length") or 0)
        if not path.startswith("/api/") or length > MAX_BODY:
            self._send(404 if length <= MAX_BODY else 413, b"No such endpoint")
            return
        raw = self.rfile.read(length)
        is_json = self.headers.get("Content-Type", "").startswith("application/json")
        try:
            fields = json.loads(raw or b"{}") if is_json else dict(parse_qsl(raw.decode(), keep_blank_values=True))
        except (ValueError, UnicodeDecodeError):
            self._send(400, b"Malformed body")
            return
        if not isinstance(fields, dict):
            self._send(400, b"Expected an object")
            return
        self._act(path.removeprefix("/api/"), fields, is_json)

    def _act(self, action: str, fields: dict[str, Any], is_json: bool) -> None:
        state, user = self.site.state, self._user()
        nxt = local_next(fields.pop("_next", None))
        headers: dict[str, str] = {}
        with state.lock:
            if action == "login":
                name = str(fields.get("username", ""))
                ok = name in state.accounts and state.accounts[name] == fields.get("password")
                fields["ok"] = ok
                if ok:
                    token = secrets.token_hex(16)
                    state.sessions[token] = user = name
                    headers["Set-Cookie"] = f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"
                nxt = "/account.html" if ok else "/login.html?error=1"
            elif action == "profile":
                if user is None:
                    self._send(HTTPStatus.SEE_OTHER, headers={"Location": "/login.html"})
                    return
                state.profiles.setdefault(user, {}).update(fields)
            elif action == "settings":
                state.settings.update({k: v for k, v in fields.items() if k in state.settings})
            state.events.append(Event(action, fields, user))
            reply = {"ok": True, "settings": dict(state.settings)}
        log.debug("site: %s recorded (user %s)", action, user)
        if is_json:
            self._json(reply, headers)
        else:
            self._send(HTTPStatus.SEE_OTHER, headers={**headers, "Location": nxt})


# --- goals ---------------------------------------------------------------------------------

_TRUE = {"on", "true", "yes", "1"}
_FALSE = {"", "off", "false", "no", "0"}


def matches(expected: Any, actual: Any) -> bool:
    """Whether a recorded value is the expected one: strings compared without case and
    extra spaces, numbers by value ("$49" is 49), booleans as checkboxes post them
    (absent or "" is false, "on" is true), objects key by key with the same keys."""
    if isinstance(expected, bool):
        if isinstance(actual, bool):
            return actual is expected
        text = "" if actual is None else str(actual).strip().lower()
        return text in (_TRUE if expected else _FALSE)
    if isinstance(expected, (int, float)):
        if isinstance(actual, bool):
            return False
        if isinstance(actual, str):
            try:
                actual = float(actual.strip().replace("$", "").replace(",", ""))
            except ValueError:
                return False
        return isinstance(actual, (int, float)) and abs(float(actual) - expected) < 1e-9
    if isinstance(expected, str):
        return isinstance(actual, str) and " ".join(actual.split()).casefold() == " ".join(expected.split()).casefold()
    if isinstance(expected, dict):
        return (isinstance(actual, dict) and set(actual) == set(expected)
                and all(matches(v, actual[k]) for k, v in expected.items()))
    return bool(expected == actual)


def check_goal(goal: Mapping[str, Any], site: Site) -> tuple[bool, dict[str, Any]]:
    """A task's goal against what the site recorded: `{"settings": {...}}` (the final
    settings), or `{"event": action, "expect": {...}, "which": "last" | "only"}` (the last
    such post, or the one and only one, has the expected fields; `user` is who was signed in)."""
    if "settings" in goal:
        final = site.settings()
        wrong = sorted(k for k, v in goal["settings"].items() if not matches(v, final.get(k)))
        return not wrong, {"settings": final, "wrong": wrong}
    events = site.events(goal["event"])
    details: dict[str, Any] = {"event": goal["event"], "count": len(events)}
    if not events:
        return False, {**details, "reason": f"nothing was submitted to {goal['event']}"}
    if goal.get("which", "last") == "only" and len(events) != 1:
        return False, {**details, "reason": f"{len(events)} submissions to {goal['event']}; only one is allowed"}
    record = {**events[-1].fields, "user": events[-1].user}
    wrong = sorted(k for k, v in goal["expect"].items() if not matches(v, record.get(k)))
    shown = {k: v for k, v in record.items() if k != "password"}
    return not wrong, {**details, "submitted": shown, "wrong": wrong}
