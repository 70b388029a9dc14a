"""No bad input ever gets a 5xx: the three APIs fuzzed from the collector's own OpenAPI
document (/openapi.json) with schemathesis (hypothesis underneath), against a real
collector process in front of the engine stand-in (a real HTTP server with SGLang's
API: what is fuzzed is the collector's edge, not a model).

Every operation gets requests that fit the schema and requests that do not (wrong types,
missing fields, out-of-range numbers, odd strings). For each answer: no 5xx, an answer
within the timeout (no hang), every error in its API's shape (Anthropic's on
/v1/messages, OpenAI's elsewhere), and every stream ending the way its API ends one (its
final event, or an error event in its shape). Deterministic (derandomized), about a
minute here.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis import GenerationMode

from services.collector.openapi import document
from tests.support.collector_harness import StandIn, collector_process

pytestmark = pytest.mark.integration

KEY = "fuzz-key"
SESSION = requests.Session()
EXAMPLES = 30  # per operation and mode: ~60 requests each, ~1 min in all here


@pytest.fixture(scope="module")
def collector_url(tiny_tokenizer: Path, redis_url: str) -> Iterator[str]:
    standin = StandIn(args=["--tokenizer", str(tiny_tokenizer), "--latency-ms", "1"]).start()
    env = {"NEXTSTATE_ENV": "test", "NEXTSTATE_REDIS__URL": redis_url,
           "NEXTSTATE_REDIS__PREFIX": f"t-{uuid.uuid4().hex[:10]}"}  # fmt: skip
    proc, url = collector_process(env, standin.url, api_keys=KEY, context_length=512,
                                  engine_timeout_s=10)  # fmt: skip
    try:
        proc.wait_http(url + "/healthz", timeout=120)
        yield url
    finally:
        rc = proc.stop()
        standin.stop()
    assert rc == 0, proc.logs()


def test_the_served_document_is_the_one_fuzzed(collector_url: str) -> None:
    served = requests.get(collector_url + "/openapi.json", timeout=30)
    assert served.status_code == 200 and served.json() == json.loads(json.dumps(document()))


schema = schemathesis.openapi.from_dict(document())
# The key is right: what is fuzzed is what comes after authentication (tests/integration/test_auth.py
# covers keys).
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                with_security_parameters=False)


def _openai_error(body: Any) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
            and "param" in err and "code" in err)  # fmt: skip


def _anthropic_error(body: Any) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(body, dict) and body.get("type") == "error" and isinstance(err, dict)
            and isinstance(err.get("type"), str) and isinstance(err.get("message"), str))  # fmt: skip


def _events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event."""
    out = []
    for block in text.split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            out.append((name, "\n".join(data)))
    return out


def check_stream(path: str, text: str) -> None:
    events = _events(text)
    assert events, f"an empty stream from {path}"
    name, data = events[-1]
    if path.endswith("/chat/completions"):
        if data == "[DONE]":
            return
        assert _openai_error(json.loads(data)), f"the stream ended without [DONE] or an error: {data[:300]}"
    elif path.endswith("/responses"):
        last = json.loads(data)
        if last.get("type") == "error":
            assert isinstance(last.get("message"), str) and "code" in last, last
        else:
            assert last.get("type") in ("response.completed", "response.incomplete"), last
    else:
        last = json.loads(data)
        if name == "error":
            assert _anthropic_error(last), last
        else:
            assert last.get("type") == "message_stop", last


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
def test_no_input_gets_a_5xx_and_every_error_has_its_apis_shape(case: Any, collector_url: str) -> None:
    headers = {"authorization": f"Bearer {KEY}", "x-api-key": KEY}
    # Sent by requests itself: schemathesis's own call keeps only the first part of a stream.
    kwargs = case.as_transport_kwargs(base_url=collector_url, headers=headers)
    try:
        response = SESSION.request(**kwargs, timeout=30)
    except requests.Timeout:
        pytest.fail(f"no answer within 30 s: {case.method} {case.path} {str(case.body)[:300]}")
    status = response.status_code
    assert status < 500, f"{status} for {case.method} {case.path}: {response.text[:500]} <- {str(case.body)[:500]}"
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert status == 200
        try:
            check_stream(case.path, response.text)
        except AssertionError as exc:
            raise AssertionError(f"{exc} <- {json.dumps(case.body)[:1500]}") from None
        return
    body = response.json()
    if status >= 400:
        anthropic = case.path.startswith("/v1/messages") or (
            case.path.startswith("/v1/models") and "anthropic-version" in (case.headers or {}))  # fmt: skip
        shaped = _anthropic_error(body) if anthropic else _openai_error(body)
        assert shaped, f"{status} not in its API's error shape: {response.text[:500]}"
