"""The trainer's Prometheus metrics (served on /metrics); the same numbers go into manifests."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import Counter, Gauge, Histogram

# The last step's value of each per-step metric, by its name in the step's metrics dict.
STEP_GAUGES = {
    name: Gauge(f"nextstate_trainer_{name}", doc)
    for name, doc in {
        "loss": "Total loss (pg + β·KL) of the last step, token-mean",
        "pg_loss": "Clipped surrogate loss of the last step, token-mean",
        "kl": "k3 KL to the reference of the last step, token-mean",
        "clip_frac": "Fraction of trained tokens whose ratio was clipped",
        "ratio_mean": "Mean importance ratio against the behaviour log-probs",
        "adv_mean": "Mean advantage over trained tokens",
        "reward_mean": "Mean reward of the last batch's samples",
        "staleness": "Mean trainer version minus the samples' policy version",
        "staleness_max": "Largest trainer version minus a sample's policy version",
        "tokens_per_s": "Tokens (prompt + response) per second of the last step",
        "step_seconds": "Wall time of the last optimizer step",
        "grad_norm": "Global gradient norm before clipping",
        "mismatch_abs_log_ratio": "Mean |log π_trainer/π_engine| before the step, over samples of the "
                                  "trainer's own version (the train/inference mismatch)",
        "mismatch_outside_frac": "Fraction of those tokens whose ratio is outside [1-ε, 1+ε_high]",
        "is_weight_mean": "Mean truncated importance weight min(π_trainer/π_engine, C) of trained tokens",
        "is_truncated_frac": "Fraction of trained tokens whose importance weight was truncated at C",
    }.items()
}
MISMATCH_ALARM = Gauge(
    "nextstate_trainer_mismatch_alarm",
    "1 while the mean |log ratio| of the trainer's own samples over its last steps is past "
    "NEXTSTATE_TRAINER__MISMATCH_ALARM",
)
SAMPLE_COUNTS = {
    name: Counter(f"nextstate_trainer_{name}_total", doc)
    for name, doc in {
        "offpolicy_samples": "Samples trained from an older version than the trainer's (importance-weighted)",
        "truncated_samples": "Samples with at least one token's importance weight truncated at IS_CAP",
        "divergent_samples": "Samples not trained: further from the trainer than MAX_SAMPLE_KL",
    }.items()
}
STEPS = Counter("nextstate_trainer_steps_total", "Optimizer steps taken")
TOKENS = Counter("nextstate_trainer_tokens_total", "Tokens read by training forwards")
SKIPPED_STEPS = Counter("nextstate_trainer_skipped_steps_total", "Steps skipped (non-finite gradient)")
FAILED_BATCHES = Counter("nextstate_trainer_failed_batches_total", "Batches whose step raised")
REPLAYED = Counter(
    "nextstate_trainer_replayed_batches_total", "Batches already in a committed version, acked untrained"
)
VERSION = Gauge("nextstate_trainer_version", "Newest committed version of the lineage trained on")
COMMITS = Counter("nextstate_trainer_commits_total", "Versions committed to the bucket")
COMMIT_FAILURES = Counter("nextstate_trainer_commit_failures_total", "Commit attempts that failed")
REFUSED_VERSIONS = Counter(
    "nextstate_trainer_refused_versions_total",
    "Checkpoints passed over at resume because they did not verify", ["reason"],
)
REBASES = Counter(
    "nextstate_trainer_rebases_total",
    "Rollbacks followed: the trainer rebased on an earlier version's weights and optimizer state "
    "(by: operator | gate, from the rebase record; latest, LATEST moved back by hand)", ["by"],
)
ABANDONED_SNAPSHOTS = Counter(
    "nextstate_trainer_abandoned_snapshots_total",
    "Versions trained but not committed because a rollback abandoned their lineage",
)
ABANDONED_BATCHES = Counter(
    "nextstate_trainer_abandoned_batches_total",
    "Batches acked without training: every sample came from a version a rollback abandoned",
)
ABANDONED_SAMPLES = Counter(
    "nextstate_trainer_abandoned_samples_total",
    "Samples not trained because a version a rollback abandoned generated them",
)
STALE_BATCHES = Counter(
    "nextstate_trainer_stale_batches_total",
    "Batches acked without training: every sample was more than MAX_STALENESS versions behind",
)
STALE_SAMPLES = Counter(
    "nextstate_trainer_stale_samples_total",
    "Samples not trained: more than MAX_STALENESS versions behind the weights being trained",
)
PENDING_UPLOADS = Gauge("nextstate_trainer_pending_uploads", "Versions snapshotted, not yet committed")
COMMIT_SECONDS = Histogram(
    "nextstate_trainer_commit_seconds", "Write + upload + commit of one version",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
SNAPSHOT_SECONDS = Histogram(
    "nextstate_trainer_snapshot_seconds", "Copying a version's weights (and, when due, the resume state) off the trainer",
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

UPLOAD_WAIT_SECONDS = Histogram(
    "nextstate_trainer_upload_wait_seconds",
    "Time training waited for an upload slot before a snapshot (0 while commits keep up; "
    "NEXTSTATE_TRAINER__MAX_PENDING_UPLOADS bounds the versions in flight)",
    buckets=(0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
VERSION_BYTES = Histogram(
    "nextstate_trainer_version_bytes", "Bytes one committed version put into the bucket",
    ["format", "stored"],  # format: full | adapter; stored: whole | delta
    buckets=(1e5, 1e6, 1e7, 3e7, 1e8, 3e8, 1e9, 3e9, 1e10, 3e10),
)
RESUME_STATES = Counter(
    "nextstate_trainer_resume_states_total",
    "Resume states (optimizer, RNG, step) written, every RESUME_EVERY versions or RESUME_EVERY_S seconds",
)
RESUME_FAILURES = Counter(
    "nextstate_trainer_resume_state_failures_total", "Resume states not written (the bucket refused)"
)
RESUME_SECONDS = Histogram(
    "nextstate_trainer_resume_state_seconds", "Writing + uploading one resume state (no commit waits for it)",
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)


def observe_step(metrics: Mapping[str, float]) -> None:
    for name, gauge in STEP_GAUGES.items():
        if name in metrics:
            gauge.set(metrics[name])
    for name, counter in SAMPLE_COUNTS.items():
        counter.inc(metrics.get(name, 0.0))
    STEPS.inc()
    TOKENS.inc(metrics.get("tokens", 0.0))
    if metrics.get("skipped_step"):
        SKIPPED_STEPS.inc()


def average(window: list[dict[str, float]]) -> dict[str, float]:
    """Per-metric mean over the steps of one version (what its manifest records)."""
    keys = sorted({k for m in window for k in m})
    out = {k: sum(m.get(k, 0.0) for m in window) / len(window) for k in keys} if window else {}
    out["steps"] = float(len(window))
    return out
