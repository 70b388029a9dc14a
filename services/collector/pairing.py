"""Which earlier response a request follows up: canonical messages and chained prefix hashes.

Agents resend the whole conversation on every call, so a response is followed up by the
first later request whose messages start with the conversation up to and including that
response. Each message is reduced to a canonical form that survives what OpenAI clients
do to a history when they send it back:

- kept: the role (`developer` counts as `system`), the text content with surrounding
  whitespace stripped (None, "", a missing content and a list of text parts all reduce to
  text), and each tool call's function name and arguments *as parsed JSON* (key order and
  spacing do not matter; arguments that are not JSON count as their stripped text);
- dropped: every other field — `name`, `refusal`, `reasoning_content` (templates and
  clients drop or keep it inconsistently), `audio`, and the ids of tool calls together
  with `tool_call_id`. The ids are random tokens minted per response; frameworks that
  convert between message formats regenerate or omit them, while the order of the tool
  messages already ties each result to its call. Two histories that differ only in call
  ids are the same conversation here.

`prefix_hashes(messages)[k]` is a chained blake2b over the canonical forms of the first
k + 1 messages: h(k) = H(h(k-1) ‖ canonical(message k)). A pending turn is stored under
the hash of its request's messages followed by its response message; a later request
finds it by looking at the hashes of its prefixes that end on an assistant message.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_SEED = b"nextstate/pairing/v1"
_DIGEST = 16


def _args(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value.strip()
    return value


def canonical(message: Mapping[str, Any]) -> bytes:
    """The bytes of a normalized message (see `shared.chat_messages`) that pairing compares."""
    role = message.get("role")
    if role == "developer":
        role = "system"
    content = message.get("content")
    text = content.strip() if isinstance(content, str) else "" if content is None else content
    out: list[Any] = [role, text]
    for call in message.get("tool_calls") or ():
        fn = call.get("function") if isinstance(call, Mapping) else None
        fn = fn if isinstance(fn, Mapping) else {}
        out.append([fn.get("name"), _args(fn.get("arguments"))])
    return json.dumps(out, ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode()


def chain(prev: bytes, message: Mapping[str, Any]) -> bytes:
    return hashlib.blake2b(prev + canonical(message), digest_size=_DIGEST).digest()


def prefix_hashes(messages: Sequence[Mapping[str, Any]]) -> list[bytes]:
    """out[k] is the hash of messages[: k + 1]."""
    out: list[bytes] = []
    h = _SEED
    for m in messages:
        h = chain(h, m)
        out.append(h)
    return out


def response_hash(prefix: Sequence[bytes], response: Mapping[str, Any]) -> str:
    """The key of a pending turn: its request's messages, then its response message."""
    return chain(prefix[-1] if prefix else _SEED, response).hex()


@dataclass(frozen=True, slots=True)
class Candidate:
    """A prefix of the request that ends on an assistant message: maybe a pending turn."""

    end: int  # number of messages in the prefix (the assistant message is end - 1)
    key: str  # hex hash of that prefix


def candidates(
    messages: Sequence[Mapping[str, Any]], hashes: Sequence[bytes], limit: int
) -> list[Candidate]:
    """Prefixes ending on an assistant message, the latest `limit` of them, oldest first."""
    ends = [i + 1 for i, m in enumerate(messages) if m.get("role") == "assistant"]
    return [Candidate(end, hashes[end - 1].hex()) for end in ends[-limit:]]


def next_state(messages: Sequence[dict[str, Any]], end: int) -> list[dict[str, Any]]:
    """What follows the response that closes prefix `end`: messages up to the next
    assistant message, or to the end of the request (the user's reply, or tool results)."""
    out: list[dict[str, Any]] = []
    for m in messages[end:]:
        if m.get("role") == "assistant":
            break
        out.append(m)
    return out
