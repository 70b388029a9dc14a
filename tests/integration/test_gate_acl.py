"""The promotion gate runs as the watcher's Redis ACL user (services/ctl/redis_acl.py):
it reads `evals` in group `gate`, keeps `gate-state`, publishes `promotions`, sets the
rebase request and dead-letters what it cannot read — and may do nothing more there."""

from __future__ import annotations

import json
from pathlib import Path

from services.ctl import redis_acl
from services.watcher.gate import Gate
from services.watcher.settings import WatcherSettings
from shared import checkpoints as ckpt
from shared import keys as K
from shared.schemas import EvalResult, Promotion, eval_job_id
from shared.settings import Settings
from shared.store import AsyncBucket, Bucket
from tests.integration.test_redis_acl import Acl, acl, acl_port, denied  # noqa: F401  (fixtures)


def result(run: str, version: int, suite: str, score: float, n: int = 32, rerun: str = "") -> EvalResult:
    return EvalResult(id=eval_job_id(run, version, suite) + rerun, run=run, version=version, suite=suite,
                      score=score, n=n, higher_is_better=suite != "drift")


async def test_the_watcher_user_may_run_the_gate_and_nothing_more(
    acl: Acl, s3_settings: Settings, tmp_path: Path,  # noqa: F811
) -> None:
    k = acl.keys
    watcher_bus = acl.bus("watcher")
    admin = acl.bus(redis_acl.ADMIN)
    run = watcher_bus.settings.run
    settings = WatcherSettings(env="test", run=run, redis=watcher_bus.settings.redis,
                               bucket=s3_settings.bucket, gate={"enabled": True, "suites": ["demo", "drift"]})
    (tmp_path / "config.json").write_text("{}")
    with Bucket(s3_settings.bucket) as sync_bucket:
        ckpt.publish_checkpoint(sync_bucket, run, 1, tmp_path)  # what the rollback goes back to
    async with AsyncBucket(s3_settings.bucket) as bucket:
        gate = Gate(settings, watcher_bus, bucket)
        for v, demo in ((1, 0.6), (2, 0.8)):
            await admin.publish(K.EVALS, result(run, v, "demo", demo))
            await admin.publish(K.EVALS, result(run, v, "drift", 0.1))
        await admin.redis.xadd(k.evals, {K.FIELD: "{not an EvalResult"})
        verdicts = await gate.step(latest=2)
        assert [(v.version, v.decision) for v in verdicts] == [(1, "promoted"), (2, "promoted")]
        assert await admin.redis.xlen(k.dead) == 1

        await admin.publish(K.EVALS, result(run, 2, "demo", 0.1, n=256, rerun=".n256"))
        verdicts = await gate.step(latest=2)
        assert [(v.version, v.decision) for v in verdicts] == [(2, "rolled_back")]
        assert json.loads(await admin.redis.get(k.lineage))["base"] == 1
        rows = await admin.redis.xrange(k.promotions)
        assert [Promotion.from_json(f[K.FIELD]).decision for _, f in rows] == ["promoted", "promoted", "rolled_back"]
        state = await admin.redis.hgetall(k.gate_state)
        assert json.loads(state["promoted"]) == [1] and state["serving"] == "1"
        group = next(g for g in await admin.redis.xinfo_groups(k.evals) if g["name"] == K.GROUP_GATE)
        assert int(group["pending"]) == 0 and group["lag"] == 0

        # A fresh gate (a restarted watcher) reads its memory back as the same user.
        again = Gate(settings, acl.bus("watcher"), bucket)
        assert await again.step(latest=2) == [] and again.choices(2, frozenset()) == [1]

    w = watcher_bus.redis
    await denied(w.delete(k.gate_state))
    await denied(w.delete(k.evals))
    await denied(w.xadd(k.evals, {K.FIELD: "x"}))  # reads results, never writes them
    await denied(w.xrange(k.promotions))
    await denied(w.xadd(k.checkpoints, {K.FIELD: "x"}))
    await denied(w.set(k.trainer_version, 3))
    await denied(w.hgetall(k.refused_versions))
