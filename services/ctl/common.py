"""What every `nextstate` subcommand shares: settings from env + flags, a Bus, formatting."""

from __future__ import annotations

import argparse
import datetime as dt
import re
import time

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.errors import BusError
from shared.settings import Settings, load_settings
from shared.streams import Bus


def settings_from(args: argparse.Namespace) -> Settings:
    settings = load_settings(Settings)
    redis = settings.redis.model_copy(
        update={k: v for k, v in (("url", args.redis_url), ("prefix", args.prefix)) if v}
    )
    return settings.model_copy(update={"redis": redis})


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
