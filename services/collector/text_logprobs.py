"""Which sampled tokens an answer's text came from: the Responses API's `output_text.logprobs`.

Chat Completions returns the log-prob of every sampled token (`logprobs.content`); the
Responses API ties them to the message's `output_text`, so the tokens of reasoning and of
tool-call markup must be left out. Each log-prob entry carries its token's exact UTF-8
`bytes` (openai_shapes.py), and laid end to end they are the sampled output. The parsed
deltas (shared/toolcalls.py's StreamParser: reasoning, text, tool calls) come in output
order, so each reasoning or text delta is found in those bytes after the previous one; a
text delta's log-probs are the entries of the tokens that overlap it, each token given
once (a token split between two deltas goes with the first). Tool-call deltas are not
searched for: their arguments are re-serialized JSON, not the sampled text.

A text delta that is not found as sampled (text the parser rewrote: a special token
dropped inside it) gets no entries, rather than guessed ones.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Any

from shared.toolcalls import ContentDelta, Delta, ReasoningDelta


class TextLogprobs:
    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.ends: list[int] = []  # byte offset where each entry's token ends
        self.raw = bytearray()
        self.cursor = 0  # the next delta is searched for from here
        self.given = 0  # entries before this one went to earlier text

    def add(self, entries: list[dict[str, Any]]) -> None:
        """The entries of the next sampled tokens, in order."""
        for e in entries:
            self.raw += bytes(e["bytes"])
            self.entries.append(e)
            self.ends.append(len(self.raw))

    def route(self, delta: Delta) -> list[dict[str, Any]]:
        """The entries of a text delta's tokens ([] for reasoning and tool calls, whose
        tokens are passed over)."""
        if isinstance(delta, ReasoningDelta):
            self._find(delta.text)
            return []
        if not isinstance(delta, ContentDelta):
            return []
        span = self._find(delta.text)
        if span is None:
            return []
        first = max(bisect_right(self.ends, span[0]), self.given)
        last = bisect_left(self.ends, span[1])  # the token holding the text's last byte
        out = self.entries[first : last + 1]
        self.given = max(self.given, last + 1)
        return out

    def _find(self, text: str) -> tuple[int, int] | None:
        """The byte span of `text` in the output after the previous delta."""
        if not text:
            return None
        b = text.encode()
        pos = self.raw.find(b, self.cursor)
        if pos < 0:
            return None
        self.cursor = pos + len(b)
        return pos, self.cursor


def text_logprobs(deltas: list[Delta], entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries of the text of a whole answer (its deltas, parsed in one go)."""
    lp = TextLogprobs()
    lp.add(entries)
    return [e for d in deltas for e in lp.route(d)]
