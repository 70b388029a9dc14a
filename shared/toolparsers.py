"""Tool-call formats: how a model writes a call in its output, one parser per format.

A format here is a start marker, an optional end marker (None: the call runs to the end
of the output) and `parse(body)`, which turns the text between them into calls, or
None when the body is malformed: the caller then keeps the whole block as plain
content. `shared.toolcalls` does the scanning, whole or streamed, so a parser never
sees partial text and never has to deal with the text around its calls.

    @register_tool_parser("myformat")
    class MyParser(ToolParser):
        start = "<call>"
        end = "</call>"
        def parse(self, body: str) -> list[ParsedCall] | None: ...

Built in:
- `hermes` (Qwen, Hermes, and the test tokenizer):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one call per block.
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` objects, or the
  newer `[TOOL_CALLS]name[ARGS]{...}` form (repeated for several calls), to the end.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

__all__ = [
    "ParsedCall",
    "ToolParser",
    "get_tool_parser",
    "register_tool_parser",
    "tool_parser_names",
]


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


class ToolParser(ABC):
    """One tool-call format. Subclasses set `start` and `end` and implement `parse`."""

    name: ClassVar[str] = ""
    start: ClassVar[str]
    end: ClassVar[str | None]

    @abstractmethod
    def parse(self, body: str) -> list[ParsedCall] | None:
        """The calls written in `body` (the text between the markers), or None if malformed."""


P = TypeVar("P", bound=type[ToolParser])
_REGISTRY: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[P], P]:
    """Class decorator: make a `ToolParser` available as `get_tool_parser(name)`."""

    def deco(cls: P) -> P:
        if not cls.start:
            raise ValueError(f"tool parser {name!r} needs a non-empty start marker")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"a tool parser named {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def get_tool_parser(name: str) -> ToolParser:
    """A parser instance by name; `ValueError` naming the known ones if there is none."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(tool_parser_names())}")
    return cls()


def tool_parser_names() -> list[str]:
    return sorted(_REGISTRY)


def call_from_object(obj: Any) -> ParsedCall | None:
    """`{"name": str, "arguments"|"parameters": object or JSON-object text}` -> a call."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = arguments_json(args)
    return None if arguments is None else ParsedCall(name.strip(), arguments)


def arguments_json(args: Any) -> str | None:
    """Arguments as JSON-object text: a dict is serialized, a string must decode to one."""
    if isinstance(args, dict):
        return json.dumps(args, ensure_ascii=False)
    if isinstance(args, str):
        decoded = loads(args)
        return args.strip() if isinstance(decoded, dict) else None
    return None


def loads(text: str) -> Any:
    """`json.loads`, or None for anything that is not valid JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


@register_tool_parser("hermes")
class HermesParser(ToolParser):
    start = "<tool_call>"
    end = "</tool_call>"

    def parse(self, body: str) -> list[ParsedCall] | None:
        call = call_from_object(loads(body.strip()))
        return None if call is None else [call]


@register_tool_parser("mistral")
class MistralParser(ToolParser):
    start = "[TOOL_CALLS]"
    end = None

    def parse(self, body: str) -> list[ParsedCall] | None:
        text = body.strip()
        if text.startswith(("[", "{")):
            obj = loads(text)
            objs = obj if isinstance(obj, list) else [obj]
            calls = [call_from_object(o) for o in objs]
        else:  # name[ARGS]{...}, several calls separated by [TOOL_CALLS]
            calls = []
            for part in text.split(self.start):
                name, sep, args = part.partition("[ARGS]")
                arguments = arguments_json(args) if sep and name.strip() else None
                calls.append(None if arguments is None else ParsedCall(name.strip(), arguments))
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]
