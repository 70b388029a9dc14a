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

Client text in a rendering (for `shared.chat`, which tokenizes what the client wrote as
plain text so that it can never spell the template's control tokens):

- `client_strings` lists every string of a normalized request: contents, names,
  tool-call arguments (keys and values), tool results, tool definitions, ids. Message
  roles are not client text: they are validated above, and templates build markers
  from them (Phi-3 writes `'<|' + role + '|>'`).
- `ControlText.find` picks those that spell a control token, or its start (at their
  end) or its end (at their start). A string that is a strict middle part of a
  control token is not picked: that would take a template that spells a token's two
  ends around a client string, which no template known here does.
- `mask_client_strings` replaces the strings a predicate picks with unique sentinels
  (ASCII letters and digits, unchanged by `tojson`, `trim` and the like).
- `locate_client_text` aligns the template's rendering of the masked request with its
  rendering of the real one: the masked rendering is template pieces between
  sentinels, and the real one must be the same pieces around each string as the
  template wrote it (verbatim, trimmed, or JSON-escaped). The answer is the character
  spans of those strings. Where a template rewrites a string some other way (e.g. a
  reasoning template splitting content at `</think>`), the whole stretch between the
  last piece aligned from the left and the last aligned from the right counts as
  client text: control tokens in it become plain text too, never the other way.
"""

from __future__ import annotations

import bisect
import itertools
import json
import re
import secrets
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
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


# -- client text in a rendering ------------------------------------------------------------


def client_strings(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[str]:
    """Every string in a normalized request (dict keys included) except message roles."""
    out: list[str] = []
    for m in messages:
        for k, v in m.items():
            out.append(k)
            if k != "role":
                _strings(v, out)
    if tools:
        _strings(tools, out)
    return out


def _strings(obj: Any, out: list[str]) -> None:
    if isinstance(obj, str):
        out.append(obj)
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _strings(k, out)
            _strings(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _strings(v, out)


class ControlText:
    """Finds the client strings that spell a control token's text, end with the start of
    one or start with the end of one (and so could complete one with the text next to
    them); also in their normalized form, given the tokenizer's `normalize` when it
    matches control tokens after normalization. One scan of all the strings, joined."""

    def __init__(
        self, controls: Iterable[str], normalize: Callable[[str], str] | None = None
    ) -> None:
        words = {c for c in controls if c and "\x00" not in c}
        suffixes = {c[k:] for c in words for k in range(1, len(c))}
        # Over the strings joined and wrapped by "\x00": a word, or a word's start then
        # "\x00"; and "\x00" then a word's end. Two patterns, as each begins with one of
        # a few characters, which `re` scans for fast (one alternation scans 5x slower).
        parts = [_trie_regex(_trie(words), "\x00")] if words else []
        if suffixes:
            parts.append("\x00" + _trie_regex(_trie(suffixes), ""))
        self._patterns = [re.compile(p) for p in parts]
        self._normalize = normalize

    def find(self, strings: list[str]) -> set[str]:
        out: set[str] = set()
        for forms in (
            strings,
            None if self._normalize is None else list(map(self._normalize, strings)),
        ):
            if forms is None:
                continue
            joined = "\x00" + "\x00".join(forms) + "\x00"
            if not any(rx.search(joined) for rx in self._patterns):
                continue
            starts = list(itertools.accumulate((len(f) + 1 for f in forms), initial=1))
            for rx in self._patterns:  # a match starts inside its string or at the \x00 before
                for m in rx.finditer(joined):
                    out.add(strings[bisect.bisect_right(starts, m.start() + 1) - 1])
        return out


def _trie(words: Iterable[str]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for w in words:
        node = root
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}
    return root


def _trie_regex(node: dict[str, Any], stop: str, root: bool = True) -> str:
    """A regex for the words of a trie (compact: shared prefixes once); with `stop`, a
    proper prefix of a word followed by `stop` matches too."""
    if "" in node and not root:
        return ""
    parts = [re.escape(ch) + _trie_regex(child, stop, False) for ch, child in sorted(node.items())]
    if stop and not root:
        parts.append(re.escape(stop))
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


@dataclass(frozen=True)
class MaskedRequest:
    """A request with some client strings replaced by sentinels (`originals[i]` is sentinel i)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    originals: list[str]
    sentinel: re.Pattern[str]  # group 1: the index into originals


def mask_client_strings(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    pick: Callable[[str], bool],
    avoid: str,
) -> MaskedRequest:
    """Copies of `messages` and `tools` with every client string `pick` selects replaced
    by a sentinel that occurs nowhere in `avoid` (the real rendering)."""
    while True:
        nonce = "zx" + "".join(secrets.choice(string.ascii_lowercase) for _ in range(12)) + "q"
        if nonce not in avoid:
            break
    originals: list[str] = []

    def sub(s: str) -> str:
        if not pick(s):
            return s
        originals.append(s)
        return f"{nonce}{len(originals) - 1}q"

    def walk(obj: Any) -> Any:
        if isinstance(obj, str):
            return sub(obj)
        if isinstance(obj, Mapping):
            return {sub(k) if isinstance(k, str) else k: walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [walk(v) for v in obj]
        return obj

    masked = [{sub(k): v if k == "role" else walk(v) for k, v in m.items()} for m in messages]
    masked_tools = None if tools is None else [walk(t) for t in tools]
    return MaskedRequest(masked, masked_tools, originals, re.compile(re.escape(nonce) + r"(\d+)q"))


def locate_client_text(text: str, masked_text: str, masked: MaskedRequest) -> list[tuple[int, int]]:
    """Character spans of `text` (the real rendering) that hold the masked strings, given
    `masked_text` (the rendering of `masked`); sorted, disjoint, non-empty."""
    pieces: list[str] = []
    which: list[str] = []
    pos = 0
    for m in masked.sentinel.finditer(masked_text):
        pieces.append(masked_text[pos : m.start()])
        which.append(masked.originals[int(m.group(1))])
        pos = m.end()
    pieces.append(masked_text[pos:])
    spans: list[tuple[int, int]] = []
    # From the left: piece 0, then each string as the template wrote it and the next piece.
    if text.startswith(pieces[0]):
        p, i = len(pieces[0]), 0
        while i < len(which):
            after = pieces[i + 1]
            x = next((x for x in _written(which[i]) if text.startswith(x, p)
                      and text.startswith(after, p + len(x))), None)  # fmt: skip
            if x is None:
                break
            spans.append((p, p + len(x)))
            p, i = p + len(x) + len(after), i + 1
        if i == len(which) and p == len(text):
            return _merged(spans)
    else:
        p, i = _common_prefix(text, pieces[0]), 0
    # From the right, down to the first string the left pass could not place.
    q, j = len(text), len(which) - 1
    if text.endswith(pieces[-1]) and len(text) - len(pieces[-1]) >= p:
        q -= len(pieces[-1])
        while j >= i:
            before = pieces[j] if j > i else ""
            x = next((x for x in _written(which[j]) if text.endswith(x, 0, q)
                      and text.endswith(before, 0, q - len(x))), None)  # fmt: skip
            if x is None or q - len(x) - len(before) < p:
                break
            spans.append((q - len(x), q))
            q, j = q - len(x) - len(before), j - 1
    else:
        q = max(p, len(text) - _common_prefix(text[::-1], pieces[-1][::-1]))
    spans.append((p, q))
    return _merged(spans)


def _written(s: str) -> list[str]:
    """The ways templates write a string: as is, trimmed, or inside a JSON string."""
    forms = [
        s, s.strip(), s.lstrip(), s.rstrip(), s.strip("\n"), s.lstrip("\n"), s.rstrip("\n"),
        json.dumps(s, ensure_ascii=False)[1:-1], json.dumps(s)[1:-1],
    ]  # fmt: skip
    return list(dict.fromkeys(forms))


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
