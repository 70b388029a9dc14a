"""deploy/slime's rollout function against a real buffer process on a real Redis: batches
published on `batches` come out as slime Samples in order, a batch's rest carried over to
the next rollout, each handed out once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from services.ctl.infra import free_port
from shared.schemas import TrainBatch
from shared.settings import Settings
from shared.streams import Bus
from tests.support.servers import ServiceProcess
from tests.unit.test_slime_rollout import R, sample

pytestmark = pytest.mark.integration


async def test_rollouts_pull_from_a_real_buffer(
    env: dict[str, str], settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    buffer = ServiceProcess("buffer", {**env, "NEXTSTATE_BUFFER__PORT": str(port),
                                       "NEXTSTATE_BUFFER__HOST": "127.0.0.1",
                                       "NEXTSTATE_BUFFER__ARCHIVE": "false"}).start()
    try:
        buffer.wait_http(f"http://127.0.0.1:{port}/readyz", timeout=60)
        first = [TrainBatch(run=settings.run, samples=[sample(n_prompt=i + 1), sample(n_prompt=i + 2)])
                 for i in range(2)]
        async with Bus(settings) as bus:
            for b in first:
                assert await bus.publish("batches", b)
        monkeypatch.setattr(R, "_SOURCE", None)
        monkeypatch.setenv("NEXTSTATE_SLIME__BUFFER_URL", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("NEXTSTATE_SLIME__WAIT_S", "1")
        args = SimpleNamespace(rollout_batch_size=3, use_rollout_logprobs=True, use_opd=False,
                               rollout_temperature=1.0)
        out: Any = await asyncio.to_thread(R.generate_rollout, args, 0, None)
        assert [len(g) for g in out.samples] == [1, 1, 1]
        expected = [s.tokens for b in first for s in b.samples]
        assert [g[0].tokens for g in out.samples] == expected[:3]
        assert [g[0].index for g in out.samples] == [0, 1, 2]
        assert out.metrics["nextstate/carried_over"] == 1 and out.metrics["nextstate/batches"] == 2

        second = TrainBatch(run=settings.run, samples=[sample(n_prompt=9), sample(n_prompt=8)])
        async with Bus(settings) as bus:
            assert await bus.publish("batches", second)
        out = await asyncio.to_thread(R.generate_rollout, args, 1, None)
        assert [g[0].tokens for g in out.samples] == [expected[3]] + [s.tokens for s in second.samples]
        assert [g[0].index for g in out.samples] == [3, 4, 5]
        # Handed out once: the trainer group has nothing left for anyone.
        async with httpx.AsyncClient(timeout=10) as client:
            left = (await client.get(f"http://127.0.0.1:{port}/get_data", params={"n": 4})).json()
        assert left["count"] == 0
    finally:
        if R._SOURCE is not None:
            R._SOURCE.close()
        buffer.stop()
