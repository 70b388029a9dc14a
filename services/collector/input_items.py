"""`GET /v1/responses/{id}/input_items`: the items a stored response was generated from.

A stored response keeps its conversation as internal chat messages (response_store.py):
everything before its answer, without the request's `instructions` — with
`previous_response_id`, the whole chain's items, as OpenAI lists them ("the items used to
generate this response"). Listed in OpenAI's shapes:

- a system / developer / user message -> a `message` item with one `input_text` part;
- an assistant message -> a `reasoning` item (when it has reasoning), a `message` item
  with one `output_text` part (when it has text) and a `function_call` per tool call;
- a tool message -> a `function_call_output`.

Computed when listed, so storing a response costs nothing more. What that gives up: the
text parts of one message come back joined into one part (as the model saw them), and an
item's `id` is not the one the client sent or saw in an earlier response's output but
`<kind>_<hash of the conversation up to that message>` (pairing.py's prefix hash). Ids are
stable — the same item has the same id in every response of a chain — so paging with
`after` works across calls.

The page is OpenAI's list: `object` "list", `data`, `first_id`, `last_id`, `has_more`;
query `limit` (1–100, default 20), `order` (`desc` by default, or `asc`), `after` (an item
id of this list: the page starts after it), `include` (OpenAI's includables, accepted:
stored input items carry no image URLs, search results or log-probs to add).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from services.collector.openai_shapes import ApiError
from services.collector.pairing import prefix_hashes
from services.collector.responses_request import split_name

INCLUDABLE = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs",
})  # fmt: skip
MAX_LIMIT = 100


def _parts(content: Any, kind: str) -> list[dict[str, Any]]:
    """A message's content as content parts of `kind` (input_text / output_text)."""
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, Mapping)]
    else:
        texts = ["" if content is None else str(content)]
    extra: dict[str, Any] = {"annotations": []} if kind == "output_text" else {}
    return [{"type": kind, "text": t, **extra} for t in texts]


def conversation_items(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as Responses items, oldest first."""
    out: list[dict[str, Any]] = []
    for m, h in zip(messages, prefix_hashes(messages), strict=True):
        tag = h.hex()
        role = m.get("role")
        if role == "tool":
            out.append({"id": f"fco_{tag}", "type": "function_call_output", "status": "completed",
                        "call_id": m.get("tool_call_id", ""), "output": m.get("content") or ""})  # fmt: skip
        elif role == "assistant":
            if m.get("reasoning_content"):
                out.append({"id": f"rs_{tag}", "type": "reasoning", "summary": [],
                            "content": [{"type": "reasoning_text", "text": m["reasoning_content"]}]})  # fmt: skip
            if m.get("content"):
                out.append({"id": f"msg_{tag}", "type": "message", "role": "assistant",
                            "status": "completed", "content": _parts(m["content"], "output_text")})  # fmt: skip
            for j, call in enumerate(m.get("tool_calls") or ()):
                fn = call.get("function") or {}
                name, namespace = split_name(str(fn.get("name", "")))
                item = {"id": f"fc_{tag}_{j}", "type": "function_call", "status": "completed",
                        "call_id": call.get("id", ""), "name": name,
                        "arguments": fn.get("arguments", "")}  # fmt: skip
                if namespace is not None:
                    item["namespace"] = namespace
                out.append(item)
        else:
            out.append({"id": f"msg_{tag}", "type": "message", "role": role, "status": "completed",
                        "content": _parts(m.get("content"), "input_text")})  # fmt: skip
    return out


def decimal(text: str) -> int | None:
    """`text` as a non-negative integer when it is ASCII digits only (str.isdigit also
    takes '²' and other digits int() refuses), else None."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def page_params(query: Mapping[str, str], includes: Sequence[str]) -> tuple[int, str, str | None]:
    """(limit, order, after) from the query string, each checked as OpenAI checks it."""
    raw = query.get("limit", "20")
    limit = decimal(raw.strip())
    if limit is None or not 1 <= limit <= MAX_LIMIT:
        raise _bad(f"Invalid 'limit': {raw[:40]!r}; an integer from 1 to {MAX_LIMIT}.", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise _bad(f"Invalid value for 'order': {order!r}; use 'asc' or 'desc'.", "order")
    for value in includes:
        if value not in INCLUDABLE:
            raise _bad(f"Invalid value for 'include': {value!r} is not one of "
                       f"{', '.join(sorted(INCLUDABLE))}.", "include")  # fmt: skip
    return limit, order, query.get("after") or None


def page(items: list[dict[str, Any]], limit: int, order: str, after: str | None) -> dict[str, Any]:
    """One page of `items` (oldest first) in OpenAI's list shape."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        start = next((i + 1 for i, item in enumerate(ordered) if item["id"] == after), -1)
        if start < 0:
            raise _bad(f"Invalid 'after': no input item with id {after!r} in this response.", "after")
    data = ordered[start : start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": start + limit < len(ordered)}  # fmt: skip
