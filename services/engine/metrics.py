"""Prometheus metrics of the engine (served at /metrics by shared.telemetry)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "nextstate_engine_requests_total",
    "Generation requests finished, by finish type (stop, length, abort, error)",
    ["status"],
)
REJECTED = Counter("nextstate_engine_rejected_total", "Requests refused because the queue was full")
GENERATED_TOKENS = Counter("nextstate_engine_generated_tokens_total", "Tokens sampled")
PROMPT_TOKENS = Counter("nextstate_engine_prompt_tokens_total", "Prompt tokens processed")
QUEUE_DEPTH = Gauge("nextstate_engine_queue_depth", "Requests waiting for a slot")
RUNNING = Gauge("nextstate_engine_running", "Requests generating now")
LATENCY = Histogram(
    "nextstate_engine_request_latency_seconds",
    "From arrival to the last token",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
WEIGHT_UPDATES = Counter(
    "nextstate_engine_weight_updates_total", "Weight updates, by result", ["result"]
)
LOAD_SECONDS = Histogram(
    "nextstate_engine_weight_load_seconds",
    "Time to load and check a new checkpoint",
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
DECODE_BATCH = Histogram(
    "nextstate_engine_decode_batch_size",
    "Requests advanced by one batched decode step",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)
ADAPTER_LOADS = Counter(
    "nextstate_engine_lora_loads_total", "LoRA adapter loads, by result", ["result"]
)
