"""OpenAI request messages -> the plain dicts chat templates expect, validated once.

Chat templates are Jinja programs written for HF's message format, which is close to
OpenAI's but not the same, and they fail in unhelpful ways (`None + str`, a silent
literal "None") on what OpenAI clients legitimately send. `normalize_messages` and
`normalize_tools` turn a request into that format, or raise `ChatTemplateError`
(a `MalformedMessage` and a `ValueError`) naming the offending message, so the
collector can answer 400. What they do:

- `role` must be one of system, developer, user, assistant, tool. `developer` (OpenAI's
  newer name for system instructions) becomes `system`; templates do not know it.
- `content` given as a list of parts becomes one string: text parts (`text`,
  `input_text`, `output_text`, and `refusal`) joined with "\\n"; bare strings in the
  list are taken as text. Any other part (images, audio, files) is rejected: the
  models served here read text only.
- `content: None` becomes "". A missing `content` is an error, except on an assistant
  message that carries `tool_calls`.
- `tool_calls[].function.arguments` given as a JSON string that decodes to an object
  becomes that dict (templates render it with `tojson` or read its keys); any other
  string (invalid JSON, or JSON that is not an object) is kept as given. A missing
  `type` becomes "function".
- Keys whose value is None are dropped (as transformers does); every other key is kept.
- `tools` must be a list of objects; an empty list means no tools (None).

The input is never mutated: every message and tool call is copied.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from shared.errors import MalformedMessage

ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PART_TYPES = ("text", "input_text", "output_text")
PART_SEPARATOR = "\n"


class ChatTemplateError(MalformedMessage, ValueError):
    """The messages cannot be rendered with this chat template: the request is wrong (400)."""


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages and return copies ready for a chat template."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatTemplateError("messages must be a list of message objects")
    if not messages:
        raise ChatTemplateError("messages is empty: send at least one message")
    return [_message(i, m) for i, m in enumerate(messages)]


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Validate the request's `tools`: a list of objects (copied), or None when empty."""
    if tools is None:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ChatTemplateError("tools must be a list of tool objects")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ChatTemplateError(f"tools[{i}] must be an object, got {type(tool).__name__}")
        out.append(dict(tool))
    return out or None


def _message(i: int, m: Any) -> dict[str, Any]:
    if not isinstance(m, Mapping):
        raise ChatTemplateError(f"messages[{i}] must be an object, got {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        raise ChatTemplateError(
            f"messages[{i}].role is {role!r}; expected one of {', '.join(ROLES)}"
        )
    out = {k: v for k, v in m.items() if v is not None}
    if role == "developer":
        out["role"] = "system"
    tool_calls = m.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise ChatTemplateError(f"messages[{i}] has tool_calls but role {role!r}")
        out["tool_calls"] = _tool_calls(i, tool_calls)
    if "content" not in m and not (role == "assistant" and tool_calls):
        raise ChatTemplateError(f"messages[{i}] ({role}) has no content")
    out["content"] = _content(i, m.get("content"))
    return out


def _content(i: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence) or isinstance(content, bytes):
        raise ChatTemplateError(
            f"messages[{i}].content must be a string or a list of parts, "
            f"got {type(content).__name__}"
        )
    texts: list[str] = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"messages[{i}].content[{j}] must be an object")
        kind = part.get("type", "text")
        key = "refusal" if kind == "refusal" else "text" if kind in TEXT_PART_TYPES else None
        if key is None:
            raise ChatTemplateError(
                f"messages[{i}].content[{j}] has type {kind!r}; this model reads text only"
            )
        text = part.get(key)
        if not isinstance(text, str):
            raise ChatTemplateError(f"messages[{i}].content[{j}].{key} must be a string")
        texts.append(text)
    return PART_SEPARATOR.join(texts)


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ChatTemplateError(f"messages[{i}].tool_calls must be a list")
    out: list[dict[str, Any]] = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise ChatTemplateError(f"{where} must be an object")
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            raise ChatTemplateError(f"{where}.function must be an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ChatTemplateError(f"{where}.function.name must be a non-empty string")
        fn_out = {k: v for k, v in fn.items() if v is not None}
        fn_out["arguments"] = _arguments(fn.get("arguments"))
        call_out = {k: v for k, v in call.items() if v is not None}
        call_out.setdefault("type", "function")
        call_out["function"] = fn_out
        out.append(call_out)
    return out


def _arguments(args: Any) -> Any:
    """A JSON-object string becomes a dict; anything else is kept as given (None -> {})."""
    if args is None:
        return {}
    if isinstance(args, str):
        try:
            decoded = json.loads(args)
        except (ValueError, RecursionError):
            return args
        return decoded if isinstance(decoded, dict) else args
    if isinstance(args, Mapping):
        return dict(args)
    return args
