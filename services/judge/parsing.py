"""Reading judge answers: the last `\\boxed{…}`, the majority of votes, the OPD hint.

Pure functions, no I/O, so the rules that decide a reward are tested exhaustively:

- `last_boxed(text)`: the content of the LAST `\\boxed{…}` (braces balanced, so
  `\\boxed{\\text{-1}}` works); None when there is none.
- `parse_score(text)`: that content as -1, 0 or 1 (spacing, `+1`, a unicode minus,
  `\\text{}`, `$…$`, `1.0` tolerated); None when unparsable — including when the last box
  holds something else: an earlier box never stands in for the last one.
- `majority(scores)`: the value with strictly the most valid votes; a tie between the
  top values, or no valid vote, gives 0.
- `extract_hint(text)`: the text between the last `[HINT_START]` and the `[HINT_END]`
  after it, whitespace collapsed.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Literal

Score = Literal[-1, 0, 1]

HINT_START = "[HINT_START]"
HINT_END = "[HINT_END]"

_BOXED = re.compile(r"\\boxed\s*\{")
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}")
_NUMBER = re.compile(r"^([+-]?)\s*([01])(?:\.0*)?$")
_MINUSES = str.maketrans({"−": "-", "–": "-", "—": "-", "﹣": "-", "－": "-"})


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}`; None if there is none or it never closes."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    depth, start = 1, matches[-1].end()
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None  # unclosed (the answer was cut off): no earlier box stands in for it


def parse_score(text: str) -> Score | None:
    """The judge's verdict in `text` (-1, 0, 1), or None when it cannot be read."""
    content = last_boxed(text)
    if content is None:
        return None
    value = content.translate(_MINUSES)
    prev = None
    while prev != value:  # unwrap \text{...} (possibly nested)
        prev, value = value, _WRAPPERS.sub(r"\1", value)
    value = value.replace("$", "").strip()
    m = _NUMBER.match(value)
    if m is None:
        return None
    sign, digit = m.groups()
    if digit == "0":
        return 0
    return -1 if sign == "-" else 1


def majority(scores: Iterable[Score | None]) -> Score:
    """Strictly the most common valid score; a tie at the top or no valid score -> 0."""
    counts = Counter(s for s in scores if s is not None)
    if not counts:
        return 0
    ranked = counts.most_common()
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return 0
    return ranked[0][0]


def unanimous(scores: Iterable[Score | None]) -> bool:
    """Whether every valid score agrees (vacuously true for fewer than two)."""
    return len({s for s in scores if s is not None}) <= 1


def extract_hint(text: str) -> str | None:
    """The hint between the last HINT_START and the HINT_END after it, or None."""
    start = text.rfind(HINT_START)
    if start < 0:
        return None
    body_start = start + len(HINT_START)
    end = text.find(HINT_END, body_start)
    if end < 0:
        return None
    hint = " ".join(text[body_start:end].split())
    return hint or None


def accepted_hint(hint: str | None, min_chars: int, max_chars: int) -> str | None:
    """A hint worth a teacher prompt: non-trivial (>= min_chars, has a word), cut at max_chars."""
    if hint is None or len(hint) < min_chars or not re.search(r"[^\W\d_]{2,}", hint):
        return None
    if len(hint) > max_chars:
        cut = hint[:max_chars]
        hint = cut[: cut.rfind(" ")] if " " in cut else cut
    return hint
