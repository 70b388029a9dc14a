"""The Redis ACL users (services/ctl/redis_acl.py) against a real redis-server.

One server for the module, started with an aclfile (its admin has a password); each test
sets the users up (`ACL SETUSER`, as `up`'s aclfile would) for a prefix of its own. Per
role, the service's own Redis code runs as that user — the bus and consumer, the
collector's pending store, the buffer's whole app, the watcher's reports, the CLI — and
what the role must not do is refused (NOPERM): the collector reading `batches`, the judge
writing `batches`, the trainer writing `turns`, the watcher deleting streams, and every
role FLUSHALL, CONFIG, KEYS, ACL...
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ResponseError

from services.buffer.ledger import Ledger
from services.buffer.rules import build_sample
from services.collector.capture import group_records, make_record
from services.collector.pending_store import PendingStore
from services.collector.response_store import ResponseStore
from services.ctl import redis_acl
from services.ctl.__main__ import main as nextstate
from services.ctl.infra import free_port, redis_argv
from services.ctl.proc_states import RedisStates
from services.ctl.status import snapshot
from services.watcher.report import WatcherState, publish_state, record_refusal
from shared import keys as K
from shared.chat import PromptCache
from shared.consumer import Consumer, Delivery
from shared.errors import BusError
from shared.schemas import CheckpointPublished, Outcome, PolicyLoaded, ScoredTurn, TrainBatch, Turn
from shared.settings import Settings
from shared.streams import Bus
from tests.integration.test_buffer import buffer_settings, running, scored_turn
from tests.support.servers import stop_process, wait_until
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

ADMIN_PASSWORD = secrets.token_hex(16)
FAST = {"claim_idle_ms": 300, "retry_delay_ms": 30, "block_ms": 100, "max_deliveries": 2,
        "shutdown_grace_s": 2.0, "linger_ms": 0}
DENIED = re.compile(r"NOPERM|no permissions|can't (run|access)")
SERVICE_ROLES = redis_acl.SERVICE_ROLES


@pytest.fixture(scope="module")
def acl_port() -> Iterator[int]:
    """A redis-server whose users come from an aclfile: the admin's password is ADMIN_PASSWORD."""
    workdir = Path(tempfile.mkdtemp(prefix="ns-redis-acl-"))
    users = redis_acl.write_aclfile(workdir / "users.acl", {**redis_acl.new_passwords(),
                                                              redis_acl.ADMIN: ADMIN_PASSWORD}, "boot")
    port = free_port()
    proc = subprocess.Popen(redis_argv(port, workdir, persist=False, aclfile=users),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port, password=ADMIN_PASSWORD, socket_timeout=1, socket_connect_timeout=1)
    try:
        wait_until(lambda: bool(client.ping()), 10, f"redis-server on :{port}")
        yield port
    finally:
        client.close()
        stop_process(proc)


@dataclass
class Acl:
    """The users of one test's prefix on the module's server."""

    port: int
    prefix: str
    passwords: dict[str, str]
    clients: list[Any] = field(default_factory=list)

    def url(self, user: str) -> str:
        return redis_acl.url(user, self.passwords[user], "127.0.0.1", self.port)

    def settings(self, user: str) -> Settings:
        return Settings(env="test", run=f"run-{self.prefix}", redis={"url": self.url(user), "prefix": self.prefix},
                        streams=FAST)

    def bus(self, user: str) -> Bus:
        bus = Bus(self.settings(user))
        self.clients.append(bus.redis)
        return bus

    @property
    def keys(self) -> K.Keys:
        return K.Keys(self.prefix)


@pytest.fixture
async def acl(acl_port: int, unique: str) -> AsyncIterator[Acl]:
    passwords = {**redis_acl.new_passwords(), redis_acl.ADMIN: ADMIN_PASSWORD}
    a = Acl(acl_port, f"t-{unique}", passwords)
    admin = a.bus(redis_acl.ADMIN).redis
    for cmd in redis_acl.setuser_commands(passwords, a.prefix):
        await admin.execute_command(*cmd)
    yield a
    for client in a.clients:
        with contextlib.suppress(Exception):
            await client.aclose()


async def denied(call: Awaitable[Any]) -> str:
    """`call` fails because the ACL refuses it (directly, or inside a script)."""
    try:
        await call
    except (ResponseError, BusError) as exc:
        assert DENIED.search(str(exc)), f"failed, but not for permissions: {exc}"
        return str(exc)
    raise AssertionError("allowed, should have been refused")


def turn(session: str = "s", i: int = 0) -> Turn:
    return Turn(session_id=session, turn_index=i, messages=[{"role": "user", "content": "q"}],
                response={"role": "assistant", "content": "a"}, prompt_ids=[1, 2, 3],
                response_ids=[4, 5], response_logprobs=[-0.1, -0.2],
                next_state=[{"role": "user", "content": "thanks"}])


async def acked(admin: Any, key: str, group: str) -> bool:
    groups = await admin.xinfo_groups(key)
    g = next((g for g in groups if g["name"] == group), None)
    return g is not None and int(g["pending"]) == 0 and g["lag"] == 0


# -- every role -----------------------------------------------------------------------------------
ADMIN_ONLY = [
    ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "maxmemory"), ("CONFIG", "SET", "maxmemory", "0"),
    ("KEYS", "*"), ("SCAN", "0"), ("RANDOMKEY",), ("INFO",), ("ACL", "LIST"), ("ACL", "WHOAMI"),
    ("CLIENT", "LIST"), ("CLIENT", "KILL", "ID", "1"), ("SLOWLOG", "GET"), ("MODULE", "LIST"),
    ("EVAL", "return 1", "0"), ("FUNCTION", "FLUSH"), ("SCRIPT", "FLUSH"), ("PUBLISH", "c", "m"),
    ("BGSAVE",), ("SWAPDB", "0", "1"),
]
# Never run for real: ACL DRYRUN asks whether the user could.
ADMIN_ONLY_DRY = [("SHUTDOWN",), ("DEBUG", "SLEEP", "0"), ("MONITOR",), ("REPLICAOF", "NO", "ONE"),
                  ("SUBSCRIBE", "c"), ("MIGRATE", "h", "1", "k", "0", "1"), ("ACL", "SETUSER", "x")]


@pytest.mark.parametrize("role", redis_acl.ROLES)
async def test_no_role_administers_the_server(acl: Acl, role: str) -> None:
    client = acl.bus(role).redis
    assert await client.ping()
    for cmd in ADMIN_ONLY:
        await denied(client.execute_command(*cmd))
    admin = acl.bus(redis_acl.ADMIN).redis
    for cmd in ADMIN_ONLY_DRY:
        reply = await admin.execute_command("ACL", "DRYRUN", role, *cmd)
        assert reply != "OK" and "no permissions" in reply, (role, cmd, reply)
    # Another prefix's keys are out of reach, even for the operator.
    await denied(client.execute_command("GET", "another-prefix:policy-version"))
    await denied(client.execute_command("SET", "another-prefix:x", "1"))


async def test_the_admin_needs_its_password_and_may_do_anything(acl: Acl) -> None:
    anonymous = aioredis.Redis(port=acl.port, socket_timeout=2)
    acl.clients.append(anonymous)
    with pytest.raises(AuthenticationError):
        await anonymous.ping()
    wrong = aioredis.Redis.from_url(redis_acl.url("judge", "nope", "127.0.0.1", acl.port), socket_timeout=2)
    acl.clients.append(wrong)
    with pytest.raises(AuthenticationError):
        await wrong.ping()
    admin = acl.bus(redis_acl.ADMIN).redis
    assert await admin.config_get("appendonly")
    assert {u for u in await admin.acl_users()} >= set(redis_acl.USERS)


# -- collector ------------------------------------------------------------------------------------
async def test_collector_stores_pending_turns_and_publishes_turns_only(acl: Acl) -> None:
    bus, k = acl.bus("collector"), acl.keys
    store = PendingStore(bus.redis, k, ttl_s=60)
    now = time.time()
    cache = PromptCache(text="q", ids=[1, 2, 3], cuts=[])
    r1, lineage = make_record(turn(), cache, now + 60)
    r2, _ = make_record(turn(), cache, now - 1)
    await store.put("h1", r1, now + 60, lineage, now)
    await store.put("h2", r2, now - 1, "{}", now)
    closed, got_lineage = await store.lookup(["h1"], "h1", ["[]"])
    assert (closed.records, got_lineage, closed.shed) == ([r1], lineage, 0)  # closed = emitted
    assert await store.expire(time.time()) == (1, 0)
    await store.drop(["h3"])
    # A group (n = 2): closing one member reaches its sibling's keys inside the script.
    members = [turn().model_copy(update={"group_id": "g", "group_index": i, "group_size": 2,
                                         "response": {"role": "assistant", "content": f"a{i}"}})
               for i in range(2)]  # fmt: skip
    held = group_records(members, cache, ["g0", "g1"], now + 60)
    await store.put_many([(h, x.record, x.lineage, x.anchors) for h, x in held], now + 60, now)
    closed, _ = await store.lookup(["g0"], "g0", ["[]"])
    assert (closed.records[0] is not None, closed.unchosen) == (True, 1)
    # Pairing anchors: registered with a pending turn (a script), then the turn they name
    # closed by a request whose prefix rule found nothing (the close script reads them).
    await store.put("h5", r1, now + 60, lineage, now, anchors=["an1", "an2"])
    closed, _ = await store.lookup(["nope"], "nope", ["[]"], ["an0", "an2"])
    assert (closed.via, closed.via_record, closed.via_hash, closed.via_lineage) == (2, r1, "h5", lineage)
    assert await bus.publish(K.TURNS, turn()) is not None
    admin = acl.bus(redis_acl.ADMIN).redis
    assert await admin.xlen(k.turns) == 6
    # A session's last turn and its stored Responses object, in one round trip; a pending
    # turn with one (and a server that lost the scripts loads them again).
    await admin.script_flush()
    assert await store.publish(turn().to_json(), (k.stored_response("resp_0"), "{}", 60_000))
    await store.put("h4", r1, now + 60, lineage, now, (k.stored_response("resp_00"), "{}", 60_000))
    closed, got_lineage = await store.lookup(["h4"], "h4", ["[]"])
    assert (closed.records, got_lineage, closed.shed) == ([r1], lineage, 0)
    assert await admin.get(k.stored_response("resp_0")) == await admin.get(k.stored_response("resp_00")) == "{}"
    await admin.xtrim(k.turns, maxlen=3, approximate=False)
    assert await bus.publish_raw(K.TURNS, "{}", maxlen=3) is None  # over its bound: shed, counted
    assert await admin.xlen(k.turns) == 3 and await admin.get(k.shed(k.turns)) == "1"
    responses = ResponseStore(bus.redis, k, ttl_s=60, timeout_s=5)  # /v1/responses with store
    await responses.put({"id": "resp_1"}, [{"role": "user", "content": "q"}])
    stored = await responses.get("resp_1")
    assert stored is not None and stored.messages == [{"role": "user", "content": "q"}]
    assert await responses.delete("resp_1") and await responses.get("resp_1") is None

    await denied(bus.redis.xrange(k.batches))  # reads no batches...
    await denied(bus.redis.xrange(k.turns))  # ...nor even the turns it writes
    await denied(bus.redis.xreadgroup("judge", "x", {k.turns: ">"}))
    await denied(bus.publish(K.BATCHES, turn()))
    await denied(bus.publish(K.SCORED, turn()))
    await denied(bus.redis.xadd(k.dead, {"data": "x"}))
    await denied(bus.redis.delete(k.turns))
    await denied(bus.redis.set(k.turns, "x"))  # SET is allowed, but not on a stream
    await denied(bus.redis.xtrim(k.turns, maxlen=0))
    await denied(bus.redis.get(k.trainer_version))
    await denied(bus.redis.hset(k.services, "collector", "{}"))


# -- judge ------------------------------------------------------------------------------------------
async def test_judge_consumes_turns_and_publishes_scored_only(acl: Acl) -> None:
    collector, judge, k = acl.bus("collector"), acl.bus("judge"), acl.keys
    admin = acl.bus(redis_acl.ADMIN).redis
    handled: list[str] = []

    async def handle(t: Turn, d: Delivery) -> None:
        if t.session_id == "fails":
            raise RuntimeError("judge model down")
        await judge.publish(K.SCORED, ScoredTurn(id=t.id, turn=t, reward=1))
        handled.append(t.id)

    consumer = Consumer(judge, K.TURNS, K.GROUP_JUDGE, Turn, handle, name="judge-0")
    task = asyncio.create_task(consumer.run())
    turns = [turn(f"s{i}") for i in range(3)]
    for t in turns:
        await collector.publish(K.TURNS, t)
    await collector.publish(K.TURNS, turn("fails"))  # retried, reclaimed, then dead-lettered
    await admin.xadd(k.turns, {"data": "not json"})  # dead-lettered at once
    await eventually(lambda: len(handled) == 3, what="three turns judged")
    await eventually(lambda: _eq(admin.xlen(k.dead), 2), what="both dead letters")
    await eventually(lambda: acked(admin, k.turns, K.GROUP_JUDGE), what="every turn acked")
    await collector.publish(K.TURNS, turns[0])  # sent again by its producer: deduped by id
    await eventually(lambda: acked(admin, k.turns, K.GROUP_JUDGE), what="the duplicate acked")
    assert sorted(handled) == sorted(t.id for t in turns)
    assert await admin.xlen(k.scored) == 3
    assert await judge.trim_consumed(K.TURNS, retain=1, slack=0) == 5  # the janitor's trim script
    assert await admin.xlen(k.turns) == 1
    consumer.stop()
    await asyncio.wait_for(task, 10)

    await denied(judge.redis.xadd(k.batches, {"data": "x"}))  # writes no batches
    await denied(judge.publish(K.BATCHES, turn()))
    await denied(judge.redis.xrange(k.batches))
    await denied(judge.redis.xadd(k.turns, {"data": "x"}))  # forges no turns
    await denied(judge.publish(K.TURNS, turn()))
    forge = judge.redis.register_script("return redis.call('XADD', KEYS[1], '*', 'data', 'x')")
    await denied(forge(keys=[k.turns]))  # scripts run with the caller's rights
    await denied(judge.redis.delete(k.turns))
    await denied(judge.redis.set(k.turns, "x"))
    await denied(judge.redis.xgroup_destroy(k.turns, K.GROUP_JUDGE))
    await denied(judge.redis.xrange(k.scored))
    await denied(judge.redis.xrange(k.dead))
    await denied(judge.redis.get(k.pending_turn("h1")))
    await denied(judge.redis.set(k.done(K.GROUP_BUFFER, "m1"), 1))  # another group's marks


async def test_judge_keeps_its_experience_store_and_replays(acl: Acl) -> None:
    """Experiential learning as the judge user: the store's scripts (save, hold, claim,
    finish), its reads, and the replays stream in group `judge`; nothing else of the kind."""
    from services.judge.experience import Experience, ExperienceStore
    from services.judge.settings import JudgeConfig
    from shared.schemas import Replay

    judge, k = acl.bus("judge"), acl.keys
    store = ExperienceStore(judge, JudgeConfig(experience_store_max=2))
    t = turn("s1")
    assert await store.hold(t, time.time() - 1) == "held" and await store.held_ids("s1") == [t.id]
    for i, session in enumerate(("s1", "s2", "s3")):
        record = Experience(id=f"end{i}", session_id=session, user="u", lessons=[f"lesson {i} about trains"],
                            prompt_version="experience-v1")
        assert await store.save(record) and not await store.save(record)  # once per ending
    assert await store.hold(turn("s1", 1), time.time()) == "ended"
    # end0 was trimmed (the bound); s1 is the turn's own session
    assert [r.id for r in await store.relevant("u", "trains", exclude_session="s1")] == ["end2", "end1"]
    assert len(await judge.redis.lrange(k.experience_global, 0, -1)) == 2  # the bound
    (session, score), = await store.overdue(time.time(), 10)
    assert session == "s1" and await store.claim("s1", score, time.time() + 60)
    await judge.publish(K.REPLAYS, Replay(session_id="s1", reason="deadline"))
    got: list[str] = []

    async def handle(r: Replay, d: Delivery) -> None:
        for turn_id in await store.held("s1"):
            await store.release(r.session_id, turn_id)
        assert await store.finish(r.session_id)
        got.append(r.session_id)

    consumer = Consumer(judge, K.REPLAYS, K.GROUP_REPLAY, Replay, handle, name="judge-0")
    task = asyncio.create_task(consumer.run())
    await eventually(lambda: got == ["s1"], what="the replay handled")
    consumer.stop()
    await asyncio.wait_for(task, 10)
    assert await store.overdue(time.time() + 120, 10) == []
    await denied(judge.redis.delete(k.experience_global))  # no DEL of the store
    await denied(judge.redis.lrange(k.batches, 0, 1))


async def test_judge_keeps_the_reward_window_and_ctl_reads_it(acl: Acl) -> None:
    """The reward-collapse window's script as the judge user, `nextstate status` reading it as
    ctl; the judge cannot delete the window nor touch the buffer's counts through it."""
    from services.judge.collapse import RewardWindow
    from services.judge.settings import JudgeConfig
    from shared.schemas import Vote

    judge, k = acl.bus("judge"), acl.keys
    window = RewardWindow(judge, JudgeConfig(collapse_window=3, collapse_min_turns=2))
    for i in range(4):
        t = turn(f"s{i}")
        state = await window.add(ScoredTurn(id=t.id, turn=t, reward=1, votes=[Vote(score=1)]))
    assert state is not None and state.turns == 3 and state.alarm == ("one-value",)
    snap = await snapshot(acl.bus("ctl"))
    assert snap["rewards"]["alarm"] == ["one-value"] and snap["rewards"]["turns"] == 3
    await denied(judge.redis.delete(k.reward_window))
    await denied(judge.redis.hincrby(k.buffer_counts, "kept", 1))
    sneak = judge.redis.register_script("return redis.call('HINCRBY', KEYS[1], 'kept', 1)")
    await denied(sneak(keys=[k.buffer_counts]))


# -- buffer -----------------------------------------------------------------------------------------
async def test_buffer_app_runs_as_the_buffer_user(acl: Acl) -> None:
    """The real buffer app (consumer, intake, ledger scripts, finals, batcher, /get_data)."""
    judge, trainer, buffer, k = acl.bus("judge"), acl.bus("trainer"), acl.bus("buffer"), acl.keys
    admin = acl.bus(redis_acl.ADMIN).redis
    await trainer.redis.set(k.trainer_version, 3)
    bs = buffer_settings(acl.settings("buffer"), batch_size=16, max_wait_s=0.2, force_settle_s=60,
                         group_advantage="group_mean")
    async with running(bs) as client:
        await judge.publish(K.SCORED, scored_turn("A", 0, reward=1, policy_version=3))
        await judge.publish(K.SCORED, scored_turn("F", 1, final=True, policy_version=3))  # parked...
        await judge.publish(K.SCORED, scored_turn("F", 0, reward=0, policy_version=3))  # excluded
        # Two episodes of one group: their turns held, joined with their outcomes.
        envs = acl.bus(redis_acl.ADMIN)  # whoever publishes outcomes: not the buffer's concern
        for i, reward in enumerate((1.0, -1.0)):
            await judge.publish(K.SCORED, scored_turn(f"env:{i}", 0, reward=1, policy_version=3))
            await envs.publish(K.OUTCOMES, Outcome(
                id=f"episode.{i}", run="r", env="echo", task_id="t", session_id=f"env:{i}",
                group="g", group_index=i, group_size=2, reward=reward))
        # A chat group (n = 2): both members held until the group came, then compared.
        for i, reward in enumerate((1, -1)):
            st = scored_turn("C", 0, reward=reward, policy_version=3)
            member = st.turn.model_copy(update={"group_id": "chatcmpl-c", "group_index": i, "group_size": 2})
            await judge.publish(K.SCORED, st.model_copy(update={"turn": member}))
        await eventually(lambda: acked(admin, k.scored, K.GROUP_BUFFER), what="all scored turns handled")
        await eventually(lambda: acked(admin, k.outcomes, K.GROUP_OUTCOMES), what="the outcomes handled")
        await eventually(lambda: _eq(admin.zcard(k.force_candidates), 0), what="...then forced")
        await eventually(lambda: _eq(admin.zcard(k.episode_sessions), 0), what="episodes decided")
        await eventually(lambda: _eq(admin.zcard(k.chat_groups), 0), what="the chat group decided")
        pulled: list[TrainBatch] = []

        async def pull() -> bool:  # GET /get_data: the pull trainers' `trainer` group
            resp = await client.get("/get_data", params={"n": 8})
            assert resp.status_code == 200, resp.text
            pulled.extend(TrainBatch.model_validate(b) for b in resp.json()["batches"])
            return sum(len(b.samples) for b in pulled) >= 6

        await eventually(pull, what="the batches, pulled through /get_data")
        assert sorted((s.session_id, s.forced, s.reward) for b in pulled for s in b.samples) == [
            ("A", False, 1.0), ("C", False, -1.0), ("C", False, 1.0), ("F", True, 0.0),
            ("env:0", False, 1.0), ("env:1", False, -1.0)]
        counts = await admin.hgetall(k.buffer_counts)
        assert counts == {"kept": "5", "forced": "1", "zero_reward": "1"}
        assert json.loads(await admin.get(k.run_owner))["run"] == f"run-{acl.prefix}"

    # The archive's group on `batches`, as the buffer's second consumer.
    archived: list[str] = []

    async def archive(b: TrainBatch, d: Delivery) -> None:
        archived.append(b.id)

    consumer = Consumer(buffer, K.BATCHES, K.GROUP_ARCHIVE, TrainBatch, archive, name="buffer-archive")
    task = asyncio.create_task(consumer.run())
    await eventually(lambda: acked(admin, k.batches, K.GROUP_ARCHIVE), what="batches archived")
    consumer.stop()
    await asyncio.wait_for(task, 10)
    assert len(archived) == await admin.xlen(k.batches) > 0
    # What the archive holds on purpose, for `nextstate status` (write only).
    await buffer.redis.hset(k.archive_state, "buffer-archive", json.dumps({"held_since": None}))
    await denied(buffer.redis.hgetall(k.archive_state))
    assert await admin.hgetall(k.archive_state) == {"buffer-archive": '{"held_since": null}'}
    assert await buffer.publish(K.TURNS, turn()) is not None  # POST /receive publishes imports

    ledger = Ledger(buffer, acl.settings("buffer"), 60)
    assert await ledger.lookup("nope") == (False, 3)
    await denied(buffer.redis.set(k.trainer_version, 9))  # reads the trainer's version only
    await denied(buffer.redis.xadd(k.scored, {"data": "x"}))  # consumes scored, never writes it
    await denied(buffer.publish(K.SCORED, turn()))
    await denied(buffer.redis.xrange(k.turns))  # publishes imports, reads no turns
    await denied(buffer.redis.delete(k.batches))
    await denied(buffer.redis.set(k.batches, "x"))
    await denied(buffer.redis.get(k.pending_turn("h1")))
    await denied(buffer.redis.hset(k.watcher_state, "x", "1"))
    await denied(buffer.redis.xadd(k.checkpoints, {"data": "x"}))


# -- trainer ----------------------------------------------------------------------------------------
async def test_trainer_consumes_batches_and_announces_versions_only(acl: Acl) -> None:
    buffer, trainer, k = acl.bus("buffer"), acl.bus("trainer"), acl.keys
    admin = acl.bus(redis_acl.ADMIN).redis
    ledger = Ledger(buffer, acl.settings("buffer"), 60)
    sample = build_sample(scored_turn("T", 0), "rl")
    assert (await ledger.publish_batch([sample])).batch is not None
    assert (await ledger.publish_batch([sample])).already_batched == {sample.id}  # never twice
    trained: list[str] = []

    async def train(b: TrainBatch, d: Delivery) -> None:  # what TrainerService does in Redis
        await trainer.redis.set(k.trainer_version, 1)
        await trainer.publish(K.CHECKPOINTS, CheckpointPublished(run="r", version=1, manifest="m"))
        await trainer.redis.hset(k.refused_versions, mapping={"LATEST": json.dumps({"by": "trainer"})})
        trained.append(b.id)

    consumer = Consumer(trainer, K.BATCHES, K.GROUP_TRAINER, TrainBatch, train, name="trainer-r")
    task = asyncio.create_task(consumer.run())
    await eventually(lambda: acked(admin, k.batches, K.GROUP_TRAINER), what="the batch trained")
    consumer.stop()
    await asyncio.wait_for(task, 10)
    assert len(trained) == 1 and await admin.get(k.trainer_version) == "1"
    assert await admin.xlen(k.checkpoints) == 1 and await admin.hexists(k.refused_versions, "LATEST")

    await denied(trainer.redis.xadd(k.turns, {"data": "x"}))  # writes no turns
    await denied(trainer.publish(K.TURNS, turn()))
    await denied(trainer.redis.xadd(k.batches, {"data": "x"}))
    await denied(trainer.redis.delete(k.batches))
    await denied(trainer.redis.xrange(k.scored))
    await denied(trainer.redis.set(k.policy_version, 1))
    await denied(trainer.redis.delete(k.trainer_version))
    await denied(trainer.redis.xrange(k.checkpoints))


# -- watcher ----------------------------------------------------------------------------------------
async def test_watcher_reports_what_the_engine_serves_and_deletes_no_stream(acl: Acl) -> None:
    watcher, k = acl.bus("watcher"), acl.keys
    admin = acl.bus(redis_acl.ADMIN).redis
    # publish_state and record_refusal only log Redis errors: check what landed.
    await publish_state(watcher, WatcherState(engine="http://engine", observed="3", target=3))
    assert await admin.get(k.policy_version) == "3"
    assert (await admin.hgetall(k.watcher_state))["engine_version"] == "3"
    await publish_state(watcher, WatcherState(engine="http://engine", observed=None, target=3))
    assert await admin.get(k.policy_version) is None  # unreachable: the key is deleted
    assert (await admin.hgetall(k.watcher_state))["mismatch"] == "1"
    await record_refusal(watcher, 4, "sha256_mismatch", "shard 1")
    assert json.loads(await admin.hget(k.refused_versions, "4"))["by"] == "watcher"
    assert await watcher.publish(K.POLICY, PolicyLoaded(run="r", version=3, weight_version="3")) is not None
    assert await admin.xlen(k.policy) == 1

    await denied(watcher.redis.delete(k.policy))  # deletes no stream...
    await denied(watcher.redis.delete(k.turns))
    await denied(watcher.redis.delete(k.checkpoints))
    await denied(watcher.redis.xtrim(k.policy, maxlen=0))
    await denied(watcher.redis.delete(k.watcher_state))  # ...nor any key but policy-version
    await denied(watcher.redis.set(k.trainer_version, 9))
    await denied(watcher.redis.xadd(k.turns, {"data": "x"}))
    await denied(watcher.redis.xrange(k.policy))
    await denied(watcher.redis.hgetall(k.refused_versions))


# -- ctl, keda ------------------------------------------------------------------------------------
async def test_ctl_operates_everything_under_the_prefix(acl: Acl, capsys: pytest.CaptureFixture[str]) -> None:
    collector, judge, k = acl.bus("collector"), acl.bus("judge"), acl.keys
    ctl = acl.bus("ctl")
    admin = acl.bus(redis_acl.ADMIN).redis
    await collector.publish(K.TURNS, turn())
    await judge.ensure_group(K.TURNS, K.GROUP_JUDGE)
    await judge.dead_letter(K.TURNS, K.GROUP_JUDGE, "1-0", turn("dead").to_json(), "boom", 5, "judge-0")
    # `up`'s supervisor writes the services hash as ctl.
    states = RedisStates(acl.url("ctl"), k.services)
    assert await states.write({"judge-0": {"state": "ready"}}), states.error
    await states.aclose()

    snap = await snapshot(ctl)
    assert snap["dead_letters"] == 1 and snap["services"] == {"judge-0": {"state": "ready"}}
    assert {s["stream"]: s["length"] for s in snap["streams"]}[K.TURNS] == 1

    def cli(*argv: str) -> int:
        return nextstate(["--redis-url", acl.url("ctl"), "--prefix", acl.prefix, *argv])

    assert await asyncio.to_thread(cli, "status", "--json", "--window", "0") == 0
    assert json.loads(capsys.readouterr().out)["dead_letters"] == 1
    assert await asyncio.to_thread(cli, "tail", "turns") == 0
    assert await asyncio.to_thread(cli, "dlq", "requeue", "--all") == 0  # EVALSHA + XDEL
    assert await admin.xlen(k.dead) == 0 and await admin.xlen(k.turns) == 2

    await denied(ctl.redis.config_get("maxmemory"))
    await denied(ctl.redis.acl_list())
    await denied(ctl.redis.get("another-prefix:trainer-version"))
    await denied(ctl.redis.publish("channel", "x"))
    await denied(ctl.redis.execute_command("FUNCTION", "LOAD", "#!lua name=x\nredis.register_function('f', function() return 1 end)"))


async def test_keda_reads_the_judge_backlog_only(acl: Acl) -> None:
    collector, judge, keda, k = acl.bus("collector"), acl.bus("judge"), acl.bus("keda"), acl.keys
    await collector.publish(K.TURNS, turn())
    await judge.ensure_group(K.TURNS, K.GROUP_JUDGE)
    (group,) = await keda.redis.xinfo_groups(k.turns)
    assert group["name"] == K.GROUP_JUDGE and group["lag"] == 1
    assert (await keda.redis.xpending(k.turns, K.GROUP_JUDGE))["pending"] == 0
    assert await keda.redis.xlen(k.turns) == 1
    await denied(keda.redis.xrange(k.turns))
    await denied(keda.redis.xreadgroup(K.GROUP_JUDGE, "keda", {k.turns: ">"}))
    await denied(keda.redis.xadd(k.turns, {"data": "x"}))
    await denied(keda.redis.xinfo_groups(k.batches))


async def _eq(value: Awaitable[Any], expected: Any) -> bool:
    return bool(await value == expected)
