"""One base model per run, checked where it matters: the bucket, the Redis prefix, `up`.

Against the real SeaweedFS and Redis of the test session; `nextstate up` itself (its own
Redis and S3 server) for the CLI: `up` prints every endpoint and the commands that find
them, a second `up --model B` over a run of model A refuses,
and `nextstate status` with no environment but the home finds the running stack.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from services.buffer.ledger import Ledger
from shared.runs import RunMismatch, claim_run, record_for
from shared.settings import Settings
from shared.store import Bucket
from shared.streams import Bus
from tests.support.tiny_model import build_tiny_model
from tests.support.upstack import NEXTSTATE, UpStack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("run-identity")
    return build_tiny_model(root / "a", seed=1), build_tiny_model(root / "b", seed=2)


def test_the_bucket_keeps_the_runs_base_model(s3_settings: Settings, two_models: tuple[Path, Path]) -> None:
    a, b = two_models
    run = s3_settings.run
    with Bucket(s3_settings.bucket) as bucket:
        first = claim_run(bucket, record_for(run, a))
        assert claim_run(bucket, record_for(run, a)) == first  # the same model: fine, unchanged
        with pytest.raises(RunMismatch, match=str(b)):
            claim_run(bucket, record_for(run, b))
        claim_run(bucket, record_for(f"{run}-2", b))  # another run may use it


async def test_a_prefix_holds_one_runs_turns(settings: Settings) -> None:
    async with Bus(settings) as bus:
        await Ledger(bus, settings, 60).claim_prefix()
        await Ledger(bus, settings, 60).claim_prefix()  # the same run again: fine
        other = settings.model_copy(update={"run": "another-run"})
        with pytest.raises(RunMismatch, match="another-run"):
            await Ledger(bus, other, 60).claim_prefix()


def until_logged(stack: UpStack, text: str, timeout: float = 30) -> str:
    """`up`'s log once it holds `text` (its announcement is written line by line)."""
    deadline = time.monotonic() + timeout
    while text not in (log := stack.logs(100_000)):
        assert time.monotonic() < deadline, f"{text!r} not in up's log:\n{log}"
        time.sleep(0.1)
    return log


def test_up_refuses_another_model_and_the_cli_finds_the_running_stack(
    two_models: tuple[Path, Path], tmp_path: Path, unique: str
) -> None:
    a, b = two_models
    stack = UpStack(a, tmp_path / "home", run=f"id-{unique}", prefix=f"id-{unique}", args=["--no-train"])
    stack.start()
    try:
        said_up = until_logged(stack, "try: nextstate")
        # `up` said every endpoint it started (Redis too, its password hidden), where its
        # record is, and the commands that find the stack through it.
        rec = stack.record()
        assert rec["redis_url"].startswith("redis://ctl:***@") and rec["redis_url"] in said_up
        assert stack.secrets()["redis_url"] not in said_up  # the password itself never printed
        assert rec["bucket"]["endpoint"] in said_up
        for name, svc in rec["services"].items():
            if svc["url"] is not None and name not in ("redis", "s3"):  # said as redis, bucket
                assert f"{name} " in said_up and svc["url"] in said_up, (name, said_up)
        assert f"stack record: {stack.record_path}" in said_up
        assert f"OpenAI endpoint: {stack.collector}" in said_up
        assert all(cmd in said_up for cmd in ("nextstate demo", "nextstate status", "nextstate tail"))
        # No NEXTSTATE_* but the home: the CLI reads the stack `up` recorded there.
        clean = {k: v for k, v in os.environ.items() if not k.startswith("NEXTSTATE_")}
        clean["NEXTSTATE_HOME"] = str(stack.home)
        out = subprocess.run([NEXTSTATE, "status", "--json", "--window", "0"], env=clean,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["prefix"] == stack.prefix
        assert f"the stack of `nextstate up` (run {stack.run}" in out.stderr
        assert str(stack.record_path) in out.stderr
        # Another base model on the same run: refused before anything starts.
        again = subprocess.run(
            [NEXTSTATE, "up", "--model", str(b), "--run", stack.run, "--home", str(stack.home), "--no-train"],
            env=clean, capture_output=True, text=True, timeout=120)
        assert again.returncode == 1
        said = again.stdout + again.stderr
        assert str(a) in said and str(b) in said and "new run" in said
    finally:
        stack.stop()
