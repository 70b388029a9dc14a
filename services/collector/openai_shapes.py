"""OpenAI's wire shapes: the errors, the completion, the stream chunks, the model list,
and token log-probs.

Kept byte-cheap: responses are plain dicts serialized once with `json.dumps`, so the
official SDKs parse them as OpenAI's own. Errors always have OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`, which the SDKs turn into their
usual exceptions (AuthenticationError, BadRequestError, NotFoundError, APIStatusError, …).

Log-probs (`logprobs: true`) are OpenAI's `choices[].logprobs.content[]`: per sampled
token its text, log-prob, UTF-8 `bytes` and `top_logprobs[]` (each with token, logprob,
bytes). A token that is not valid UTF-8 on its own (part of a multi-byte character) is
shown as `"bytes:\\xe2\\x80"`, as OpenAI does; its `bytes` are exact, so joining the
bytes of every entry gives the text. The log-probs are the engine's: log_softmax(logits
/ T) over the full vocabulary, the values captured for training.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

import orjson

from shared.errors import NextstateError

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
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
    """Compact UTF-8 JSON (orjson: a few times faster than json.dumps on a response body)."""
    return orjson.dumps(obj)


def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def choice(
    index: int, message: dict[str, Any], finish_reason: str, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_of(
    cid: str, created: int, model: str, choices: list[dict[str, Any]], prompt_tokens: int,
    completion_tokens: int, fingerprint: str,
) -> dict[str, Any]:  # fmt: skip
    """A chat completion with these choices; usage counts the prompt once and every
    choice's tokens, as OpenAI does for n > 1."""
    return {
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }


def completion(
    cid: str, created: int, model: str, message: dict[str, Any], finish_reason: str,
    prompt_tokens: int, completion_tokens: int, fingerprint: str,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return completion_of(cid, created, model, [choice(0, message, finish_reason, logprobs)],
                         prompt_tokens, completion_tokens, fingerprint)  # fmt: skip


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

    def delta(
        self, delta: dict[str, Any], finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:  # fmt: skip
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._event({"choices": [choice]})

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return self._event({"choices": [], "usage": usage(prompt_tokens, completion_tokens)})

    @staticmethod
    def error(err: ApiError) -> bytes:
        return b"data: " + err.json_bytes() + b"\n\n"

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"


def model_card(name: str, context_length: int | None, owned_by: str = "nextstate") -> dict[str, Any]:
    """The served model as OpenAI lists it, with its context window as vLLM (`max_model_len`)
    and OpenRouter / LM Studio (`context_length`) report it, when known."""
    card: dict[str, Any] = {"id": name, "object": "model", "created": int(time.time()), "owned_by": owned_by}
    if context_length is not None:
        card["max_model_len"] = card["context_length"] = context_length
    return card


def model_list(name: str, context_length: int | None = None) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(name, context_length)]}


# -- token log-probs ------------------------------------------------------------------------------


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE uses -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_DECODER = _byte_decoder()
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece byte-fallback pieces


class TokenPieces:
    """Token id -> (text, UTF-8 bytes) as OpenAI reports them, cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {}) or {}}
        self._byte_level = self._is_byte_level(tokenizer)

    @staticmethod
    def _is_byte_level(tokenizer: Any) -> bool:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return False
        try:
            decoder = json.loads(backend.to_str()).get("decoder")
        except (ValueError, AttributeError):
            return False
        return '"ByteLevel"' in json.dumps(decoder)

    def raw(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if not isinstance(piece, str):
            return b""
        if token_id in self._added:
            return piece.encode()
        if self._byte_level and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        m = _BYTE_FALLBACK.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self.raw(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, list(raw))
        return hit


def logprob_content(
    pieces: TokenPieces, ids: Sequence[int], logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[int, float]]], top_n: int,
) -> list[dict[str, Any]]:  # fmt: skip
    """OpenAI's `logprobs.content` entries for sampled tokens (and their top alternatives)."""
    out = []
    for k, (tid, lp) in enumerate(zip(ids, logprobs, strict=True)):
        text, raw = pieces.piece(tid)
        alts = []
        for alt_id, alt_lp in list(top[k])[:top_n] if k < len(top) else []:
            alt_text, alt_raw = pieces.piece(alt_id)
            alts.append({"token": alt_text, "logprob": alt_lp, "bytes": alt_raw})
        out.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alts})
    return out
