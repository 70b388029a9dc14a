"""What every `nextstate` subcommand shares: settings from env + flags, a Bus, formatting."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import sys
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import SecretStr
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.ctl.stacks import FoundStack, find_stack
from shared.errors import BusError
from shared.settings import Settings, load_settings
from shared.streams import Bus


def settings_from(args: argparse.Namespace, *, announce: bool = True) -> Settings:
    """Settings for a CLI command: its flags, then NEXTSTATE_* variables, then the running
    stack `nextstate up` recorded (services/ctl/stacks.py), then the defaults. Says on
    stderr which deployment it will talk to."""
    settings = load_settings(Settings)
    flags = {k: v for k, v in (("url", getattr(args, "redis_url", None)),
                               ("prefix", getattr(args, "prefix", None))) if v}
    stack = None
    if "url" not in flags and "NEXTSTATE_REDIS__URL" not in os.environ:
        stack = find_stack()
    if stack is not None:
        settings = with_stack(settings, stack)
    settings = settings.model_copy(update={"redis": settings.redis.model_copy(update=flags)})
    if announce:
        if stack is not None:
            where = stack.describe()
        elif "url" in flags:
            where = f"Redis at {redact(settings.redis.url)} (--redis-url)"
        elif "NEXTSTATE_REDIS__URL" in os.environ:
            where = f"Redis at {redact(settings.redis.url)} (NEXTSTATE_REDIS__URL)"
        else:
            where = f"Redis at {settings.redis.url} (the default: no running `nextstate up` found)"
        print(f"nextstate: {where}, prefix {settings.redis.prefix}, run {settings.run}", file=sys.stderr)
    return settings


def with_stack(settings: Settings, stack: FoundStack) -> Settings:
    """`settings` pointed at `stack`, except where a NEXTSTATE_* variable says otherwise."""
    rec, sec = stack.record, stack.secrets
    env = os.environ
    redis: dict[str, Any] = {"url": sec.get("redis_url") or rec.get("redis_url") or settings.redis.url}
    if "NEXTSTATE_REDIS__PREFIX" not in env and rec.get("prefix"):
        redis["prefix"] = rec["prefix"]
    update: dict[str, Any] = {"redis": settings.redis.model_copy(update=redis)}
    if "NEXTSTATE_RUN" not in env and rec.get("run"):
        update["run"] = rec["run"]
    bucket: dict[str, Any] = {}
    if "NEXTSTATE_BUCKET__ENDPOINT" not in env and (rec.get("bucket") or {}).get("endpoint"):
        bucket = {"endpoint": rec["bucket"]["endpoint"], "name": rec["bucket"].get("name", settings.bucket.name)}
        if sec.get("bucket_access_key") and sec.get("bucket_secret_key"):
            bucket.update(access_key=sec["bucket_access_key"], secret_key=SecretStr(sec["bucket_secret_key"]))
    if bucket:
        update["bucket"] = settings.bucket.model_copy(update=bucket)
    return settings.model_copy(update=update)


def redact(url: str) -> str:
    """`url` with its password (if any) replaced by `***`."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.netloc.rpartition("@")[0].partition(":")[0]
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def open_bus(args: argparse.Namespace) -> Bus:
    return Bus(settings_from(args))


def redis_error(exc: RedisError, settings: Settings) -> BusError:
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        return BusError(f"Redis at {settings.redis.url} did not answer ({exc}); is it running?")
    return BusError(f"Redis at {settings.redis.url} refused the command: {exc}")


def entry_time(entry_id: str) -> str:
    """Wall-clock time encoded in a stream entry id, as HH:MM:SS.mmm (local time)."""
    ms = int(entry_id.split("-", 1)[0])
    return dt.datetime.fromtimestamp(ms / 1000).strftime("%H:%M:%S.%f")[:-3]


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def since_to_id(since: str) -> str:
    """`--since`: an entry id (`1700000000000-0`), a bare ms timestamp, or an age (`5m`, `2h`)."""
    m = _DURATION.match(since)
    if m:
        ms = int((time.time() - float(m.group(1)) * _SECONDS[m.group(2)]) * 1000)
        return f"{ms}-0"
    if re.fullmatch(r"\d+(-\d+)?", since):
        return since
    raise argparse.ArgumentTypeError(f"--since takes an entry id or an age like 30s, 5m, 2h: {since!r}")


def human_ms(ms: int | None) -> str:
    if ms is None:
        return "-"
    s = ms / 1000
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{s / 60:.1f}m"
    return f"{s / 3600:.1f}h"
