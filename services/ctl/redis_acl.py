"""One Redis ACL user per service role, allowed only the keys and commands it needs.

Redis 7 ACLs. Every role is a *grant list*: each grant is one ACL selector — a set of
commands and the keys they may touch (`~k` read and write, `%R~k` read only, `%W~k`
write only). A command runs when one grant holds both the command and every key it
names, so the watcher's DEL reaches `policy-version` and never a stream, and the judge,
which must read and ack `turns`, still cannot XADD to it. Lua scripts (EVALSHA) run
with the caller's rights: the script's declared keys need read and write in the grant
that holds EVALSHA, and each command inside it is checked like any other.

Every role may also: PING, AUTH/HELLO and the other `@connection` commands that are not
`@admin`/`@dangerous`; MULTI/EXEC/DISCARD; SCRIPT LOAD/EXISTS. No role but `default`
gets `@admin` or `@dangerous` (FLUSHALL, KEYS, CONFIG, DEBUG, SHUTDOWN, ACL, INFO,
CLIENT KILL/LIST, MONITOR...), SCAN/RANDOMKEY, Pub/Sub, EVAL or FUNCTION. Key names are
`<prefix>:<name>` (shared/keys.py; `P:` below).

| role | may do | on keys |
| --- | --- | --- |
| collector | publish turns (bounded-XADD script: EVALSHA XLEN XADD INCR) | `P:turns`, `P:shed:turns` |
| | close-and-emit and anchor scripts: EVALSHA (inside them, GET SET DEL EXISTS ZREM and the bounded XADD, as granted above and below) | `P:turns`, `P:shed:turns`, `P:pending:*`, `P:pending-deadlines`, `P:anchor:*` |
| | pending turns: GET SET GETDEL DEL EXISTS ZADD ZREM ZRANGEBYSCORE | `P:pending:*`, `P:pending-deadlines`, `P:lineage:*`, `P:anchor:*` |
| | stored Responses objects (`store`, `previous_response_id`): GET SET DEL | `P:response:*` |
| judge | consume group `judge`: XGROUP CREATE, XREADGROUP, XACK, XCLAIM, XPENDING, XINFO GROUPS, XLEN, XRANGE, XREVRANGE, XTRIM, EVALSHA (trim) | `P:turns` |
| | dedupe marks: EXISTS SET | `P:done:judge:*` |
| | publish scored (bounded XADD) | `P:scored`, `P:shed:scored` |
| | dead letters: XADD | `P:dead` (write only) |
| | experiential learning: consume group `judge` on replays (as on turns), publish replays (bounded XADD) | `P:replays`, `P:shed:replays` |
| | the experience store and held turns: EVALSHA HGET HGETALL HKEYS HDEL HEXISTS HLEN HSET EXISTS EXPIRE LPUSH LTRIM LRANGE ZADD ZSCORE ZREM ZRANGEBYSCORE | `P:experience:session:*`, `P:experience:user:*`, `P:experience:global`, `P:experience:held:*`, `P:experience:waiting` |
| | the reward-collapse window (one script): EVALSHA HSETNX RPUSH HINCRBY LLEN LPOP HGET HDEL HGETALL HSET | `P:reward-window`, `P:reward-window-turns`, `P:reward-alarm` |
| buffer | consume group `buffer` (as the judge's) | `P:scored`, `P:done:buffer:*` |
| | consume group `buffer` on outcomes (as the judge's) | `P:outcomes`, `P:done:buffer:*` |
| | held episode turns and outcomes: the ledger's commands (below), + HGET HDEL HLEN ZRANGEBYSCORE | `P:episode-sessions`, `P:episode:*:turns`, `P:episode:*:outcome`, `P:episode-group:*` |
| | held chat group members (group advantages): as episode turns, + HKEYS | `P:chat-groups`, `P:chat-group:*` |
| | consume groups `archive` and `trainer` (`GET /get_data`), + XAUTOCLAIM | `P:batches`, `P:done:archive:*`, `P:done:trainer:*` |
| | publish batches (ledger script: EVALSHA XLEN XADD INCR) | `P:batches`, `P:shed:batches`, `P:batched:*` |
| | publish imported turns (bounded XADD) | `P:turns`, `P:shed:turns` |
| | ledger: EVALSHA HSETNX HINCRBY HEXISTS HGETALL SADD SCARD SISMEMBER EXPIRE SET GET DEL EXISTS ZADD ZSCORE ZREM ZRANGE | `P:session:*:samples`, `P:session:*:decisions`, `P:session:*:settled`, `P:buffer-counts`, `P:force-candidates`, `P:force-candidate:*`, `P:batched:*` |
| | the run owning the prefix: SET GET | `P:run` |
| | staleness: GET | `P:trainer-version` (read only) |
| | what the archive holds on purpose (for `nextstate status`): HSET HDEL | `P:archive-state` (write only) |
| | dead letters: XADD | `P:dead` (write only) |
| trainer | consume group `trainer` (as the judge's) | `P:batches`, `P:done:trainer:*` |
| | announce a version: XADD / SET | `P:checkpoints` / `P:trainer-version` (write only) |
| | refused checkpoints, the train/inference mismatch: HSET | `P:refused-versions`, `P:trainer-mismatch` (write only) |
| | the rebase to follow (`nextstate rollback`, the gate): GET | `P:lineage-base` (read only) |
| | retention keeps what the promotion gate serves or has yet to decide: HGETALL | `P:gate-state` (read only) |
| | dead letters: XADD | `P:dead` (write only) |
| watcher | announce a loaded policy: XADD | `P:policy` (write only) |
| | what the engine serves: SET DEL | `P:policy-version` (write only) |
| | its state, refused checkpoints: HSET | `P:watcher-state`, `P:refused-versions` (write only) |
| | the promotion gate: consume group `gate` (as the judge's, without dedupe marks) | `P:evals` |
| | announce a decision: XADD | `P:promotions` (write only) |
| | the gate's memory: HGETALL HSET HDEL | `P:gate-state` |
| | a rollback's rebase request: GET SET | `P:lineage-base` |
| | unreadable results: XADD | `P:dead` (write only) |
| evaluator | consume group `evaluator` (as the judge's) | `P:checkpoints`, `P:done:evaluator:*` |
| | the state of a model's evaluation (`eval run --model`), for the CLI waiting on it: HSET EXPIRE | `P:model-eval:*` (write only) |
| | enqueue evaluations (below), publish results: XADD | `P:evals` (write only) |
| | dead letters: XADD | `P:dead` (write only) |
| | its rq worker on queue `Q` = `P-eval` (below) | `rq:…` of that queue only |
| | `env:<name>` suites: enqueue held-out episodes (as `nextstate envs run`, at the front: LPUSH); count the envs workers: SCARD; read their results: HGETALL HLEN | `rq:workers:P-envs` (read only), `P:eval-episodes:*` (read only) |
| envs | publish outcomes once (script: EVALSHA GET XLEN XADD INCR SET) | `P:outcomes`, `P:shed:outcomes`, `P:outcome-published:*` |
| | evaluation episodes' results: HSET EXPIRE | `P:eval-episodes:*` (write only) |
| | its rq worker on queue `Q` = `P-envs` (as the evaluator's, jobs `episode_2e…`) | `rq:…` of that queue only |
| ctl | the operator (`nextstate status/tail/dlq/...`, `up`'s supervisor): every `@read` and `@write` command, transactions, EVALSHA | `P:*` |
| | enqueue evaluations (`nextstate eval run`, below) and episodes (`nextstate envs run`) | |
| | `nextstate envs status`: LLEN ZCARD SMEMBERS | `rq:queue:Q`, `rq:wip|finished|failed:Q`, `rq:workers:Q` of `P-envs` (read only) |
| keda | the judge autoscaler (KEDA redis-streams): XINFO GROUPS, XPENDING, XLEN | `P:turns` (read only) |
| | the envs autoscaler (KEDA redis `listLength`): LLEN | `rq:queue:P-envs` (read only) |
| default | admin: everything (`+@all ~* &*`); applies ACLs, nothing in the stack uses it | all |

rq (3.x) keeps its own keys under `rq:`, outside the prefix. What the evaluator's rq use
needs, found by recording every command of enqueues, jobs that succeed, fail and retry,
and a SIGKILLed worker's job requeued by another's maintenance (MONITOR), and granted
as exactly that (`Q` the eval queue `P-eval`, `J` an evaluation job's rq id `eval_2e…`):

- enqueue (`enqueue_evals`; evaluator, ctl): the guard SET GET DEL on `P:eval-enqueued:*`;
  SADD `rq:queues`; rq's unique-enqueue script: EVALSHA, and the EXISTS HSET EXPIRE RPUSH
  it runs, on `rq:job:J` and `rq:queue:Q`.
- a worker (`RQ_WORKER`): lists, hashes, sets, sorted sets, XADD (its results), WATCH, EVALSHA
  on `rq:queue:Q` and its `:intermediate` list, the queue's registries (`rq:wip:Q`,
  `finished`, `failed`, `deferred`, `ready`, `scheduled`, `canceled`), its maintenance lock
  `rq:clean_registries:Q`, `rq:workers` and `rq:workers:Q`, workers named `Q.…`
  (`rq:worker:Q.*`), and the jobs' keys (`rq:job:J…`, `rq:job::J…`, `rq:results:J`,
  `rq:execution:J:…`, `rq:executions:J`); `rq:suspended` read only.
- not INFO (shared/evaljobs.py learns the server version from HELLO), not Pub/Sub, not
  the rate-limit and job-group registries (shared/rqworker.py skips them); CLIENT
  SETNAME/INFO are `@connection`.

Three ways to put the users in a Redis: an aclfile loaded at start (`aclfile`,
`write_aclfile`: what `nextstate up` does, so a restarted Redis has them again); `ACL
SETUSER` commands (`setuser_commands`, e.g. for a managed Redis); and `container_script`,
the shell that docker-compose.yml and deploy/k8s run in the Redis container to write the
aclfile from `REDIS_*_PASSWORD` variables. `python -m services.ctl.redis_acl` prints them.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from shared import keys as K
from shared.keys import Keys

ADMIN = "default"
SERVICE_ROLES = ("collector", "judge", "buffer", "trainer", "watcher", "evaluator", "envs")
ROLES = (*SERVICE_ROLES, "ctl", "keda")
USERS = (ADMIN, *ROLES)

# The environment variable holding each user's password in compose and k8s.
PASSWORD_VARS = {ADMIN: "REDIS_PASSWORD", **{r: f"REDIS_{r.upper()}_PASSWORD" for r in ROLES}}

# Every role: the connection commands an ordinary client needs (AUTH, HELLO, PING,
# CLIENT SETNAME/ID/SETINFO... but no CLIENT KILL/LIST/PAUSE), transactions, script loading.
BASE = ("resetchannels", "-@all", "+@connection", "-@admin", "-@dangerous",
        "+multi", "+exec", "+discard", "+script|load", "+script|exists")

# A consumer-group member (shared/consumer.py): read, claim, ack, reclaim, inspect, trim.
CONSUME = ("xgroup|create", "xreadgroup", "xack", "xclaim", "xpending", "xinfo|groups",
           "xlen", "xrange", "xrevrange", "xtrim", "evalsha")
# A bounded publish (shared/streams.py `BOUNDED_XADD`): XLEN, then XADD or INCR the shed count.
PUBLISH = ("evalsha", "xlen", "xadd", "incr")

# An rq worker of one queue (shared/rqworker.py), on its keys only.
RQ_WORKER = ("blmove", "lmove", "lrange", "lrem", "rpush", "lpush", "llen", "exists", "expire",
             "persist", "del", "get", "set", "hget", "hgetall", "hset", "hincrby", "hincrbyfloat",
             "sadd", "srem", "smembers", "zadd", "zrem", "zrange", "zrangebyscore",
             "zremrangebyscore", "zcard", "zscore", "xadd", "watch", "unwatch", "evalsha")
# rq's id of an evaluation job starts so (shared/rqjobs.py `rq_job_id` of `eval.…`), an
# episode's so (of `episode.…`).
RQ_EVAL_JOB = "eval_2e*"
RQ_EPISODE_JOB = "episode_2e*"
RQ_REGISTRIES = ("wip", "finished", "failed", "deferred", "ready", "scheduled", "canceled")

_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")  # as RedisSettings: no glob characters


@dataclass(frozen=True)
class Grant:
    """Commands a role may run on some keys: one ACL selector."""

    commands: tuple[str, ...]
    keys: tuple[str, ...]  # ACL key patterns: `~k` read+write, `%R~k` read, `%W~k` write

    def selector(self) -> str:
        return "(" + " ".join([*self.keys, *(f"+{c}" for c in self.commands)]) + ")"


def _rw(*keys: str) -> tuple[str, ...]:
    return tuple(f"~{k}" for k in keys)


def _r(*keys: str) -> tuple[str, ...]:
    return tuple(f"%R~{k}" for k in keys)


def _w(*keys: str) -> tuple[str, ...]:
    return tuple(f"%W~{k}" for k in keys)


def _consume(k: Keys, stream: str, *groups: str, extra: tuple[str, ...] = ()) -> list[Grant]:
    marks = tuple(k.done(g, "*") for g in groups)
    return [Grant(CONSUME + extra, _rw(k.stream(stream))), Grant(("exists", "set"), _rw(*marks))]


def _publish(k: Keys, stream: str) -> Grant:
    # `~` (read+write), not `%W~`: EVALSHA needs both on its declared keys. The grant
    # holds no command that reads an entry, and a script's own calls are checked one by one.
    key = k.stream(stream)
    return Grant(PUBLISH, _rw(key, k.shed(key)))


def _dead(k: Keys) -> Grant:
    return Grant(("xadd",), _w(k.dead))


def _enqueue(queue: str, guard: str, job: str) -> list[Grant]:
    """Enqueue jobs `job` on `queue` with the guard keys `guard` (shared/rqjobs.py)."""
    return [
        Grant(("set", "get", "del"), _rw(guard)),
        Grant(("sadd",), _rw("rq:queues")),
        # rq's unique enqueue: one script, whose commands are checked like any other.
        Grant(("evalsha", "exists", "hset", "expire", "rpush", "lpush"), _rw(f"rq:job:{job}", f"rq:queue:{queue}")),
    ]


def enqueue_evals(k: Keys) -> list[Grant]:
    """Enqueue evaluation jobs (shared/evaljobs.py `enqueue_eval`)."""
    return _enqueue(k.eval_queue, k.eval_enqueued("*"), RQ_EVAL_JOB)


def enqueue_episodes(k: Keys) -> list[Grant]:
    """Enqueue episode jobs (shared/envjobs.py; `nextstate envs run`)."""
    return _enqueue(k.envs_queue, k.episode_enqueued("*"), RQ_EPISODE_JOB)


def envs_queue_status(k: Keys) -> Grant:
    """`nextstate envs status`: read the envs queue's list, registries and workers."""
    q = k.envs_queue
    return Grant(("llen", "zcard", "smembers"),
                 _r(f"rq:queue:{q}", *(f"rq:{r}:{q}" for r in ("wip", "finished", "failed")), f"rq:workers:{q}"))


def rq_worker(k: Keys, queue: str | None = None, job: str = RQ_EVAL_JOB) -> Grant:
    """An rq worker of `queue` (default the evaluation queue) running jobs `job`, named `<queue>.…`."""
    q = queue or k.eval_queue
    return Grant(RQ_WORKER, (
        *_rw(f"rq:queue:{q}", f"rq:queue:{q}:intermediate*",
             *(f"rq:{r}:{q}" for r in RQ_REGISTRIES), f"rq:clean_registries:{q}", "rq:queues",
             "rq:workers", f"rq:workers:{q}", f"rq:worker:{q}.*",
             *(f"rq:{kind}:{job}" for kind in ("job", "job:", "results", "execution", "executions"))),
        *_r("rq:suspended"),
    ))


def grants(role: str, k: Keys) -> list[Grant]:
    """What `role` may do on the keys of `k` (selectors; `ctl`, `keda` have none)."""
    if role == "collector":
        pending = (k.pending_turn("*"), k.pending_deadlines, k.pairing_anchor("*"))
        return [
            _publish(k, K.TURNS),
            # Closing a pending turn emits it in one script (collector/pending_store.py): the
            # script's keys in one selector; each command inside is checked by the others.
            Grant(("evalsha",), _rw(k.turns, k.shed(k.turns), *pending)),
            Grant(("get", "set", "getdel", "del", "exists", "zadd", "zrem", "zrangebyscore"),
                  _rw(*pending, k.turn_lineage("*"))),
            Grant(("get", "set", "del"), _rw(k.stored_response("*"))),
        ]
    if role == "judge":
        return [
            *_consume(k, K.TURNS, K.GROUP_JUDGE), _publish(k, K.SCORED), _dead(k),
            # Experiential learning (services/judge/experience.py, replay.py): the replays
            # (group `judge`: its dedupe marks are granted with `turns`'), the experience store
            # and the held turns (scripts: EVALSHA and the commands inside them).
            Grant(CONSUME, _rw(k.replays)),
            _publish(k, K.REPLAYS),
            Grant(("evalsha", "hget", "hgetall", "hkeys", "hdel", "hexists", "hlen", "hset", "exists",
                   "expire", "lpush", "ltrim", "lrange", "zadd", "zscore", "zrem", "zrangebyscore"),
                  _rw(k.experience_session("*"), k.experience_user("*"), k.experience_global,
                      k.experience_held("*"), k.experience_waiting)),
            # The reward-collapse window every replica shares (services/judge/collapse.py: one script).
            Grant(("evalsha", "hsetnx", "rpush", "hincrby", "llen", "lpop", "hget", "hdel", "hgetall", "hset"),
                  _rw(k.reward_window, k.reward_window_turns, k.reward_alarm)),
        ]
    if role == "buffer":
        batched = k.sample_batched("*")
        return [
            *_consume(k, K.SCORED, K.GROUP_BUFFER),
            *_consume(k, K.BATCHES, K.GROUP_ARCHIVE, K.GROUP_TRAINER, extra=("xautoclaim",)),
            # Episode outcomes (group `buffer`: its dedupe marks are granted with `scored`'s).
            Grant(CONSUME, _rw(k.outcomes)),
            Grant(PUBLISH, _rw(k.batches, k.shed(k.batches), batched)),
            _publish(k, K.TURNS),
            Grant(("evalsha", "hsetnx", "hincrby", "hexists", "hget", "hgetall", "hset", "hdel",
                   "hlen", "hkeys", "sadd", "scard", "sismember", "expire", "set", "get", "del",
                   "exists", "zadd", "zscore", "zrem", "zrange", "zrangebyscore"),
                  _rw(k.session_samples("*"), k.session_decisions("*"), k.session_settled("*"),
                      k.buffer_counts, k.force_candidates, k.force_candidate("*"), batched,
                      k.episode_sessions, k.episode_turns("*"), k.episode_outcome("*"),
                      k.episode_group("*"), k.chat_groups, k.chat_group("*"))),
            Grant(("set", "get"), _rw(k.run_owner)),
            Grant(("get",), _r(k.trainer_version)),
            Grant(("hset", "hdel"), _w(k.archive_state)),
            _dead(k),
        ]
    if role == "trainer":
        return [
            *_consume(k, K.BATCHES, K.GROUP_TRAINER),
            Grant(("xadd",), _w(k.checkpoints)),
            Grant(("set",), _w(k.trainer_version)),
            Grant(("hset",), _w(k.refused_versions, k.trainer_mismatch)),
            Grant(("get",), _r(k.lineage)),
            Grant(("hgetall",), _r(k.gate_state)),  # retention keeps what the gate needs
            _dead(k),
        ]
    if role == "watcher":
        return [
            Grant(("xadd",), _w(k.policy)),
            Grant(("set", "del"), _w(k.policy_version)),
            Grant(("hset",), _w(k.watcher_state, k.refused_versions)),
            # The promotion gate (services/watcher/gate.py).
            Grant(CONSUME, _rw(k.evals)),  # group `gate`; no dedupe marks: results are idempotent
            Grant(("xadd",), _w(k.promotions)),
            Grant(("hgetall", "hset", "hdel"), _rw(k.gate_state)),
            Grant(("get", "set"), _rw(k.lineage)),
            _dead(k),
        ]
    if role == "evaluator":
        return [
            *_consume(k, K.CHECKPOINTS, K.GROUP_EVALUATOR),
            Grant(("xadd",), _w(k.evals)),
            _dead(k),
            *enqueue_evals(k),
            rq_worker(k),
            # `env:<name>` suites: held-out episodes on the envs queue, their results read back.
            *enqueue_episodes(k),
            Grant(("scard",), _r(f"rq:workers:{k.envs_queue}")),
            Grant(("hgetall", "hlen"), _r(k.eval_episodes("*"))),
            Grant(("hset", "expire"), _w(k.model_eval("*"))),  # `eval run --model`: its job's state
        ]
    if role == "envs":
        out = k.outcomes
        return [
            # The exactly-once outcome publish (services/envs/outcomes.py): one script on the
            # stream, its shed counter and the job's marker; GET the marker before an attempt.
            Grant(("evalsha", "xlen", "xadd", "incr", "get", "set"),
                  _rw(out, k.shed(out), k.outcome_published("*"))),
            Grant(("get",), _r(k.outcome_published("*"))),
            Grant(("hset", "expire"), _w(k.eval_episodes("*"))),  # evaluation episodes' results
            rq_worker(k, k.envs_queue, RQ_EPISODE_JOB),
        ]
    if role in ("ctl", "keda"):
        return []
    raise ValueError(f"unknown Redis role {role!r}; one of {', '.join(USERS)}")


def _rules(user: str, k: Keys) -> list[str]:
    if user == ADMIN:
        return ["~*", "&*", "+@all"]
    if user == "ctl":  # every data command under the prefix; no server admin, no Pub/Sub
        return [f"~{k.prefix}:*", "resetchannels", "-@all", "+@connection", "+@read", "+@write",
                "+@transaction", "-@admin", "-@dangerous", "-@scripting", "-@pubsub",
                "-scan", "-randomkey", "+evalsha", "+script|load", "+script|exists",
                *(g.selector() for g in (*enqueue_evals(k), *enqueue_episodes(k), envs_queue_status(k)))]
    if user == "keda":  # the judges' scaler (stream lag) and the envs workers' (rq queue length)
        return [*_r(k.turns), *BASE, "+xinfo|groups", "+xpending", "+xlen",
                Grant(("llen",), _r(f"rq:queue:{k.envs_queue}")).selector()]
    return [*BASE, *(g.selector() for g in grants(user, k))]


def rules(user: str, prefix: str) -> list[str]:
    """The ACL rules of `user` (one of USERS) for key prefix `prefix`, without password."""
    if not _PREFIX.fullmatch(prefix):
        raise ValueError(f"Redis key prefix {prefix!r}: letters, digits and _ . : - only")
    return _rules(user, Keys(prefix))


def password_hash(password: str) -> str:
    """How Redis stores a password (`#<sha256 hex>`): an aclfile never holds it in clear."""
    return hashlib.sha256(password.encode()).hexdigest()


def new_passwords() -> dict[str, str]:
    """A fresh random password for the admin and every role (hex: safe inside a URL)."""
    return {user: secrets.token_hex(24) for user in USERS}


def url(user: str, password: str, host: str, port: int, db: int = 0) -> str:
    """`redis://<user>:<password>@host:port/db`."""
    return f"redis://{user}:{password}@{host}:{port}/{db}"


def _check(passwords: Mapping[str, str]) -> None:
    missing = [u for u in USERS if not passwords.get(u)]
    if missing:
        raise ValueError(f"no Redis password for {', '.join(missing)}")


def setuser_commands(passwords: Mapping[str, str], prefix: str) -> list[list[str]]:
    """`ACL SETUSER` for every user, each from scratch (`reset`): safe to run again."""
    _check(passwords)
    return [["ACL", "SETUSER", u, "reset", "on", f"#{password_hash(passwords[u])}", *rules(u, prefix)]
            for u in USERS]


def aclfile(passwords: Mapping[str, str], prefix: str) -> str:
    """The aclfile text of every user (passwords hashed)."""
    return "".join(" ".join(["user", *cmd[2:]]) + "\n" for cmd in setuser_commands(passwords, prefix))


def write_aclfile(path: Path, passwords: Mapping[str, str], prefix: str) -> Path:
    """Write `aclfile(...)` to `path` whole, readable by its owner only."""
    text = aclfile(passwords, prefix)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


PREFIX_VAR = "NEXTSTATE_REDIS__PREFIX"


# docker-compose.yml runs no KEDA.
COMPOSE_USERS = tuple(u for u in USERS if u != "keda")


def container_script(path: str = "/data/users.acl", users: Sequence[str] = USERS) -> str:
    """Shell (POSIX sh, `sha256sum`) that writes the aclfile of `users` at `path` from the
    environment: the prefix from NEXTSTATE_REDIS__PREFIX and each password from
    PASSWORD_VARS. It refuses (exit 1, naming the variable) an empty or CHANGE-ME password,
    or one that is not letters and digits (it sits inside a redis:// URL).
    docker-compose.yml and deploy/k8s/base/redis-acl.yaml run it before redis-server;
    tests keep them equal to this."""
    template = Keys("${" + PREFIX_VAR + "}")
    checks = "".join(f'need {PASSWORD_VARS[u]} "${{{PASSWORD_VARS[u]}:-}}"\n' for u in users)
    lines = "".join(
        " ".join(["user", u, "reset", "on", f'#$(h "${PASSWORD_VARS[u]}")', *_rules(u, template)]) + "\n"
        for u in users
    )
    return (
        "set -eu\n"
        "need() {\n"
        "  case \"$2\" in\n"
        "    ''|CHANGE-ME*) echo \"redis: set $1 (the password of a Redis ACL user)\" >&2; exit 1 ;;\n"
        "    *[!A-Za-z0-9]*) echo \"redis: $1 must be letters and digits only\" >&2; exit 1 ;;\n"
        "  esac\n"
        "}\n"
        f"case \"${{{PREFIX_VAR}:-}}\" in\n"
        f"  ''|*[!A-Za-z0-9_.:-]*) echo \"redis: set {PREFIX_VAR} (letters, digits, _ . : -)\" >&2; exit 1 ;;\n"
        "esac\n"
        f"{checks}"
        "h() { printf %s \"$1\" | sha256sum | cut -c1-64; }\n"
        "umask 077\n"
        f"cat > {path}.tmp <<EOF\n"
        f"{lines}"
        "EOF\n"
        f"mv {path}.tmp {path}\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.ctl.redis_acl", description=__doc__.split("\n")[0])
    p.add_argument("format", choices=["aclfile", "setuser", "script"],
                   help="aclfile / ACL SETUSER lines (passwords from the REDIS_*_PASSWORD "
                        "variables), or the container script")
    p.add_argument("--prefix", default=os.environ.get(PREFIX_VAR, "nextstate"))
    p.add_argument("--compose", action="store_true",
                   help="script: for docker-compose.yml ($ escaped as $$, no keda user)")
    args = p.parse_args(argv)
    if args.format == "script":
        text = container_script(users=COMPOSE_USERS if args.compose else USERS)
        print(text.replace("$", "$$") if args.compose else text, end="")
        return 0
    passwords = {u: os.environ.get(var, "") for u, var in PASSWORD_VARS.items()}
    try:
        if args.format == "aclfile":
            print(aclfile(passwords, args.prefix), end="")
        else:
            for cmd in setuser_commands(passwords, args.prefix):
                print(" ".join(cmd))
    except ValueError as exc:
        print(f"error: {exc} (set {', '.join(PASSWORD_VARS.values())})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
