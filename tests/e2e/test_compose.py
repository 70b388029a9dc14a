"""The whole loop in Docker, as users run it: `nextstate compose init --offline`, `docker
compose build`, `docker compose up -d --scale judge=3` of the cpu profile on a tiny model.

Agents talk to the published collector through the official `openai` client (and retry
what fails, as agents do). Checked: every judge took turns from the shared `judge` group;
a version is trained, published to the bucket and served (`X-Policy-Version`); SIGKILL
of a judge's, the trainer's and the engine's main process is a crash Docker restarts
(`restart: unless-stopped`), and after the load drains every served response is captured,
judged, and trained in exactly one batch of exactly one version or excluded by a
documented rule (counted as tests/faults/test_faults.py counts); `ctl status` and `ctl
tail turns -f` work from another terminal; `docker compose down` then `up` resumes from
the bucket and Redis volumes (the next version trained builds on the last one).

Docker comes from `make docker` (Debian's docker.io, the compose plugin from PyPI, a
started dockerd); without an engine the test skips and says why. The images are built
through the offline override; warm, the build is the layer cache's (seconds).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis

from shared import checkpoints as ckpt
from shared import keys as K
from shared.keys import Keys
from shared.schemas import ScoredTurn, TrainBatch, Turn
from shared.store import Bucket
from tests.support.composestack import ComposeStack, docker_unavailable
from tests.support.load import Load
from tests.support.tiny_model import build_tiny_model
from tests.support.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.timeout(2400)]

DOCUMENTED = {"no_next_state", "zero_reward", "stale", "side", "no_tokens"}
JUDGES = 3


def read(r: redis.Redis, key: str, model: type) -> list:  # type: ignore[type-arg]
    return [model.from_json(f[K.FIELD]) for _, f in r.xrange(key)]  # type: ignore[attr-defined]


def group_drained(r: redis.Redis, key: str, group: str) -> bool:
    try:
        g = next(g for g in r.xinfo_groups(key) if g["name"] == group)
    except (StopIteration, redis.RedisError):
        return False
    return int(g["pending"]) == 0 and g.get("lag") == 0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    why = docker_unavailable()
    if why:
        pytest.skip(f"docker compose is unavailable here: {why}")
    work = tmp_path_factory.mktemp("compose")
    model = build_tiny_model(work / "model")  # safetensors writes 0600: init makes it readable
    s = ComposeStack(model=model, workdir=work, settings={
        "BUFFER_BATCH_SIZE": "4", "BUFFER_MAX_WAIT_S": "5", "EVAL_SAMPLES": "2",
        "TRAINER_LR": "1e-4",
    }).init()
    try:
        s.build()
        yield s
    finally:
        s.close()
        print(f"compose timings: { {k: round(v, 1) for k, v in s.timings.items()} }")


def trained(s: ComposeStack) -> int:
    with s.redis() as r:
        return int(r.get(Keys(s.prefix).trainer_version) or 0)


def served_versions(load: Load) -> set[int]:
    return {int(x.weight_version) for x in load.served if x.weight_version.isdigit()}


def judged_per_judge(s: ComposeStack) -> list[float]:
    """Turns each judge container scored, from its own /metrics."""
    counts = []
    for i in range(1, JUDGES + 1):
        text = s.ops_get("judge", 9102, "/metrics", index=i)
        counts.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                          if line.startswith("nextstate_judge_turns_total{") and 'outcome="side"' not in line))
    return counts


async def test_the_loop_in_compose_survives_crashes_and_resumes_after_down_up(stack: ComposeStack) -> None:
    s = stack
    s.timings["up"] = await asyncio.to_thread(s.up, "--scale", f"judge={JUDGES}")
    assert f"http://127.0.0.1:{s.collector_port}/v1" in s.init_output
    load = Load(url=s.url, agents=3, turns=3, max_tokens=4, api_key=s.api_key).start()
    try:
        t0 = time.monotonic()
        await until(lambda: trained(s) >= 1, 300, "a version trained")
        await until(lambda: bool(served_versions(load) - {0}), 300, "a trained version served")
        s.timings["first version served"] = time.monotonic() - t0
        with Bucket(s.bucket_settings()) as b:
            assert ckpt.list_versions(b, s.run), "no version published to the bucket"
        await until(lambda: all(n > 0 for n in judged_per_judge(s)), 120, "every judge took turns")
        with s.redis() as r:
            consumers = r.xinfo_consumers(Keys(s.prefix).turns, K.GROUP_JUDGE)
        assert len({c["name"] for c in consumers}) >= JUDGES  # one group, one consumer each

        # Crashes: SIGKILL each main process; Docker restarts it, requests succeed again.
        judge = s.container_ids("judge")[0]
        for service, container in (("judge", judge), ("trainer-cpu", s.container_ids("trainer-cpu")[0]),
                                   ("engine-cpu", s.container_ids("engine-cpu")[0])):
            version = max(served_versions(load))
            before = s.kill(container)
            killed = time.time()
            s.timings[f"{service} back"] = await asyncio.to_thread(s.wait_restarted, container, before)
            await asyncio.wait_for(load.served_since(killed), 120)
            if service == "engine-cpu":  # the restarted engine gets its policy back from the watcher
                await until(lambda v=version, t=killed: any(int(x.weight_version or 0) >= v for x in load.served
                                                                if x.started > t), 120,
                            "the restarted engine serving the trained version again")
        before_trained = trained(s)
        await until(lambda: trained(s) > before_trained, 300, "training after the trainer's restart")
    finally:
        await load.stop()
    await account(s, load)

    # The operator's CLI from another terminal.
    status = s.compose("run", "--rm", "-T", "ctl", "status", "--window", "0", timeout=120).stdout
    assert "serving policy v" in status and "group judge" in status, status
    assert f"consumers {JUDGES}" in status, status
    tail = s.popen("run", "--rm", "-T", "ctl", "tail", "turns", "-f", "-n", "0")
    try:
        probe = Load(url=s.url, agents=1, turns=1, max_tokens=4, api_key=s.api_key)
        probe.start()
        line = await asyncio.wait_for(asyncio.to_thread(first_line, tail), 90)
        await probe.stop()
        assert line.strip(), "ctl tail turns -f printed nothing for a new turn"
    finally:
        tail.send_signal(signal.SIGINT)  # Ctrl-C, as in the operator's terminal: stops the container too
        await asyncio.to_thread(tail.wait, 30)
        if tail.stdout is not None:
            tail.stdout.close()

    # down, then up: the volumes keep the bucket and Redis, so the run resumes.
    last = trained(s)
    with Bucket(s.bucket_settings()) as b:
        published = ckpt.list_versions(b, s.run)
    s.timings["down"] = await asyncio.to_thread(s.down)
    assert not s.container_ids("trainer-cpu")
    s.timings["up again"] = await asyncio.to_thread(s.up, "--scale", f"judge={JUDGES}")
    # (the trainer may commit batches still pending while it stops: never fewer versions)
    assert trained(s) >= last, "Redis lost the trainer's version over down/up"
    with Bucket(s.bucket_settings()) as b:
        assert ckpt.list_versions(b, s.run)[: len(published)] == published, "the bucket lost versions"
    resumed = trained(s)
    load = Load(url=s.url, agents=2, turns=3, max_tokens=4, api_key=s.api_key).start()
    try:
        await until(lambda: trained(s) > resumed, 300, "a version trained after down/up")
        await until(lambda: any(int(x.weight_version or 0) >= resumed for x in load.served), 120,
                    "the resumed stack serving the last trained version")
    finally:
        await load.stop()
    with Bucket(s.bucket_settings()) as b:
        versions = ckpt.list_versions(b, s.run)
        manifests = [ckpt.read_manifest(b, ckpt.manifest_key(s.run, v)) for v in versions if v > published[-1]]
    # One lineage: the first version trained after `up` builds on the last one committed before
    # `down`, and each later one on the one before. A number may be skipped, never reused: a
    # commit cut off by a kill or the stop leaves files without a manifest, and the next
    # version is numbered above them (services/trainer/checkpoint.py).
    before = {b: a for a, b in itertools.pairwise(versions)}
    assert all(m.parent == before[m.version] for m in manifests), [(m.version, m.parent) for m in manifests]
    print(f"compose: served {len(load.served)} after down/up; versions {last} -> {trained(s)}; "
          f"timings {json.dumps({k: round(v, 1) for k, v in s.timings.items()})}")


def first_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() and "Container" not in line and "Creating" not in line:
            return line
    return ""


async def account(s: ComposeStack, load: Load) -> None:
    """Drain, then follow every served response to its batch or its documented exclusion."""
    k = Keys(s.prefix)

    def drained() -> bool:
        with s.redis() as r:
            return (group_drained(r, k.turns, K.GROUP_JUDGE) and group_drained(r, k.scored, K.GROUP_BUFFER)
                    and group_drained(r, k.batches, K.GROUP_TRAINER)
                    and r.zcard(k.pending_deadlines) == 0 and r.zcard(k.force_candidates) == 0)

    await until(drained, 240, "every stage drained (turns judged, decided, batched, trained)")
    with s.redis() as r:
        turns = {t.id: t for t in read(r, k.turns, Turn)}
        scored = {x.turn.id for x in read(r, k.scored, ScoredTurn)}
        batches = read(r, k.batches, TrainBatch)
        decisions = {t.id: r.hget(k.session_decisions(t.session_id), t.id) for t in turns.values()}
        dead = r.xlen(k.dead)
    by_completion = {t.completion_id: t for t in turns.values()}
    missing = [x for x in load.served if x.completion_id not in by_completion]
    assert not missing, f"{len(missing)} of {len(load.served)} served responses never captured"
    assert set(turns) <= scored, f"{len(set(turns) - scored)} captured turns never judged"
    sample_ids = collections.Counter(x.id for b in batches for x in b.samples)
    twice = [i for i, n in sample_ids.items() if n > 1]
    assert not twice, f"turns in two batches: {twice[:5]}"
    undecided = [i for i, d in decisions.items() if d is None]
    assert not undecided, f"{len(undecided)} turns the buffer never decided"
    for turn_id, outcome in decisions.items():
        if outcome in ("kept", "forced"):
            assert turn_id in sample_ids, f"turn {turn_id} was {outcome} but is in no batch"
        else:
            assert outcome in DOCUMENTED, f"turn {turn_id}: undocumented outcome {outcome!r}"
            assert turn_id not in sample_ids, f"turn {turn_id} excluded ({outcome}) yet batched"
    with Bucket(s.bucket_settings()) as b:
        manifests = [ckpt.read_manifest(b, ckpt.manifest_key(s.run, v)) for v in ckpt.list_versions(b, s.run)]
    trained_in = collections.Counter(i for m in manifests for i in m.consumed_batch_ids)
    twice = [i for i, n in trained_in.items() if n > 1]
    assert not twice, f"batches trained in two versions: {twice}"
    untrained = [x.id for x in batches if x.id not in trained_in]
    assert not untrained, f"{len(untrained)} batches never trained"
    assert dead == 0, "dead letters"
    print(f"compose: served {len(load.served)} responses ({load.failures} failed requests retried); "
          f"{len(turns)} turns; {len(batches)} batches in {len(manifests)} versions; "
          f"decisions {dict(collections.Counter(decisions.values()))}; "
          f"judged per judge {judged_per_judge(s)}; timings {json.dumps({k: round(v, 1) for k, v in s.timings.items()})}")

