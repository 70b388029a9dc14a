"""Reading judge answers: the last `\\boxed{…}`, how votes become a reward, the OPD hint.

Pure functions, no I/O, so the rules that decide a reward are tested exhaustively:

- `last_boxed(text)`: the content of the LAST `\\boxed{…}` (braces balanced, so
  `\\boxed{\\text{-1}}` works); None when there is none.
- `parse_score(text, scale)`: that content as a score, None when unparsable — including
  when the last box holds something else: an earlier box never stands in for the last
  one. Spacing, `+`, a unicode minus, `\\text{}` and `$…$` are tolerated. By scale
  (`NEXTSTATE_JUDGE__SCORES`):
    label        -1, 0 or 1 (`1.0` and `-0` too); anything else is unparsable
    graded       a decimal number in [-1, 1] (`0.4`, `-.25`, `1`) taken as it is
    probability  a decimal number p in [0, 1] (the chance the step made progress),
                 mapped to 2p - 1 (so 0.5 -> 0, 1 -> 1, 0 -> -1); outside [0, 1]: unparsable
  No exponents, fractions or percentages: a box that is not a plain number is unparsable.
- `majority(scores, threshold)`: the label whose share of the valid (parsed) votes is
  strictly more than half (threshold None, the default), or at least `threshold`
  (e.g. 0.6: 3 of 5); no such label, several, or no valid vote -> 0 (`winning_label`
  says None then: the votes are undecided, which the collapse alarm counts).
- `mean_score(scores)`: graded and probability votes: the mean of the valid ones
  (0 when none is valid); a threshold does not apply to them.
- `extract_hint(text)`: the text between the last `[HINT_START]` and the `[HINT_END]`
  after it, whitespace collapsed.
- `extract_lessons(text, n, chars)`: experiential learning's lessons, one per line
  between the last `[EXPERIENCE_START]` and the `[EXPERIENCE_END]` after it (bullets and
  numbering dropped, trivial lines skipped, duplicates once, at most n, each cut at
  `chars`); None when the markers are not there (unparsable), [] when nothing is between.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Literal

Score = Literal[-1, 0, 1]  # a label
ScoreScale = Literal["label", "graded", "probability"]

HINT_START = "[HINT_START]"
HINT_END = "[HINT_END]"
EXPERIENCE_START = "[EXPERIENCE_START]"
EXPERIENCE_END = "[EXPERIENCE_END]"

_BOXED = re.compile(r"\\boxed\s*\{")
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}")
_NUMBER = re.compile(r"^([+-]?)\s*([01])(?:\.0*)?$")
_DECIMAL = re.compile(r"^([+-]?)\s*(\d+(?:\.\d*)?|\.\d+)$")
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


def _box_value(text: str) -> str | None:
    """The last box's content, unwrapped and normalised (minus signs, `$`, spaces)."""
    content = last_boxed(text)
    if content is None:
        return None
    value = content.translate(_MINUSES)
    prev = None
    while prev != value:  # unwrap \text{...} (possibly nested)
        prev, value = value, _WRAPPERS.sub(r"\1", value)
    return value.replace("$", "").strip()


def parse_label(text: str) -> Score | None:
    """The judge's verdict in `text` as a label (-1, 0, 1), or None when it cannot be read."""
    value = _box_value(text)
    m = _NUMBER.match(value) if value is not None else None
    if m is None:
        return None
    sign, digit = m.groups()
    if digit == "0":
        return 0
    return -1 if sign == "-" else 1


def parse_decimal(text: str) -> float | None:
    """The last box as a plain decimal number (sign allowed), or None."""
    value = _box_value(text)
    m = _DECIMAL.match(value) if value is not None else None
    if m is None:
        return None
    sign, digits = m.groups()
    number = float(digits)
    return -number if sign == "-" else number


def parse_score(text: str, scale: ScoreScale = "label") -> float | None:
    """The judge's score in `text` on `scale`, in [-1, 1]; None when it cannot be read."""
    if scale == "label":
        label = parse_label(text)
        return None if label is None else label
    number = parse_decimal(text)
    if number is None:
        return None
    if scale == "graded":
        return number + 0.0 if -1.0 <= number <= 1.0 else None  # + 0.0: no -0.0
    if not 0.0 <= number <= 1.0:
        return None
    return round(2.0 * number - 1.0, 12)  # 0.8 -> 0.6, not 0.6000000000000001


def winning_label(scores: Iterable[float | None], threshold: float | None = None) -> Score | None:
    """The label holding strictly more than half of the valid votes (`threshold` None) or
    at least `threshold` of them; None when no label (or more than one) does, or none is
    valid: the votes are *undecided* (a tie, or nothing readable)."""
    counts = Counter(s for s in scores if s is not None)
    valid = sum(counts.values())
    if not valid:
        return None
    if threshold is None:
        winners = [label for label, n in counts.items() if 2 * n > valid]
    else:  # a tolerance, so that 3 of 5 reaches 0.6 despite float rounding
        winners = [label for label, n in counts.items() if n / valid >= threshold - 1e-9]
    if len(winners) != 1:
        return None
    label = winners[0]
    return 1 if label == 1 else -1 if label == -1 else 0


def majority(scores: Iterable[float | None], threshold: float | None = None) -> Score:
    """The winning label (`winning_label`); 0 when the votes are undecided."""
    label = winning_label(scores, threshold)
    return 0 if label is None else label


def mean_score(scores: Iterable[float | None]) -> float:
    """The mean of the valid graded scores, in [-1, 1]; 0 when none is valid."""
    valid = [s for s in scores if s is not None]
    return sum(valid) / len(valid) if valid else 0.0


def aggregate(scores: Sequence[float | None], scale: ScoreScale, threshold: float | None) -> float:
    """How m votes become the reward: labels by `majority`, graded scores by `mean_score`."""
    if scale == "label":
        return majority(scores, threshold)
    return mean_score(scores)


def unanimous(scores: Iterable[float | None]) -> bool:
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


_BULLET = re.compile(r"^\s*(?:[-*\u2022]+|\d{1,2}[.)])\s*")


def cut_words(text: str, limit: int) -> str:
    """`text` cut at `limit` characters, at a word boundary when there is one."""
    if len(text) <= limit:
        return text
    cut = text[: limit + 1]  # a space right after the limit keeps the last word whole
    return cut[: cut.rfind(" ")].rstrip() if " " in cut else cut[:limit]


def extract_lessons(text: str, max_lessons: int, max_chars: int) -> list[str] | None:
    """The lessons between the last EXPERIENCE_START and the EXPERIENCE_END after it."""
    start = text.rfind(EXPERIENCE_START)
    if start < 0:
        return None
    body_start = start + len(EXPERIENCE_START)
    end = text.find(EXPERIENCE_END, body_start)
    if end < 0:
        return None
    lessons: list[str] = []
    seen: set[str] = set()
    for line in text[body_start:end].splitlines():
        lesson = cut_words(" ".join(_BULLET.sub("", line).split()), max_chars)
        if len(lesson) < 8 or not re.search(r"[^\W\d_]{2,}", lesson) or lesson.lower() in seen:
            continue
        seen.add(lesson.lower())
        lessons.append(lesson)
        if len(lessons) == max_lessons:
            break
    return lessons
