"""The collector's Prometheus metrics (served on /metrics with the process's others)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "nextstate_collector_requests_total", "Chat completion requests answered",
    ["mode", "status"],
)  # fmt: skip
REQUEST_SECONDS = Histogram(
    "nextstate_collector_request_seconds", "Time from request to complete response",
    ["mode"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)  # fmt: skip
OVERHEAD_SECONDS = Histogram(
    "nextstate_collector_overhead_seconds",
    "Time the collector adds to a non-streamed request (total minus the engine call)",
    buckets=(0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25),
)
TOKENIZE = Counter(
    "nextstate_collector_tokenize_total", "Prompt tokenizations, by how much was tokenized",
    ["mode"],  # incremental | full
)  # fmt: skip
TURNS = Counter(
    "nextstate_collector_turns_total", "Turns emitted to the turns stream (or the spool)",
    ["closed_by"],
)  # fmt: skip
PENDING = Counter(
    "nextstate_collector_pending_total", "Pending-turn events",
    # stored | closed | expired | unchosen_dropped (a group sibling, GROUP_UNCHOSEN=drop) |
    # same_conversation (stored unpairable: another session's turn has its very conversation)
    ["event"],
)  # fmt: skip
GROUP_CHOICES = Counter(
    "nextstate_collector_group_choices_total", "Choices answered in completions with n > 1"
)
SWEEPS = Counter(
    "nextstate_collector_sweeps_total",
    "Sweeps for expired pending turns completed (flat while Redis is up: the sweeper is stuck)",
)
SPOOLED = Counter(
    "nextstate_collector_spooled_total", "Capture operations written to the local spool", ["op"]
)
FLUSHED = Counter(
    "nextstate_collector_flushed_total", "Spooled operations replayed into Redis", ["op"]
)
SHED = Counter(
    "nextstate_collector_shed_total", "Capture operations dropped, by reason",
    ["reason"],  # stream_bound | spool_full
)  # fmt: skip
REDIS_ERRORS = Counter(
    "nextstate_collector_redis_errors_total", "Redis operations that failed or timed out"
)
REDIS_UP = Gauge(
    "nextstate_collector_redis_up", "1 when capture writes go to Redis, 0 while they spool"
)
FALLBACK_PENDING = Gauge(
    "nextstate_collector_fallback_pending", "Pending turns held in memory during an outage"
)
API_REQUESTS = Counter(
    "nextstate_collector_api_requests_total",
    "Responses API and Anthropic Messages API requests answered (chat: requests_total)",
    # api: responses | messages | count_tokens; mode: plain | stream (any: refused)
    ["api", "mode", "status"],
)  # fmt: skip
STORED_RESPONSES = Counter(
    "nextstate_collector_stored_responses_total", "Responses API objects written to Redis",
    ["result"],  # stored | failed
)  # fmt: skip
DROPPED_TOOLS = Counter(
    "nextstate_collector_dropped_tools_total",
    "Built-in tools requests offered that were left out of the prompt (UNSUPPORTED_TOOLS=drop)",
    ["api", "type"],  # api: responses | messages; type: the tool type (Anthropic's by family)
)  # fmt: skip
UNRENDERED_TOOLS = Counter(
    "nextstate_collector_unrendered_tools_total",
    "Requests whose tools the chat template left out of the prompt (it renders no tools)",
)
PAIRED = Counter(
    "nextstate_collector_paired_total", "Pending turns closed by a follow-up, by the rule that paired them",
    ["rule"],  # prefix | history | exchange | answer | previous (services/collector/pairing.py)
)  # fmt: skip
PAIRING_REFUSED = Counter(
    "nextstate_collector_pairing_refused_total",
    "Follow-ups paired with none because the turn they continue could be several sessions'",
    ["reason"],  # ambiguous (an anchor several turns registered) | same_conversation
)  # fmt: skip
SESSION_IDS = Counter(
    "nextstate_collector_session_ids_total",
    "Main-line requests by where their session id was read (services/collector/sessions.py)",
    # x-session-id | session_id | thread-id | session-id | x-claude-code-session-id |
    # metadata.user_id | user (no session id, a user) | none
    ["source"],
)  # fmt: skip
