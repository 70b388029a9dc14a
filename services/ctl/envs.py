"""`nextstate envs`: run environment episodes on the envs workers, and see their queue.

    nextstate envs run toolcall --tasks 8 --group 4 --parallel 8 [--split heldout] [--json]
    nextstate envs status

`run` enqueues tasks x group episodes (shared/envjobs.py: `--tasks` tasks picked by
`--split`/`--seed`, each task its own advantage group of this invocation) and waits for
their `Outcome`s on the `outcomes` stream, printing progress on stderr and a summary
(episodes, success rate, mean reward, mean steps, failures, episodes/s); `--json` prints
it as one JSON object, the last line of stdout. Parallelism is the number of envs workers
(`nextstate up --envs P`, compose `--scale envs=P`, KEDA); `--parallel P` caps how many of
this run's episodes are queued or running at once (the rest are enqueued as outcomes
arrive; 0: all at once), so a long run leaves room in the queue for others. An episode
that fails for good still ends with an Outcome (its `error` set): it counts as a failure.
The CLI runs no environment code: the workers resolve each task (services never import
each other).

`status` shows the queue (`rq:queue:<prefix>-envs`), rq's started / finished / failed
registries, the workers on the queue, and the outcomes stream's length.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from redis.exceptions import RedisError

from services.ctl.common import redis_error, settings_from
from shared.errors import NextstateError
from shared.keys import Keys
from shared.schemas import Outcome


def register(sub: Any) -> None:
    p = sub.add_parser("envs", help="environment episodes: run them on the envs workers, see the queue")
    cmds = p.add_subparsers(dest="envs_command", required=True, metavar="ACTION")
    run = cmds.add_parser("run", help="enqueue episodes of an environment and wait for their outcomes")
    run.add_argument("env", help="toolcall | terminal | swe | browser | package.module:Class")
    run.add_argument("--tasks", type=int, default=8, help="tasks (default 8)")
    run.add_argument("--group", type=int, default=1, help="episodes per task: the advantage group (default 1)")
    run.add_argument("--parallel", type=int, default=0,
                     help="at most this many of the run's episodes queued or running at once (0: all)")
    run.add_argument("--split", choices=["train", "heldout"], default="train")
    run.add_argument("--seed", type=int, default=0, help="which tasks (default 0)")
    run.add_argument("--run", help="run name (default NEXTSTATE_RUN, or the stack's)")
    run.add_argument("--timeout", type=float, default=600.0, help="one episode's job timeout in seconds")
    run.add_argument("--retries", type=int, default=2, help="retries of a failed episode (default 2)")
    run.add_argument("--wait", type=float, default=None,
                     help="give up waiting after this many seconds (default: enough for every episode "
                          "with its retries)")
    run.add_argument("--json", action="store_true", help="print the summary as one JSON object, last")
    run.set_defaults(func=run_cmd)
    status = cmds.add_parser("status", help="the envs queue, its registries and workers")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=status_cmd)


# -- run ------------------------------------------------------------------------------------------
def summarize(outcomes: list[Outcome], *, wall_s: float, expected: int) -> dict[str, Any]:
    """The summary of a run's outcomes (pure: tested without Redis)."""
    n = len(outcomes)
    ok = [o for o in outcomes if o.error is None]
    return {
        "episodes": n,
        "expected": expected,
        "missing": expected - n,
        "passed": sum(o.passed for o in outcomes),
        "success_rate": round(sum(o.passed for o in outcomes) / n, 4) if n else 0.0,
        "mean_reward": round(sum(o.reward for o in outcomes) / n, 4) if n else 0.0,
        "mean_steps": round(sum(o.steps for o in ok) / len(ok), 3) if ok else 0.0,
        "failures": n - len(ok),
        "retried": sum(o.attempt > 1 for o in outcomes),
        "policy_versions": sorted({v for o in outcomes for v in o.policy_versions}),
        "wall_s": round(wall_s, 3),
        "episodes_per_s": round(n / wall_s, 4) if wall_s > 0 else 0.0,
    }


def render(s: dict[str, Any]) -> str:
    return (f"{s['episodes']}/{s['expected']} episodes of {s['env']} ({s['split']}, run {s['run']}): "
            f"success {s['success_rate']:.1%}, mean reward {s['mean_reward']:.3f}, mean steps {s['mean_steps']:.2f}, "
            f"{s['failures']} failed, {s['missing']} missing, {s['episodes_per_s']:.2f} episodes/s "
            f"({s['wall_s']:.1f}s; versions {s['policy_versions'] or '-'})")


def run_cmd(args: argparse.Namespace) -> int:
    from shared.envjobs import enqueue_plan, episode_plan
    from shared.rqjobs import rq_connection

    if args.tasks < 1 or args.group < 1 or args.parallel < 0:
        raise NextstateError("--tasks and --group must be at least 1, --parallel at least 0")
    settings = settings_from(args)
    run = args.run or settings.run
    keys = Keys(settings.redis.prefix)
    plan = episode_plan(run, args.env, args.tasks, args.group, split=args.split, seed=args.seed)
    wanted = {job_id for job_id, *_ in plan}
    cap = args.parallel or len(plan)
    wait_s = args.wait if args.wait is not None else \
        args.timeout * (args.retries + 1) * max(1, -(-len(plan) // cap)) + 120
    import redis

    text: Any = redis.Redis.from_url(settings.redis.url, decode_responses=True,
                                     socket_timeout=settings.redis.socket_timeout + 2,
                                     socket_connect_timeout=settings.redis.connect_timeout)
    conn = rq_connection(settings.redis.url, socket_timeout=settings.redis.socket_timeout,
                         connect_timeout=settings.redis.connect_timeout)
    got: dict[str, Outcome] = {}
    t0 = time.monotonic()
    try:
        last = text.xrevrange(keys.outcomes, count=1)
        cursor = last[0][0] if last else "0-0"
        sent = 0

        def enqueue_more() -> None:
            nonlocal sent
            room = cap - (sent - len(got))
            if room > 0 and sent < len(plan):
                enqueue_plan(conn, keys, run, args.env, plan[sent:sent + room], args.group,
                             timeout_s=args.timeout, retries=args.retries)
                sent = min(len(plan), sent + room)

        enqueue_more()
        print(f"enqueued {sent} of {len(plan)} episodes ({args.tasks} tasks x {args.group}) of {args.env}; "
              "waiting for their outcomes (the envs workers run them: `nextstate envs status`)", file=sys.stderr)
        deadline = t0 + wait_s
        while len(got) < len(plan) and time.monotonic() < deadline:
            reply = text.xread({keys.outcomes: cursor}, count=256, block=1000) or []
            for _, entries in reply:
                for entry_id, fields in entries:
                    cursor = entry_id
                    try:
                        outcome = Outcome.from_json(fields["data"])
                    except (NextstateError, KeyError):
                        continue
                    if outcome.id in wanted and outcome.id not in got:
                        got[outcome.id] = outcome
                        mark = "error" if outcome.error else ("passed" if outcome.passed else "failed")
                        print(f"  {len(got)}/{len(plan)} {outcome.task_id} #{outcome.group_index}: {mark}, "
                              f"reward {outcome.reward:.2f}, {outcome.steps} steps, {outcome.wall_s:.1f}s",
                              file=sys.stderr)
            enqueue_more()
    except RedisError as exc:
        raise redis_error(exc, settings) from exc
    finally:
        conn.close()
        text.close()
    summary = {"env": args.env, "run": run, "split": args.split, "tasks": args.tasks, "group": args.group,
               **summarize(list(got.values()), wall_s=time.monotonic() - t0, expected=len(plan))}
    print(json.dumps(summary) if args.json else render(summary))
    if summary["missing"]:
        print(f"nextstate: {summary['missing']} episode(s) without an outcome after {wait_s:.0f}s "
              "(are envs workers running? `nextstate envs status`)", file=sys.stderr)
        return 1
    return 0


# -- status ---------------------------------------------------------------------------------------
def queue_status(client: Any, keys: Keys) -> dict[str, Any]:
    """Read-only: rq's keys of the envs queue (no rq cleanup, which would write)."""
    q = keys.envs_queue
    workers = sorted(w.decode() if isinstance(w, bytes) else w for w in client.smembers(f"rq:workers:{q}"))
    return {
        "queue": q,
        "queued": int(client.llen(f"rq:queue:{q}")),
        "started": int(client.zcard(f"rq:wip:{q}")),
        "finished": int(client.zcard(f"rq:finished:{q}")),
        "failed": int(client.zcard(f"rq:failed:{q}")),
        "workers": [w.removeprefix("rq:worker:") for w in workers],
        "outcomes": int(client.xlen(keys.outcomes)),
    }


def status_cmd(args: argparse.Namespace) -> int:
    import redis

    settings = settings_from(args)
    client: Any = redis.Redis.from_url(settings.redis.url, decode_responses=True,
                                       socket_timeout=settings.redis.socket_timeout,
                                       socket_connect_timeout=settings.redis.connect_timeout)
    try:
        data = queue_status(client, Keys(settings.redis.prefix))
    except RedisError as exc:
        raise redis_error(exc, settings) from exc
    finally:
        client.close()
    if args.json:
        print(json.dumps(data))
        return 0
    print(f"queue {data['queue']}: {data['queued']} queued, {data['started']} running, "
          f"{data['finished']} finished, {data['failed']} failed; {data['outcomes']} outcomes on the stream")
    print(f"workers ({len(data['workers'])}):" + "".join(f"\n  {w}" for w in data["workers"]))
    return 0
