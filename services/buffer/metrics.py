"""The buffer's Prometheus metrics, in one place so every module counts the same way."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

SAMPLES = Counter(
    "nextstate_buffer_samples_total", "Samples kept (forced: by the at-least-one rule)", ["kind"]
)
EXCLUDED = Counter(
    "nextstate_buffer_excluded_total", "Scored turns that did not become a sample", ["reason"]
)
STALE = Counter(
    "nextstate_buffer_stale_dropped_total",
    "Samples dropped for being more than max_staleness versions behind the trainer",
)
STALENESS = Histogram(
    "nextstate_buffer_sample_staleness_versions",
    "Versions between the policy that sampled a turn and the trainer, at intake",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
)
PARKED = Counter(
    "nextstate_buffer_parked_final_turns_total",
    "Final turns parked until their session's earlier turns are decided (at-least-one rule)",
)
EPISODE_TURNS_HELD = Counter(
    "nextstate_buffer_episode_turns_held_total", "Episode turns held until their episode's Outcome"
)
OUTCOMES = Counter(
    "nextstate_buffer_outcomes_total", "Episode Outcomes received (failed: with an error)", ["kind"]
)
GROUPS = Counter(
    "nextstate_buffer_episode_groups_total",
    "Advantage groups settled: complete, partial (its wait ran out), too_small (< 2 outcomes)",
    ["kind"],
)
CHAT_GROUP_TURNS_HELD = Counter(
    "nextstate_buffer_chat_group_turns_held_total",
    "Judged members of chat groups (n > 1) held until their group came (group advantages)",
)
CHAT_GROUPS = Counter(
    "nextstate_buffer_chat_groups_total",
    "Chat groups settled: complete, partial (its wait ran out), too_small (< 2 judged members)",
    ["kind"],
)
SWEEPS = Counter(
    "nextstate_buffer_sweeps_total",
    "Sweeps completed: parked final turns (final), held episode turns (episode), held chat-group "
    "members (group); flat: that sweep is stuck",
    ["kind"],
)
DUPLICATES = Counter(
    "nextstate_buffer_duplicate_turns_total", "Scored turns whose turn id was already batched"
)
BATCHES = Counter("nextstate_buffer_batches_total", "TrainBatches published")
BATCH_SIZE = Histogram(
    "nextstate_buffer_batch_size", "Samples per published batch",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
BATCH_WAIT = Histogram(
    "nextstate_buffer_batch_wait_seconds", "Oldest sample's wait until its batch was published",
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
PUBLISH_RETRIES = Counter(
    "nextstate_buffer_publish_retries_total", "Batch publishes retried (stream full or Redis error)"
)
PENDING = Gauge("nextstate_buffer_pending_samples", "Samples waiting for their batch")

ARCHIVED = Counter("nextstate_buffer_archived_samples_total", "Samples uploaded to the archive")
ARCHIVE_UPLOADS = Counter("nextstate_buffer_archive_uploads_total", "Archive objects uploaded")
ARCHIVE_FAILURES = Counter(
    "nextstate_buffer_archive_upload_failures_total", "Archive uploads that failed (retried)"
)
ARCHIVE_DROPPED = Counter(
    "nextstate_buffer_archive_dropped_samples_total",
    "Samples never archived: the upload backlog overflowed or shutdown came first",
)

PULLED = Counter("nextstate_buffer_pulled_batches_total", "Batches served by GET /get_data")
IMPORTED = Counter(
    "nextstate_buffer_import_turns_total", "Imported turns by outcome (published, side, untrainable)",
    ["outcome"],
)
IMPORT_REJECTED = Counter(
    "nextstate_buffer_import_rejected_requests_total", "POST /receive requests refused with 400"
)
