"""The judge's Prometheus metrics (served on /metrics by shared.telemetry)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

VOTES = Counter(
    "nextstate_judge_votes_total",
    "Judge calls by outcome: 1, -1, 0, (0,1) or (-1,0) (graded), unparsable or error",
    ["kind", "outcome"],
)
PARSE_FAILURES = Counter(
    "nextstate_judge_parse_failures_total", "Judge answers without a readable \\boxed{} verdict",
    ["kind"],
)
DISAGREEMENT = Counter(
    "nextstate_judge_disagreement_total", "Turns whose valid votes were not unanimous", ["kind"]
)
CALL_SECONDS = Histogram(
    "nextstate_judge_call_seconds", "One judge call attempt, by outcome",
    ["kind", "outcome"],
    buckets=(0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120),
)
RETRIES = Counter(
    "nextstate_judge_call_retries_total", "Judge call attempts repeated after a transient failure",
    ["reason"],
)
INFLIGHT = Gauge("nextstate_judge_turns_in_flight", "Turns being judged in this process")
CALL_LIMIT = Gauge(
    "nextstate_judge_call_limit",
    "Judge model calls allowed in flight now (halved when the model is overloaded, regained as it answers)",
)
BACKOFFS = Counter(
    "nextstate_judge_backoffs_total", "Times the judge cut its calls because the model was overloaded", ["reason"],
)
TURNS = Counter(
    "nextstate_judge_turns_total",
    "Turns by outcome: scored, unjudged (no next state), side (skipped), failed (raised), held (wait for "
    "their session's experience)",
    ["outcome"],
)
REWARDS = Counter(
    "nextstate_judge_rewards_total", "Published rewards: 1, -1, 0, or (0,1) / (-1,0) when graded",
    ["judge", "reward"],
)


def score_label(value: float) -> str:
    """A bounded label for a score or reward: the three labels exactly, else its open interval."""
    if value in (-1.0, 0.0, 1.0):
        return str(int(value))
    return "(0,1)" if value > 0 else "(-1,0)"
HINTS = Counter(
    "nextstate_judge_hints_total", "OPD hint outcomes: accepted, none, no_user, no_response_ids, teacher_rejected",
    ["outcome"],
)
TEACHER_SECONDS = Histogram(
    "nextstate_judge_teacher_seconds", "Teacher prompt encoding + log-prob scoring per turn",
    buckets=(0.01, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
)
EXPERIENCE = Counter(
    "nextstate_judge_experience_total",
    "Session endings: extracted (lessons stored), empty (nothing to learn), reused (stored already)",
    ["outcome"],
)
EXPERIENCE_TEACHER = Counter(
    "nextstate_judge_experience_teacher_total",
    "Experience teacher per turn: scored, none (no lessons), no_response_ids, rejected (engine 4xx)",
    ["outcome"],
)
HELD = Counter(
    "nextstate_judge_held_total",
    "Turns on arrival in experiential learning: held (wait for their session's end), ended (scored at "
    "once: the session's experience exists), full (scored at once: too many held)",
    ["state"],
)
REPLAYED = Counter(
    "nextstate_judge_replayed_total", "Held turns scored and published by a replay, by its reason", ["reason"]
)

# The reward-collapse alarm (collapse.py): the judges' shared window, as this process's last
# published turn left it.
WINDOW_TURNS = Gauge("nextstate_judge_window_turns", "Judged turns in the reward-collapse window (all judges)")
WINDOW_TOP_SHARE = Gauge(
    "nextstate_judge_window_top_share", "Share of the window's turns holding its commonest reward value"
)
WINDOW_UNDECIDED_SHARE = Gauge(
    "nextstate_judge_window_undecided_share",
    "Share of the window's turns whose votes were undecided (no label won, or none readable)",
)
COLLAPSE = Gauge(
    "nextstate_judge_reward_collapse", "1 while the reward-collapse alarm is raised, by reason "
    "(one-value, undecided)", ["reason"],
)
COLLAPSE_ALARMS = Counter(
    "nextstate_judge_reward_collapse_alarms_total", "Times this process's turn raised the alarm, by reason",
    ["reason"],
)
