"""Output text: stop strings, trimming, and the stable text a stream may already show.

Follows SGLang: generation stops once the decoded output contains a stop string (the
first one, in the request's order, that occurs); `output_ids` keep every sampled token,
while `text` is cut where the stop string begins (unless `no_stop_trim`). A request
that ends on a stop token or EOS has `text` decoded without that last token.

A streamed chunk carries the cumulative text so far, and that text only ever grows:
it holds back a trailing partial UTF-8 character ("\ufffd") and any tail that could
still become a stop string, so the final, trimmed text always extends what was sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def decode(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool) -> str:
    if not ids:
        return ""
    return str(tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


def find_stop(text: str, stops: Sequence[str]) -> str | None:
    """The first stop string (in request order) that occurs in `text`."""
    for s in stops:
        if s in text:
            return s
    return None


def trim_at_stop(text: str, matched: str) -> str:
    pos = text.find(matched)
    return text[:pos] if pos >= 0 else text


def pending_stop_prefix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def stable_text(text: str, stops: Sequence[str], emitted: str) -> str:
    """What a stream may show now: `text` minus undecided tails, never shrinking `emitted`."""
    cut = len(text)
    while cut > 0 and text[cut - 1] == "\ufffd":
        cut -= 1
    cut -= pending_stop_prefix(text[:cut], stops)
    candidate = text[:cut]
    if candidate.startswith(emitted):
        return candidate
    return emitted
