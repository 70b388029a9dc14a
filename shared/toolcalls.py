"""Sampled text -> an OpenAI assistant message: content, reasoning, tool calls; whole or streamed.

    msg = parse_assistant(text, tools_enabled=True, parser="hermes", reasoning=True)
    message_dict(msg), finish_reason(msg, "stop")              # the response's choice

    sp = StreamParser(tools_enabled=True, parser="hermes", reasoning=True)
    for piece in engine_text_deltas: chunks += delta_dicts(sp.feed(piece))
    chunks += delta_dicts(sp.finish()); sp.message(); sp.finish_reason("stop")

The rules, identical for both paths (the concatenation of the streamed deltas equals
the whole-text parse, whatever the chunking):

- Reasoning (only with `reasoning=True`). If the output starts, after whitespace, with
  `<think>`, the text up to the first `</think>` (or to the end, if it never closes) is
  `reasoning_content`. `reasoning_open=True` says the prompt already opened `<think>`
  (see `prompt_opens_reasoning`): the output starts inside it. With the default
  `reasoning_open=None`, an output that does not start with `<think>` but contains
  `</think>` is taken to have started inside it; because that is only known once
  `</think>` arrives, the streaming parser then holds text back until it does (or the
  output ends): pass `reasoning_open` explicitly when streaming. Reasoning is stripped
  of surrounding whitespace; None when absent or empty.
- Tool calls (only with `tools_enabled=True`) are parsed from the text after the
  reasoning by the named parser (`shared.toolparsers`). A block whose body is
  malformed, or that never closes, stays in the content verbatim; nothing raises.
  Each call gets an id "call_" + 24 random alphanumerics.
- Content is the rest, text around and between calls included, stripped of leading
  and trailing newlines (the way Qwen-style templates write it back). None only when
  it is empty and there are tool calls.

Streaming holds back only text that may still be the start of a marker (a partial
`<tool_` or `</thi`), trailing newlines (which are dropped if nothing follows), and the
body of an open tool call: a call is emitted whole, once it closes, as one delta with
its index, id, type, name and complete arguments, because only then is it known to be
valid (a malformed call turns back into content). Everything else goes out as soon as
it arrives.

Markers that are special tokens. Engines decode the output skipping special tokens,
so a marker the tokenizer marks special (Mistral's `[TOOL_CALLS]`, Llama 3's
`<|python_tag|>`, `<tool_call>` or `<think>` when added as special) never reaches the
text. Then the output is decoded keeping special tokens (the engine's
`skip_special_tokens=False`) and `drop=SpecialText(...)` removes every other special
token's text before parsing: the text is a normal decode plus those markers.
`output_markers` names the markers a request's output is parsed for.
"""

from __future__ import annotations

import re
import secrets
import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shared.toolparsers import (
    ParsedCall,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
    tool_parser_names,
)

__all__ = [
    "AssistantMessage",
    "ContentDelta",
    "Delta",
    "FunctionCall",
    "ParsedCall",
    "ReasoningDelta",
    "SpecialText",
    "StreamParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "delta_dict",
    "delta_dicts",
    "finish_reason",
    "get_tool_parser",
    "message_dict",
    "new_call_id",
    "output_markers",
    "parse_assistant",
    "prompt_opens_reasoning",
    "register_tool_parser",
    "tool_parser_names",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CONTENT_TRIM = "\r\n"
REASONING_TRIM = " \t\r\n"
_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt ends inside an open `<think>` (the output starts in it)."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def output_markers(parser: str, *, tools_enabled: bool, reasoning: bool) -> tuple[str, ...]:
    """The markers a request's output is parsed for: its tool calls' (when tools are
    enabled) and the reasoning ones (when reasoning is parsed)."""
    out: list[str] = []
    if tools_enabled:
        tp = get_tool_parser(parser)
        out += [tp.start] + ([tp.end] if tp.end else [])
    if reasoning:
        out += [THINK_OPEN, THINK_CLOSE]
    return tuple(out)


class SpecialText:
    """Removes given special-token texts from sampled text, whole or streamed alike."""

    def __init__(self, texts: Iterable[str]) -> None:
        words = sorted({t for t in texts if t}, key=len, reverse=True)  # longest wins
        self._rx = re.compile("|".join(map(re.escape, words))) if words else None
        self._starts = {w[:k] for w in words for k in range(1, len(w))}
        self._longest = max(map(len, words), default=0)

    def remove(self, text: str) -> str:
        return text if self._rx is None else self._rx.sub("", text)

    def stream(self) -> _SpecialTextStream:
        return _SpecialTextStream(self)

    def _split(self, buf: str) -> int:
        """Where `buf` stops being certain: the start of its longest end that may still
        become a special token, or of a match reaching into that end."""
        cut = len(buf)
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            if buf[-k:] in self._starts:
                cut = len(buf) - k
                break
        if self._rx is not None and cut < len(buf):
            for m in self._rx.finditer(buf):
                if m.start() < cut < m.end():
                    return m.start()
        return cut


class _SpecialTextStream:
    def __init__(self, special: SpecialText) -> None:
        self._special = special
        self._held = ""

    def feed(self, text: str) -> str:
        buf = self._held + text
        cut = self._special._split(buf)
        self._held = buf[cut:]
        return self._special.remove(buf[:cut])

    def finish(self) -> str:
        out, self._held = self._special.remove(self._held), ""
        return out


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str  # JSON object text


@dataclass(frozen=True)
class ToolCall:
    id: str
    function: FunctionCall
    type: str = "function"

    def to_dict(self) -> dict[str, Any]:
        fn = {"name": self.function.name, "arguments": self.function.arguments}
        return {"id": self.id, "type": self.type, "function": fn}


@dataclass(frozen=True)
class AssistantMessage:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    id: str | None
    name: str | None
    arguments: str


Delta = ContentDelta | ReasoningDelta | ToolCallDelta


def _message(content: str, reasoning: str | None, calls: list[ToolCall]) -> AssistantMessage:
    return AssistantMessage(
        content=content if content or not calls else None,
        reasoning_content=reasoning or None,
        tool_calls=calls,
    )


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=new_call_id(), function=FunctionCall(call.name, call.arguments))


def parse_assistant(
    text: str,
    *,
    tools_enabled: bool,
    parser: str = "hermes",
    reasoning: bool = False,
    reasoning_open: bool | None = None,
    drop: SpecialText | None = None,
) -> AssistantMessage:
    """The whole sampled text as an assistant message (rules in the module docstring)."""
    if drop is not None:
        text = drop.remove(text)
    tp = get_tool_parser(parser) if tools_enabled else None
    reasoning_text: str | None = None
    rest = text
    if reasoning:
        lead = text.lstrip()
        if reasoning_open is not True and lead.startswith(THINK_OPEN):
            body = lead[len(THINK_OPEN) :]
            i = body.find(THINK_CLOSE)
            reasoning_text, rest = (body, "") if i < 0 else (body[:i], body[i + len(THINK_CLOSE) :])
        elif reasoning_open is not False:
            i = text.find(THINK_CLOSE)
            if i >= 0:
                reasoning_text, rest = text[:i], text[i + len(THINK_CLOSE) :]
            elif reasoning_open:
                reasoning_text, rest = text, ""
    parts: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while tp is not None:
        i = rest.find(tp.start, pos)
        if i < 0:
            break
        body_at = i + len(tp.start)
        if tp.end is None:
            j, after = len(rest), len(rest)
        else:
            j = rest.find(tp.end, body_at)
            if j < 0:
                break  # unterminated: the rest is content
            after = j + len(tp.end)
        parts.append(rest[pos:i])
        parsed = tp.parse(rest[body_at:j])
        if parsed is None:
            parts.append(rest[i:after])
        else:
            calls.extend(_tool_call(c) for c in parsed)
        pos = after
    parts.append(rest[pos:])
    reasoning_out = None if reasoning_text is None else reasoning_text.strip(REASONING_TRIM)
    return _message("".join(parts).strip(CONTENT_TRIM), reasoning_out, calls)


class _Trim:
    """Streams text with `chars` stripped from both ends of the whole stream."""

    def __init__(self, chars: str) -> None:
        self.chars = chars
        self.started = False
        self.held = ""

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip(self.chars)
            if not text:
                return ""
            self.started = True
        text = self.held + text
        core = text.rstrip(self.chars)
        self.held = text[len(core) :]
        return core


def _partial(buf: str, marker: str) -> int:
    """Length of the longest end of `buf` that is a proper start of `marker`."""
    for k in range(min(len(buf), len(marker) - 1), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


_START, _UNDECIDED, _REASONING, _CONTENT, _CALL = range(5)


class StreamParser:
    """Incremental `parse_assistant`: feed text deltas, get OpenAI-shaped deltas back."""

    def __init__(
        self,
        tools_enabled: bool,
        parser: str = "hermes",
        reasoning: bool = False,
        reasoning_open: bool | None = None,
        drop: SpecialText | None = None,
    ) -> None:
        self._tp = get_tool_parser(parser) if tools_enabled else None
        self._drop = None if drop is None else drop.stream()
        self._auto = reasoning_open is None
        self._state = _CONTENT if not reasoning else _REASONING if reasoning_open else _START
        self._buf = ""
        self._scan = 0  # where the next search for a closing marker may start
        self._content = _Trim(CONTENT_TRIM)
        self._reasoning = _Trim(REASONING_TRIM)
        self._content_parts: list[str] = []
        self._reasoning_parts: list[str] = []
        self._calls: list[ToolCall] = []
        self._finished = False

    def feed(self, text: str) -> list[Delta]:
        """Deltas that `text` (the next piece of sampled text) makes certain."""
        if self._finished:
            raise RuntimeError("StreamParser.feed after finish")
        self._buf += text if self._drop is None else self._drop.feed(text)
        out: list[Delta] = []
        self._run(out, final=False)
        return out

    def finish(self) -> list[Delta]:
        """The deltas still held back, once the output has ended."""
        if self._finished:
            return []
        if self._drop is not None:
            self._buf += self._drop.finish()
        out: list[Delta] = []
        self._run(out, final=True)
        self._finished = True
        return out

    def message(self) -> AssistantMessage:
        """Everything emitted so far, as one message (the same tool-call ids)."""
        content = "".join(self._content_parts)
        return _message(content, "".join(self._reasoning_parts), list(self._calls))

    def finish_reason(self, engine_reason: str | None = "stop") -> str:
        return "tool_calls" if self._calls else engine_reason or "stop"

    # -- the state machine -------------------------------------------------------------

    def _run(self, out: list[Delta], final: bool) -> None:
        while True:
            state, buf = self._state, self._buf
            if state == _START:
                lead = buf.lstrip()
                if lead.startswith(THINK_OPEN):
                    self._buf, self._state = lead[len(THINK_OPEN) :], _REASONING
                elif THINK_OPEN.startswith(lead) and not final:
                    return
                else:
                    self._state = _UNDECIDED if self._auto else _CONTENT
            elif state == _UNDECIDED:
                i = buf.find(THINK_CLOSE, self._scan)
                if i >= 0:
                    self._emit_reasoning(buf[:i], out)
                    self._buf, self._state, self._scan = buf[i + len(THINK_CLOSE) :], _CONTENT, 0
                elif final:
                    self._state = _CONTENT
                else:
                    self._scan = max(0, len(buf) - len(THINK_CLOSE) + 1)
                    return
            elif state == _REASONING:
                i = buf.find(THINK_CLOSE)
                if i >= 0:
                    self._emit_reasoning(buf[:i], out)
                    self._buf, self._state = buf[i + len(THINK_CLOSE) :], _CONTENT
                    continue
                keep = 0 if final else _partial(buf, THINK_CLOSE)
                self._emit_reasoning(buf[: len(buf) - keep], out)
                self._buf = buf[len(buf) - keep :]
                return
            elif state == _CONTENT:
                tp = self._tp
                i = -1 if tp is None else buf.find(tp.start)
                if tp is not None and i >= 0:
                    self._emit_content(buf[:i], out)
                    self._buf, self._state, self._scan = buf[i + len(tp.start) :], _CALL, 0
                    continue
                keep = 0 if final or tp is None else _partial(buf, tp.start)
                self._emit_content(buf[: len(buf) - keep], out)
                self._buf = buf[len(buf) - keep :]
                return
            else:  # _CALL
                if not self._in_call(out, final):
                    return

    def _in_call(self, out: list[Delta], final: bool) -> bool:
        """Close the open call if its end is here; False when it must wait for more text."""
        tp, buf = self._tp, self._buf
        assert tp is not None
        if tp.end is None:
            if not final:
                return False
            body, end, rest = buf, "", ""
        else:
            i = buf.find(tp.end, self._scan)
            if i < 0:
                if final:  # never closed: it was text
                    self._emit_content(tp.start + buf, out)
                    self._buf, self._state = "", _CONTENT
                    return True
                self._scan = max(0, len(buf) - len(tp.end) + 1)
                return False
            body, end, rest = buf[:i], tp.end, buf[i + len(tp.end) :]
        parsed = tp.parse(body)
        if parsed is None:
            self._emit_content(tp.start + body + end, out)
        else:
            for call in parsed:
                tc = _tool_call(call)
                out.append(ToolCallDelta(len(self._calls), tc.id, call.name, call.arguments))
                self._calls.append(tc)
        self._buf, self._state, self._scan = rest, _CONTENT, 0
        return True

    def _emit_content(self, text: str, out: list[Delta]) -> None:
        text = self._content.push(text)
        if text:
            self._content_parts.append(text)
            out.append(ContentDelta(text))

    def _emit_reasoning(self, text: str, out: list[Delta]) -> None:
        text = self._reasoning.push(text)
        if text:
            self._reasoning_parts.append(text)
            out.append(ReasoningDelta(text))


# -- OpenAI shapes -------------------------------------------------------------------------


def message_dict(msg: AssistantMessage) -> dict[str, Any]:
    """The response's `choices[0].message`."""
    out: dict[str, Any] = {"role": "assistant", "content": msg.content}
    if msg.reasoning_content is not None:
        out["reasoning_content"] = msg.reasoning_content
    if msg.tool_calls:
        out["tool_calls"] = [tc.to_dict() for tc in msg.tool_calls]
    return out


def finish_reason(msg: AssistantMessage, engine_reason: str | None = "stop") -> str:
    """`tool_calls` when the message has calls, else the engine's reason ("stop", "length")."""
    return "tool_calls" if msg.tool_calls else engine_reason or "stop"


def delta_dict(delta: Delta) -> dict[str, Any]:
    """One streaming `choices[0].delta`."""
    if isinstance(delta, ContentDelta):
        return {"content": delta.text}
    if isinstance(delta, ReasoningDelta):
        return {"reasoning_content": delta.text}
    call: dict[str, Any] = {"index": delta.index}
    fn: dict[str, Any] = {}
    if delta.id is not None:
        call["id"] = delta.id
        call["type"] = "function"
    if delta.name is not None:
        fn["name"] = delta.name
    fn["arguments"] = delta.arguments
    call["function"] = fn
    return {"tool_calls": [call]}


def delta_dicts(deltas: list[Delta]) -> list[dict[str, Any]]:
    """`delta_dict` for each, with adjacent content (or reasoning) deltas merged into one."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        key = "content" if isinstance(d, ContentDelta) else "reasoning_content"
        if not isinstance(d, ToolCallDelta) and out and set(out[-1]) == {key}:
            out[-1][key] += d.text
        else:
            out.append(delta_dict(d))
    return out
