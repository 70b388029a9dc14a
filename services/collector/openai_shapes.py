"""OpenAI's wire shapes: the errors, the completion, the stream chunks, the model list.

Kept byte-cheap: responses are plain dicts serialized once with `json.dumps`, so the
official SDKs parse them as OpenAI's own. Errors always have OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`, which the SDKs turn into their
usual exceptions (AuthenticationError, BadRequestError, APIStatusError, …).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from shared.errors import NextstateError

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(NextstateError):
    """An error answered to the client in OpenAI's shape (status, message, param, code)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        kind: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}  # fmt: skip

    def json_bytes(self) -> bytes:
        return dumps(self.body())


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def completion(
    cid: str, created: int, model: str, message: dict[str, Any], finish_reason: str,
    prompt_tokens: int, completion_tokens: int, fingerprint: str,
) -> dict[str, Any]:
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        ],
        "usage": usage(prompt_tokens, completion_tokens),
    }


class ChunkWriter:
    """Server-sent events of one streamed completion: `data: {chunk}\\n\\n`, then `[DONE]`."""

    def __init__(self, cid: str, created: int, model: str, fingerprint: str) -> None:
        self.id = cid
        head = {"id": cid, "object": "chat.completion.chunk", "created": created,
                "model": model, "system_fingerprint": fingerprint}  # fmt: skip
        # Every chunk shares this prefix; only the choices (or usage) differ.
        self._head = json.dumps(head, ensure_ascii=False, separators=(",", ":"))[:-1]

    def _event(self, tail: dict[str, Any]) -> bytes:
        body = json.dumps(tail, ensure_ascii=False, separators=(",", ":"))
        return b"data: " + (self._head + "," + body[1:]).encode() + b"\n\n"

    def delta(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._event({"choices": [choice]})

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return self._event({"choices": [], "usage": usage(prompt_tokens, completion_tokens)})

    @staticmethod
    def error(err: ApiError) -> bytes:
        return b"data: " + err.json_bytes() + b"\n\n"

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"


def model_list(name: str, owned_by: str = "nextstate") -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": int(time.time()), "owned_by": owned_by}],
    }
