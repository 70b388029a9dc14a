"""Which pending turn a request follows up: the exact prefix rule, then anchors that survive
what agents do to the histories they resend.

A response is continued by a later request that holds it as an assistant message. Each
message is reduced to a canonical form that survives what clients do to a history when
they send it back:

- kept: the role (`developer` counts as `system`), the text content with surrounding
  whitespace stripped (None, "", a missing content and a list of text parts all reduce to
  text), and each tool call's function name and arguments *as parsed JSON* (key order and
  spacing do not matter; arguments that are not JSON count as their stripped text);
- dropped: every other field — `name`, `refusal`, `reasoning_content` (templates and
  clients drop or keep it inconsistently), `audio`, and the ids of tool calls together
  with `tool_call_id`. The ids are random tokens minted per response; frameworks that
  convert between message formats regenerate or omit them, while the order of the tool
  messages already ties each result to its call.

Two rules, tried in this order in the one Redis round trip of a request (pending_store.py):

1. **Prefix** (exact). `prefix_hashes(messages)[k]` is a chained blake2b over the
   canonical forms of the first k + 1 messages. A pending turn is stored under the hash of
   its request's messages followed by its response; a request closes the pending turn of
   every prefix of it that ends on an assistant message (the latest
   `max_pairing_candidates`). This pairs every client that resends its history as it
   was, branches (a request continuing an older response), and the turns stored before
   anchors existed (an upgrade keeps every pending turn). Two sessions that sent the very
   same conversation and got the very same answer hold one hash: their turns are kept
   apart and neither is paired (pending_store.py), where an earlier version let the
   second overwrite the first and gave it to whichever follow-up came first.

2. **Anchors** (tolerant), for the request's *last* assistant message only, and only
   when the prefix rule knows nothing of it (no pending turn and no lineage under its
   prefix hash). Let a request's *block* be its non-system messages after its last
   assistant message (the user's message or the tool results, and whatever the agent
   appended to them), the block's *head* its first message, and *P* that last assistant
   message (the previous response; none on a first turn). A pending turn registers, for
   its response *a*:

   - `history`: every non-system message up to and including the head, then a;
   - `exchange`: P, the head, a;
   - `answer`: one message of the block, a — one anchor for each message of the block;
   - `previous`: P, a.

   A follow-up computes the same anchors for its last assistant message from its own
   messages (its `answer` anchors from each message between that response and the
   assistant message before it, nearest first) and tries them strongest first. The
   first anchor that any turn registered decides: registered by one turn, that turn is
   closed with this request's next state (or, already closed, its session carries over);
   registered by several, the request pairs with none of them (refused as ambiguous).

What each rewrite keeps, and so which anchor pairs it:

- (a) an agent that appends messages after the user's message and drops or replaces them
  in the history it resends (OpenClaw's trailing internal-context user message): the head
  and everything before it stay — `history`;
- (b) a system prompt that changes between turns (a date, a status line): no anchor
  holds a system message — `history`;
- (c) compaction (older history summarised, the last exchange kept): `exchange` while P
  is kept, else `answer` (the user's message, now after the summary, and a);
- (d) a resend after a retry: an identical resend pairs by prefix; one that rewrote the
  head (OpenClaw prefixes it with "[Retry after the previous model attempt failed or
  timed out]") pairs by `previous`.

What it trades:

- Messages after the head and system messages are in no anchor, so two pending turns
  that differ only there are one here: refused as ambiguous if both registered — the
  prefix rule still tells them apart when the agent resends its history unchanged.
- Ambiguity is counted over every turn that registered the anchor in the anchor's
  lifetime (the pending TTL + its grace, as the lineage), closed ones too: a session
  whose later follow-up would otherwise find another session's live turn with the same
  exchange is refused instead. The cost: sessions that share an exchange within that
  window (identical greetings at temperature 0; a repeated tool poll once compaction has
  dropped the history) pair only by prefix.
- An anchor whose messages hold fewer than `pairing_min_anchor_chars` bytes of text and
  tool calls is neither registered nor tried: "yes" -> "OK" identifies nothing. With
  a session id (`X-Session-Id`, `session_id`, or the agent's own: sessions.py) or a
  `user`, anchors are scoped to it and need no minimum (that turn pairs only with a
  request of the same scope); a scope that holds several conversations refuses an anchor
  two of them registered, as everywhere.
- Only the last assistant message is anchored: an agent that continues an older response
  *and* rewrites its history is not paired.
- Each pending turn writes 3 or more anchor keys (about 100 bytes each in Redis) that
  live as long as its lineage. `NEXTSTATE_COLLECTOR__PAIRING=prefix` turns anchors off.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_SEED = b"nextstate/pairing/v1"
_DIGEST = 16
# Each anchor kind hashes in its own domain (blake2b's personalization, up to 16 bytes).
HISTORY, EXCHANGE, ANSWER, PREVIOUS = "history", "exchange", "answer", "previous"
RULES = ("prefix", HISTORY, EXCHANGE, ANSWER, PREVIOUS)  # what a pairing can be made by
_PERSON = {kind: f"ns/anchor/{kind[:4]}".encode() for kind in (HISTORY, EXCHANGE, ANSWER, PREVIOUS)}


def _args(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            return value.strip()
    return value


def _canon(message: Mapping[str, Any]) -> tuple[bytes, int]:
    """The canonical bytes of a message and its weight: the bytes its text and tool calls
    add to the canonical form of an empty message of its role (what an anchor's minimum
    counts)."""
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
    data = json.dumps(out, ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode()
    return data, len(data) - _FRAME.get(str(role), 0)


# the canonical form of an empty message of each role: ["user",""]
_FRAME = {r: len(json.dumps([r, ""], separators=(",", ":"))) for r in ("system", "user", "assistant", "tool")}


def canonical(message: Mapping[str, Any]) -> bytes:
    """The bytes of a normalized message (see `shared.chat_messages`) that pairing compares."""
    return _canon(message)[0]


def chain(prev: bytes, message: Mapping[str, Any]) -> bytes:
    return _chain(prev, canonical(message))


def _chain(prev: bytes, canon: bytes) -> bytes:
    return hashlib.blake2b(prev + canon, digest_size=_DIGEST).digest()


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


# -- anchors -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Conversation:
    """A request's messages reduced once for both rules (one canonical form per message)."""

    hashes: list[bytes]  # prefix rule: hashes[k] is the hash of messages[: k + 1]
    # the non-system messages, in order: (index in the request, canonical form, weight,
    # whether it is an assistant message)
    ns: list[tuple[int, bytes, int, bool]]
    scope: bytes  # the session id or user the anchors are scoped to (b"" for none)


@dataclass(frozen=True, slots=True)
class Anchor:
    kind: str  # history | exchange | answer | previous
    key: str  # hex hash


@dataclass(frozen=True, slots=True)
class Offer:
    """The anchors a request offers for its last assistant message, strongest first."""

    end: int  # number of messages up to and including that assistant message
    anchors: list[Anchor]


def analyze(messages: Sequence[Mapping[str, Any]], scope: str | None = None) -> Conversation:
    """Both rules' view of a request's messages, each message made canonical once."""
    hashes: list[bytes] = []
    ns: list[tuple[int, bytes, int, bool]] = []
    h = _SEED
    for i, m in enumerate(messages):
        c, w = _canon(m)
        h = _chain(h, c)
        hashes.append(h)
        role = m.get("role")
        if role != "system" and role != "developer":
            ns.append((i, c, w, role == "assistant"))
    return Conversation(hashes, ns, (scope or "").encode())


def _key(kind: str, scope: bytes, *parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=_DIGEST, person=_PERSON[kind])
    for p in (scope, *parts):
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    return h.hexdigest()


def _anchors(conv: Conversation, end: int, resp: bytes, resp_w: int, min_chars: int,
             stored: bool) -> list[Anchor]:  # fmt: skip
    """The anchors of response `resp` following the non-system messages [:end]; `stored`:
    a pending turn's (answer anchors from the block in order), else a follow-up's (nearest
    the response first)."""
    ns = conv.ns
    last = end - 1
    while last >= 0 and not ns[last][3]:
        last -= 1
    if last + 1 >= end:  # no message between the previous response and this one
        return []
    scope = conv.scope
    floor = 0 if scope else min_chars
    head = last + 1
    out: list[Anchor] = []
    if sum(m[2] for m in ns[: head + 1]) + resp_w >= floor:
        # Canonical forms are JSON arrays: their concatenation is unambiguous.
        history = b"".join(m[1] for m in ns[: head + 1])
        out.append(Anchor(HISTORY, _key(HISTORY, scope, history, resp)))
    prev, prev_w = (ns[last][1], ns[last][2]) if last >= 0 else (b"", 0)
    if prev_w + ns[head][2] + resp_w >= floor:
        out.append(Anchor(EXCHANGE, _key(EXCHANGE, scope, prev, ns[head][1], resp)))
    block = range(head, end) if stored else range(end - 1, head - 1, -1)
    for k in block:
        if ns[k][2] + resp_w >= floor:
            out.append(Anchor(ANSWER, _key(ANSWER, scope, ns[k][1], resp)))
    if last >= 0 and prev_w + resp_w >= floor:
        out.append(Anchor(PREVIOUS, _key(PREVIOUS, scope, prev, resp)))
    return out


def stored_anchors(conv: Conversation, response: Mapping[str, Any], min_chars: int) -> list[str]:
    """The anchors a pending turn registers: its request (`conv`), then its `response`."""
    resp, resp_w = _canon(response)
    return list(dict.fromkeys(a.key for a in _anchors(conv, len(conv.ns), resp, resp_w, min_chars, True)))


def offer(conv: Conversation, min_chars: int) -> Offer | None:
    """The anchors of a request's last assistant message (None when it has none)."""
    ns = conv.ns
    last = len(ns) - 1
    while last >= 0 and not ns[last][3]:
        last -= 1
    if last < 0:
        return None
    unique: dict[str, Anchor] = {}
    for a in _anchors(conv, last, ns[last][1], ns[last][2], min_chars, False):
        unique.setdefault(a.key, a)
    return Offer(ns[last][0] + 1, list(unique.values())) if unique else None


class AnchorIndex:
    """The anchor rule in memory, as the Redis scripts run it (pending_store.py): for the
    turns a collector holds during a Redis outage. An anchor names the one hash that
    registered it, or "*" once another did; the oldest are forgotten past `bound`."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._names: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._names)

    def register(self, h: str, anchors: Sequence[str]) -> None:
        for a in anchors:
            seen = self._names.pop(a, None)
            self._names[a] = h if seen is None or seen == h else "*"
        while len(self._names) > self.bound:
            self._names.popitem(last=False)

    def decide(self, anchors: Sequence[str]) -> tuple[int, str | None]:
        """(1-based index of the first registered anchor, the hash it names); (-index,
        None) when that anchor is ambiguous; (0, None) when none is registered."""
        for i, a in enumerate(anchors):
            h = self._names.get(a)
            if h == "*":
                return -(i + 1), None
            if h is not None:
                return i + 1, h
        return 0, None

    def clear(self) -> None:
        self._names.clear()
