"""Responses API objects kept in Redis: `GET /v1/responses/{id}` and `previous_response_id`.

A response created with `store` (OpenAI's default: true) is kept under
`P:response:<id>` (shared/keys.py) for `responses_ttl_s`, as one JSON record: the
response object as the client received it, and the conversation it ended — the
internal chat messages up to and including its answer, without the request's
`instructions` (as at OpenAI, a follow-up's own instructions replace them). A follow-up
naming it as `previous_response_id` continues that conversation, so its prompt is the
same one a client resending the whole history would get, and its pending turn pairs.

The write rides with the turn's capture in one Redis round trip (capture.py): with its
pending record, or with its emission when the request ends the session. A turn that is
not captured (a side turn) or not captured in Redis (capture spooling through an
outage) has it written on its own. Either way the write is done before the response
goes out, so once a client holds a stored response, a follow-up on any replica finds
it (a collector killed after writing and before answering leaves a response nobody
received, which expires). On the request path Redis gets `redis_timeout_s`, as
everywhere in the collector. A write that fails is logged and counted and the response
still goes out; a later `previous_response_id` naming it is then a 404 that says what
may have happened and what to do (resend the conversation). A read that fails is a 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from services.collector import metrics as M
from services.collector.openai_shapes import ApiError, dumps
from services.collector.pending_store import KeyValue
from shared.keys import Keys

log = logging.getLogger(__name__)

FAILURES = (RedisError, OSError, asyncio.TimeoutError)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation, its answer last (no instructions)


@dataclass(frozen=True, slots=True)
class StoredWrite:
    """One response to keep: `item` rides with the turn's pending write (capture.py), or
    `done(False)` writes it on its own."""

    store: ResponseStore
    item: KeyValue
    response_id: str

    async def done(self, written: bool) -> None:
        if written:
            self.store.stored()
        else:
            await self.store.write(self)


class ResponseStore:
    def __init__(self, redis: Any, keys: Keys, ttl_s: float, timeout_s: float) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_ms = max(1000, int(ttl_s * 1000))
        self.timeout = timeout_s
        self._failing = False  # warn once per outage, not once per request

    def prepare(self, response: dict[str, Any], messages: list[dict[str, Any]],
                body: bytes | None = None) -> StoredWrite:  # fmt: skip
        """The write keeping `response` (`body`: its JSON, when already serialized for the
        client) and its conversation."""
        raw = dumps(response) if body is None else body
        record = b'{"response":' + raw + b',"messages":' + dumps(messages) + b"}"
        return StoredWrite(self, (self.keys.stored_response(response["id"]), record, self.ttl_ms),
                           response["id"])  # fmt: skip

    async def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        """Keep a response now, on its own; never raises (a failure is logged and counted)."""
        await self.write(self.prepare(response, messages))

    def stored(self) -> None:
        M.STORED_RESPONSES.labels("stored").inc()
        self._failing = False

    async def write(self, w: StoredWrite) -> None:
        key, record, px = w.item
        try:
            async with asyncio.timeout(self.timeout):
                await self.redis.set(key, record, px=px)
            self.stored()
        except FAILURES as exc:
            M.STORED_RESPONSES.labels("failed").inc()
            (log.debug if self._failing else log.warning)(
                "could not store a response (%s): previous_response_id will not find it",
                type(exc).__name__, extra={"response_id": w.response_id})  # fmt: skip
            self._failing = True

    async def get(self, response_id: str) -> StoredResponse | None:
        raw = await self._call(self.redis.get(self.keys.stored_response(response_id)))
        if raw is None:
            return None
        d = json.loads(raw)
        return StoredResponse(d["response"], d["messages"])

    async def delete(self, response_id: str) -> bool:
        return bool(await self._call(self.redis.delete(self.keys.stored_response(response_id))))

    async def _call(self, op: Any) -> Any:
        try:
            async with asyncio.timeout(self.timeout):
                return await op
        except FAILURES as exc:
            log.warning("the response store did not answer: %s", type(exc).__name__)
            raise ApiError(503, "stored responses are unavailable right now; retry later",
                           code="store_unavailable", kind="server_error") from None  # fmt: skip
