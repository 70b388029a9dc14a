"""The real `python -m services.trainer` over a corrupt LATEST: it starts, reports the refusal
(Redis `refused_versions`, a metric), trains, and its commit makes LATEST valid again."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import redis

from shared import keys as K
from shared.checkpoints import latest_key, read_latest, version_prefix
from shared.keys import Keys
from shared.settings import Settings
from shared.store import Bucket
from tests.integration.test_trainer_service import batch
from tests.support.servers import ServiceProcess, free_port, wait_until

pytestmark = pytest.mark.integration


def test_trainer_starts_over_a_corrupt_latest_reports_it_and_commits(
    s3_env: dict[str, str], s3_settings: Settings, tiny_model: Path
) -> None:
    run, port = s3_settings.run, free_port()
    keys = Keys(s3_settings.redis.prefix)
    with Bucket(s3_settings.bucket) as bucket:
        bucket.ensure()
        bucket.put_bytes(version_prefix(run, 3) + "model.safetensors", b"half-uploaded")
        bucket.put_bytes(latest_key(run), b"garbage")
        r = redis.Redis.from_url(s3_settings.redis.url, decode_responses=True, socket_timeout=5)
        proc = ServiceProcess("trainer", {
            **s3_env, "NEXTSTATE_STREAMS__BLOCK_MS": "100", "NEXTSTATE_TRAINER__MODEL": str(tiny_model),
            "NEXTSTATE_TRAINER__THREADS": "1", "NEXTSTATE_TRAINER__PORT": str(port),
        }).start()  # fmt: skip
        try:
            proc.wait_http(f"http://127.0.0.1:{port}/readyz", timeout=90)
            record = json.loads(r.hget(keys.refused_versions, "LATEST") or "{}")
            assert (record.get("by"), record.get("reason")) == ("trainer", "latest"), proc.logs()
            assert "LATEST" in record["detail"] and abs(record["at"] - time.time()) < 120

            r.xadd(keys.batches, {K.FIELD: batch(1, run).to_json()})
            wait_until(lambda: (p := read_latest(bucket, run)) is not None and p.version == 4,
                       60, f"v4 committed\n{proc.logs()}")
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            assert 'nextstate_trainer_refused_versions_total{reason="latest"} 1.0' in metrics
            assert proc.stop() == 0, proc.logs()
        finally:
            proc.kill()
            r.close()
