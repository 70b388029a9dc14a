"""`nextstate up` closes its control plane: a random internal token per start, given to every
service, kept owner-only in secrets.json (never in stack.json or the log), and used by
every client — the collector's engine calls, the judge, `nextstate import`."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from shared.auth import bearer
from tests.support.servers import REPO
from tests.support.upstack import UpStack

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_up_issues_a_token_and_every_service_uses_it(tiny_model: Path, tmp_path: Path, unique: str) -> None:
    stack = UpStack(tiny_model, tmp_path / "home", f"auth-{unique}", f"auth-{unique}", args=["--no-train"],
                    env={"NEXTSTATE_INTERNAL__TOKEN": ""})  # unset: `up` makes one
    stack.start()
    try:
        secrets_path = stack.record_path.parent / "secrets.json"
        token = json.loads(secrets_path.read_text())["internal_token"]
        assert len(token) >= 32 and stat.S_IMODE(secrets_path.stat().st_mode) == 0o600
        assert token not in stack.record_path.read_text() and token not in stack.logs(10**7)
        auth = bearer(token)
        services = stack.record()["services"]
        engine, buffer, judge = (services[n]["url"] for n in ("engine", "buffer", "judge-0"))
        with httpx.Client(timeout=60) as http:
            assert http.get(f"{engine}/model_info").status_code == 401
            assert http.get(f"{engine}/model_info", headers=auth).status_code == 200
            assert http.get(f"{engine}/health").status_code == 200
            assert http.get(f"{buffer}/get_data").status_code == 401
            assert http.get(f"{buffer}/get_data", headers=auth).status_code == 200
            assert http.get(f"{judge}/metrics").status_code == 401
            assert http.get(f"{judge}/metrics", headers=auth).status_code == 200
            # The collector (its own user keys: none in dev) reaches the engine with the token.
            done = http.post(f"{stack.collector}/chat/completions", json={
                "model": "policy", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
            assert done.status_code == 200, done.text
        # `nextstate import` finds the token in the running stack's secrets.json.
        env = {k: v for k, v in os.environ.items() if not k.startswith("NEXTSTATE_")}
        out = subprocess.run(
            [sys.executable, "-m", "services.ctl.importer", "--mock", "2", "--url", buffer],
            cwd=REPO, capture_output=True, text=True, timeout=60,
            env={**env, "NEXTSTATE_HOME": str(stack.home), "NEXTSTATE_RUN": stack.run},
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
    finally:
        assert stack.stop() == 0, stack.logs()
