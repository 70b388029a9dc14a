"""Sending records to the buffer's `POST /receive`, shared by `nextstate import`
(services/ctl/importer.py) and `nextstate import --watch` (services/ctl/import_watch.py):
where the buffer is, the credential it wants, one chunk with retries, and a stop on signals.

A chunk the buffer cannot take right now (503: Redis or the `turns` stream full, or no
answer) is retried with backoff — turn ids are derived from the content, so a retried chunk
imports nothing twice. A 401 is `Unauthorized`, any other refusal `Refused` (nothing of the
chunk was published), a stop asked for while waiting to retry `Stopped`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from services.ctl.stacks import endpoint, find_stack
from shared.errors import NextstateError
from shared.settings import Settings, load_settings

DEFAULT_URL = "http://127.0.0.1:8200"
URL_ENV = "NEXTSTATE_BUFFER_URL"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class Refused(NextstateError):
    """The buffer refused a chunk for what it holds (HTTP 4xx but 401): nothing of it was
    published. `status` and the buffer's `message`."""

    def __init__(self, text: str, status: int, message: str) -> None:
        super().__init__(text)
        self.status = status
        self.message = message


class Unauthorized(NextstateError):
    """The buffer refused the credential (HTTP 401)."""


class Stopped(NextstateError):
    """A stop was asked for while a chunk waited to be retried (it was not sent)."""


def send_chunk(
    client: httpx.Client,
    url: str,
    chunk: list[tuple[int, Any]],
    retries: int,
    where: str,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """POST one chunk to `/receive`; its result. Retries 503s and transport errors with
    backoff (turn ids are content hashes: a retried chunk imports nothing twice); raises
    `Refused` (400, 413...), `Unauthorized`, `Stopped`, or `NextstateError` after `retries`."""
    body = [record for _, record in chunk]
    delay = 0.5
    for attempt in range(1, retries + 1):
        try:
            resp = client.post(f"{url}/receive", json=body)
        except httpx.HTTPError as exc:
            problem = f"no answer from {url} ({type(exc).__name__}: {exc})"
        else:
            if resp.status_code == 200:
                out: dict[str, Any] = resp.json()
                return out
            message = _message(resp)
            if resp.status_code == 401:
                raise Unauthorized(
                    f"the buffer at {url} refused the credential (HTTP 401): {message}. Set "
                    "NEXTSTATE_INTERNAL__TOKEN to the stack's internal token (`nextstate up` keeps "
                    "it in <home>/up/<run>/secrets.json)"
                )
            if resp.status_code != 503:
                lines = f"{where} {chunk[0][0]}-{chunk[-1][0]}"
                raise Refused(
                    f"the buffer refused {lines} (HTTP {resp.status_code}): {message}",
                    resp.status_code,
                    message,
                )
            problem = message
        if attempt == retries:
            raise NextstateError(f"giving up after {retries} tries: {problem}")
        print(f"nextstate import: {problem}; retrying in {delay:.1f}s", file=sys.stderr)
        if stop is not None and stop.wait(delay):
            raise Stopped("stopped while waiting to retry")
        if stop is None:
            time.sleep(delay)
        delay = min(delay * 2, 10.0)
    raise AssertionError("unreachable")


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


def internal_token(url: str) -> str | None:
    """NEXTSTATE_INTERNAL__TOKEN, else (for a buffer on this machine) the token the
    running `nextstate up` recorded; a remote buffer never gets a local stack's token."""
    token = load_settings(Settings).internal.secret()
    if token is None and urlsplit(url).hostname in LOOPBACK and (stack := find_stack()) is not None:
        token = stack.secrets.get("internal_token") or None
    return token


def buffer_url(args: argparse.Namespace) -> str:
    return endpoint(args.url, URL_ENV, "buffer", DEFAULT_URL).rstrip("/")


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (the first of either; a second SIGINT interrupts)."""
    stop = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop
