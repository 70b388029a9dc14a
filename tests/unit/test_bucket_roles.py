"""The bucket roles: one source of truth for SeaweedFS identities and MinIO policies."""

from __future__ import annotations

import json
from pathlib import Path

from services.ctl import bucket_roles

REPO = Path(__file__).resolve().parents[2]


def test_minio_policy_files_are_the_generated_ones() -> None:
    for role in bucket_roles.ROLES:
        on_disk = json.loads((REPO / "deploy" / "minio" / f"nextstate-{role}.json").read_text())
        assert on_disk == bucket_roles.minio_policy(role), "regenerate: python -m services.ctl.bucket_roles minio deploy/minio"


def test_only_the_trainer_writes_checkpoints() -> None:
    writers = {role for role in bucket_roles.ROLES if "policies" in bucket_roles.WRITES[role]}
    assert writers == {"trainer"}
    creds = bucket_roles.new_credentials()
    config = bucket_roles.weed_s3_config("b", creds)
    actions = {i["name"]: i["actions"] for i in config["identities"]}
    assert actions["watcher"] == ["Read:b/policies/*", "List:b"]
    assert actions["buffer"] == ["Write:b/samples/*", "List:b"]
    assert actions["evaluator"] == ["Read:b/policies/*", "Write:b/evals/*", "List:b"]
    assert "Write:b/policies/*" in actions["trainer"]
    assert len({c.secret_key for c in creds.values()}) == len(creds)  # every role its own key


def test_the_evaluator_reads_candidates_and_writes_results_only() -> None:
    assert bucket_roles.READS["evaluator"] == ("policies",)
    assert bucket_roles.WRITES["evaluator"] == ("evals",)
    policy = bucket_roles.minio_policy("evaluator")
    resources = {a: r for st in policy["Statement"] for a in st["Action"] for r in [st["Resource"]]}
    assert resources["s3:GetObject"] == ["arn:aws:s3:::*/policies/*"]
    assert resources["s3:PutObject"] == ["arn:aws:s3:::*/evals/*"]
