"""Settings shared by every service: pydantic-settings, `NEXTSTATE_` prefix, `__` nesting.

Each service subclasses `Settings` and adds its own group, so one environment
configures the whole stack:

    NEXTSTATE_ENV=prod
    NEXTSTATE_RUN=exp1
    NEXTSTATE_REDIS__URL=redis://judge:<password>@redis:6379/0   (prod: a password is required)
    NEXTSTATE_REDIS__PREFIX=nextstate
    NEXTSTATE_BUCKET__ENDPOINT=minio:9000
    NEXTSTATE_BUCKET__ACCESS_KEY=...   NEXTSTATE_BUCKET__SECRET_KEY=...
    NEXTSTATE_INTERNAL__TOKEN=...      the credential of every internal endpoint (shared/auth.py)
    NEXTSTATE_COLLECTOR__PORT=8000     (a service's own group)

`load_settings` turns validation errors into one `SettingsError` whose message names
each offending variable, so a service fails at start and says what to fix.
"""

from __future__ import annotations

import re
from typing import Any, Literal, TypeVar
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.errors import SettingsError

ENV_PREFIX = "NEXTSTATE_"
DEV_BUCKET_KEYS = ("minioadmin", "minioadmin")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_TOKEN = re.compile(r"[!-~]{16,}")


class RedisSettings(BaseModel):
    # Redis: streams, pending turns, counters (prod: with the service's ACL user's password).
    url: str = "redis://127.0.0.1:6379/0"
    # The prefix of every stream and key (shared/keys.py).
    prefix: str = "nextstate"
    connect_timeout: float = Field(2.0, gt=0, description="seconds to connect")
    socket_timeout: float = Field(5.0, gt=0, description="seconds a command may take")
    # Commands beyond this many connections wait (up to socket_timeout) for a free one.
    max_connections: int = Field(128, ge=2)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return v

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}", v):
            raise ValueError("letters, digits and _ . : - only (at most 64)")
        return v


class StreamSettings(BaseModel):
    """How the stream bus behaves; the same for every stream unless a service overrides it."""

    maxlen: int = Field(100_000, ge=10, description="over this many entries, publish sheds")
    max_deliveries: int = Field(5, ge=1, description="then the entry goes to the dead stream")
    claim_idle_ms: int = Field(30_000, ge=100, description="reclaim others' entries idle this long")
    retry_delay_ms: int = Field(1_000, ge=0, description="retry a failed entry after this long")
    block_ms: int = Field(1_000, ge=1, description="longest wait of one read for new entries")
    read_count: int = Field(64, ge=1, description="entries asked for per read")
    # After a short read, wait this long before the next one so entries arrive in
    # batches: far fewer round trips per message under load, a few ms of latency.
    linger_ms: int = Field(10, ge=0)
    dedupe_ttl_s: int = Field(7 * 24 * 3600, ge=60, description="how long a handled message id is remembered")
    shutdown_grace_s: float = Field(
        10.0, ge=0, description="on SIGTERM, in-flight handlers may finish this long; the rest is handed back")


class BucketSettings(BaseModel):
    # The S3 server's host:port (MinIO, SeaweedFS, AWS).
    endpoint: str = "127.0.0.1:9000"
    # The service's S3 credentials (the development default is refused when NEXTSTATE_ENV=prod).
    access_key: str = DEV_BUCKET_KEYS[0]
    secret_key: SecretStr = SecretStr(DEV_BUCKET_KEYS[1])
    name: str = "nextstate"
    # https
    secure: bool = False
    # Set, clients never ask the bucket for its location (which the narrow roles may not).
    region: str | None = None
    timeout: float = Field(30.0, gt=0, description="seconds per S3 call")

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if "://" in v or "/" in v:
            raise ValueError("host:port only, without scheme or path (use secure for https)")
        return v

    @field_validator("name")
    @classmethod
    def _bucket_name(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", v):
            raise ValueError("S3 bucket names are 3-63 lowercase letters, digits, '.' or '-'")
        return v


class LogSettings(BaseModel):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # json: one JSON object per line, for log pipelines.
    format: Literal["text", "json"] = "text"
    # Conversation text never appears in logs unless this is set (and then only at DEBUG).
    log_content: bool = False

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v


class InternalSettings(BaseModel):
    """The one credential of the closed control plane (shared/auth.py).

    Every internal endpoint (engine, buffer, ops ports) requires `Authorization: Bearer
    <token>` and every client in the stack sends it. None: no authentication, allowed
    outside prod only. `metrics_public`: /metrics answers without it (scrapers that
    cannot send a bearer token); /healthz, /health and /readyz are always open.
    """

    token: SecretStr | None = None
    # /metrics answers without the token (for scrapers that cannot send one).
    metrics_public: bool = False

    @field_validator("token", mode="before")
    @classmethod
    def _empty_is_unset(cls, v: Any) -> Any:
        return None if isinstance(v, str) and not v.strip() else v

    @field_validator("token")
    @classmethod
    def _token(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not _TOKEN.fullmatch(v.get_secret_value()):
            raise ValueError(
                "at least 16 printable ASCII characters without spaces "
                "(e.g. the output of `openssl rand -hex 32`)"
            )
        return v

    def secret(self) -> str | None:
        """The token's value, for a client to send (never log it)."""
        return self.token.get_secret_value() if self.token is not None else None


class Settings(BaseSettings):
    """What every service needs. Services subclass this and add their own group."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="ignore",
        validate_default=True,
    )

    # prod refuses development defaults: bucket keys, a Redis URL without a password, no
    # internal token, a collector without API keys.
    env: Literal["dev", "test", "prod"] = "dev"
    # The run's name: its versions live under policies/<run>/; one base model per run.
    run: str = "default"
    redis: RedisSettings = RedisSettings()
    streams: StreamSettings = StreamSettings()
    bucket: BucketSettings = BucketSettings()
    log: LogSettings = LogSettings()
    internal: InternalSettings = InternalSettings()

    @field_validator("run")
    @classmethod
    def _run(cls, v: str) -> str:
        if not _NAME.fullmatch(v):
            raise ValueError("letters, digits and _ . - only (at most 64)")
        return v

    @model_validator(mode="after")
    def _no_default_secrets_in_prod(self) -> Settings:
        if self.env == "prod":
            # A service that never sets the URL (the engine) does not use Redis.
            if "url" in self.redis.model_fields_set and not redis_url_has_password(self.redis.url):
                raise ValueError(
                    "NEXTSTATE_REDIS__URL carries no password; Redis requires one when "
                    "NEXTSTATE_ENV=prod: redis://<user>:<password>@host:port/db, with the "
                    "service's own ACL user (services/ctl/redis_acl.py)"
                )
            # Likewise a service that configures no bucket does not use one (collector, judge).
            bucket_used = "bucket" in self.model_fields_set
            if bucket_used and self.bucket.access_key == DEV_BUCKET_KEYS[0]:
                raise ValueError(
                    "NEXTSTATE_BUCKET__ACCESS_KEY is the development default; "
                    "set real credentials when NEXTSTATE_ENV=prod"
                )
            if bucket_used and self.bucket.secret_key.get_secret_value() == DEV_BUCKET_KEYS[1]:
                raise ValueError(
                    "NEXTSTATE_BUCKET__SECRET_KEY is the development default; "
                    "set real credentials when NEXTSTATE_ENV=prod"
                )
            if self.internal.token is None:
                raise ValueError(
                    "NEXTSTATE_INTERNAL__TOKEN is not set: every internal endpoint (engine, "
                    "buffer, ops ports) requires it when NEXTSTATE_ENV=prod; set the same random "
                    "value (e.g. `openssl rand -hex 32`) for every service"
                )
        return self


def redis_url_has_password(url: str) -> bool:
    """Whether a redis:// (rediss://, unix://) URL authenticates: a password in its user
    part (`redis://user:pw@host`) or its query (`unix:///redis.sock?password=pw`)."""
    parts = urlsplit(url)
    return bool(parts.password) or any(v for v in parse_qs(parts.query).get("password", []))


S = TypeVar("S", bound=BaseSettings)


def env_var_name(loc: tuple[int | str, ...]) -> str:
    """`("bucket", "endpoint")` -> `NEXTSTATE_BUCKET__ENDPOINT`."""
    return ENV_PREFIX + "__".join(str(part).upper() for part in loc)


def load_settings(cls: type[S], **overrides: Any) -> S:
    """Build `cls` from the environment; any invalid value raises one `SettingsError`."""
    try:
        return cls(**overrides)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = tuple(err.get("loc", ()))
            where = env_var_name(loc) if loc else "settings"
            msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            lines.append(f"{where}: {msg}")
        raise SettingsError("invalid configuration:\n  " + "\n  ".join(lines)) from None
