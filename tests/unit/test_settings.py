"""Settings: environment parsing, errors that name the variable, no default secrets in prod."""

from __future__ import annotations

import pytest

from shared.errors import SettingsError
from shared.settings import Settings, load_settings


def test_defaults_load(monkeypatch: pytest.MonkeyPatch) -> None:
    s = load_settings(Settings)
    assert s.redis.prefix == "nextstate" and s.bucket.name == "nextstate" and s.run == "default"


def test_nested_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXTSTATE_REDIS__URL", "redis://r:1/2")
    monkeypatch.setenv("NEXTSTATE_REDIS__PREFIX", "exp")
    monkeypatch.setenv("NEXTSTATE_BUCKET__ENDPOINT", "minio:9000")
    monkeypatch.setenv("NEXTSTATE_BUCKET__SECURE", "true")
    monkeypatch.setenv("NEXTSTATE_RUN", "exp-1")
    s = load_settings(Settings)
    assert (s.redis.url, s.redis.prefix, s.bucket.endpoint, s.bucket.secure, s.run) == (
        "redis://r:1/2", "exp", "minio:9000", True, "exp-1")


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("NEXTSTATE_REDIS__URL", "http://nope"),
        ("NEXTSTATE_BUCKET__ENDPOINT", "http://minio:9000"),
        ("NEXTSTATE_BUCKET__NAME", "Bad_Name"),
        ("NEXTSTATE_STREAMS__MAXLEN", "lots"),
        ("NEXTSTATE_RUN", "has space"),
        ("NEXTSTATE_LOG__LEVEL", "LOUD"),
    ],
)
def test_invalid_value_names_variable(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError, match=var):
        load_settings(Settings)


def test_prod_refuses_default_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXTSTATE_ENV", "prod")
    with pytest.raises(SettingsError, match="NEXTSTATE_INTERNAL__TOKEN is not set"):
        load_settings(Settings)  # a service without a bucket (collector, judge) needs no keys
    monkeypatch.setenv("NEXTSTATE_BUCKET__ENDPOINT", "minio:9000")  # one that uses the bucket does
    with pytest.raises(SettingsError, match="NEXTSTATE_BUCKET__ACCESS_KEY"):
        load_settings(Settings)
    monkeypatch.setenv("NEXTSTATE_BUCKET__ACCESS_KEY", "real")
    with pytest.raises(SettingsError, match="NEXTSTATE_BUCKET__SECRET_KEY"):
        load_settings(Settings)
    monkeypatch.setenv("NEXTSTATE_BUCKET__SECRET_KEY", "real-secret")
    with pytest.raises(SettingsError, match="NEXTSTATE_INTERNAL__TOKEN is not set"):
        load_settings(Settings)
    monkeypatch.setenv("NEXTSTATE_INTERNAL__TOKEN", "a-real-internal-token-0123")
    assert load_settings(Settings).env == "prod"


def test_secret_not_in_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXTSTATE_BUCKET__SECRET_KEY", "hunter2")
    assert "hunter2" not in repr(load_settings(Settings))
