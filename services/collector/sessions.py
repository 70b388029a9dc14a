"""Which conversation a request belongs to, and whose it is, as the client itself says.

The session id of a request is the first of (headers are case-insensitive):

1. `X-Session-Id`, then the body's `session_id`: ours, the caller names the session (a
   value over 256 characters is a 400);
2. the Codex CLI's `thread-id`, else its `session-id`. A thread is one conversation:
   a subagent Codex spawns runs in a thread of its own (its own `thread-id`, and
   `x-codex-parent-thread-id` naming its parent's) while it keeps the root's
   `session-id` and `prompt_cache_key`, so those two cover the root and every subagent
   (recorded from Codex 0.171: tests/data/agents/codex-subagent.jsonl);
3. Claude Code's `x-claude-code-session-id`, else the `session_id` inside its
   `metadata.user_id` (a JSON string; or the older `user_<id>_account_<uuid>_session_<uuid>`).
   Its subagents send the session id of the session that started them, with an
   `x-claude-code-agent-id` of their own: a subagent's session is
   `<session id>/<agent id>`, so that it is not the main conversation's (recorded from
   Claude Code 2.1.332: tests/data/agents/claude-subagents.jsonl).

An agent's id (2, 3) that is empty, over 256 characters or not printable is not used
(the agent is not refused for what it sends us unasked). Not read: `prompt_cache_key`
(clients share one across conversations to share a cache: Codex's is the root
session's), `traceparent` (OpenClaw's is one trace per run of the agent, not a
session; OpenClaw sends no session id), `x-client-request-id`.

The user: Claude Code's `metadata.user_id` names its device (`device_id`), its account
(`account_uuid`, empty without a login) and the session; the user is the account when
there is one, else the device, so that every session of one person is one user (the
whole string, with its per-session id, made each session a user of its own). Any other
`metadata.user_id`, and every other API's `user`, is the user as sent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

MAX_ID = 256  # session ids and `user`

CODEX = ("thread-id", "session-id")
CLAUDE = "x-claude-code-session-id"
CLAUDE_AGENT = "x-claude-code-agent-id"
EMBEDDED = "metadata.user_id"
# Claude Code before its JSON form: user_<64 hex>_account_<uuid or nothing>_session_<uuid>
_LEGACY = re.compile(r"^user_([0-9a-fA-F]+)_account_([0-9a-fA-F-]*)_session_([0-9a-fA-F-]+)$")


@dataclass(frozen=True, slots=True)
class Session:
    """The session an agent named: its id, and where it was read (a header's name, or
    `metadata.user_id`)."""

    id: str
    source: str


def _plain(value: str | None) -> str | None:
    value = value.strip() if value else None
    return value if value and len(value) <= MAX_ID and value.isprintable() else None


def agent_session(headers: Mapping[str, str], embedded: str | None = None) -> Session | None:
    """The session id an agent sent in its own headers (Codex, Claude Code) or, for
    `embedded`, inside `metadata.user_id` (claude_user); None when it sent none."""
    for name in CODEX:
        if (value := _plain(headers.get(name))) is not None:
            return Session(value, name)
    claude = _plain(headers.get(CLAUDE))
    source = CLAUDE if claude is not None else EMBEDDED
    sid = claude or _plain(embedded)
    if sid is None:
        return None
    agent = _plain(headers.get(CLAUDE_AGENT))
    if agent is not None and len(sid) + 1 + len(agent) <= MAX_ID:
        sid = f"{sid}/{agent}"
    return Session(sid, source)


def claude_user(user_id: str) -> tuple[str | None, str | None]:
    """(user, session id) of an Anthropic `metadata.user_id`: Claude Code's JSON object
    (`account_uuid`, else `user_id`, else `device_id`; its `session_id`) or its older
    `user_<id>_account_<uuid>_session_<uuid>`; anything else is the user, as sent."""
    if user_id.startswith("{"):
        try:
            data = json.loads(user_id)
        except (ValueError, RecursionError):
            return user_id, None
        if not isinstance(data, dict):
            return user_id, None
        fields = {k: v.strip() for k in ("account_uuid", "user_id", "device_id", "session_id")
                  if isinstance(v := data.get(k), str) and v.strip()}  # fmt: skip
        user = fields.get("account_uuid") or fields.get("user_id") or fields.get("device_id")
        session = fields.get("session_id")
        if user is None and session is None:
            return user_id, None  # not Claude Code's: the user as sent
        return user, session
    if (m := _LEGACY.match(user_id)) is not None:
        return m.group(2) or m.group(1), m.group(3)
    return user_id, None
