"""Running the collector for tests: real engine / stand-in processes, the turns it emits, and
the checks every captured `Turn` must pass.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from shared.chat import ChatTemplate
from shared.schemas import Turn
from shared.toolcalls import parse_assistant
from tests.support.servers import REPO, ServiceProcess, free_port, stop_process, wait_until


def engine_process(model: Path, **env: str) -> tuple[ServiceProcess, str]:
    """`python -m services.engine` on a free port (started, not yet waited for)."""
    port = free_port()
    proc = ServiceProcess(
        "engine",
        env={"NEXTSTATE_ENV": "test", "NEXTSTATE_ENGINE__THREADS": "1", **env},
        args=["--model", str(model), "--port", str(port)],
    )
    return proc.start(), f"http://127.0.0.1:{port}"


def collector_process(env: dict[str, str], engine_url: str, **cfg: Any) -> tuple[ServiceProcess, str]:
    """`python -m services.collector` on a free port; `cfg` become NEXTSTATE_COLLECTOR__* vars."""
    port = free_port()
    spool = Path(tempfile.mkdtemp(prefix="ns-spool-")) / "collector.spool.jsonl"
    full = {
        **env,
        "NEXTSTATE_COLLECTOR__ENGINE_URL": engine_url,
        "NEXTSTATE_COLLECTOR__PORT": str(port),
        "NEXTSTATE_COLLECTOR__SPOOL_PATH": str(spool),
        "NEXTSTATE_COLLECTOR__STARTUP_TIMEOUT_S": "90",
    }
    full.update({f"NEXTSTATE_COLLECTOR__{k.upper()}": str(v) for k, v in cfg.items()})
    return ServiceProcess("collector", env=full).start(), f"http://127.0.0.1:{port}"


def wait_ready(engine: tuple[ServiceProcess, str] | None, *collectors: tuple[ServiceProcess, str],
               timeout: float = 120) -> None:  # fmt: skip
    """Wait for an engine (/health) and collectors (/healthz) started together."""
    if engine is not None:
        engine[0].wait_http(engine[1] + "/health", timeout=timeout)
    for proc, url in collectors:
        proc.wait_http(url + "/healthz", timeout=timeout)


@dataclass
class StandIn:
    """tests.support.standin_engine as a process (fixed latency, or `stall=True`)."""

    args: list[str] = field(default_factory=list)
    stall: bool = False
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> StandIn:
        argv = [sys.executable, "-m", "tests.support.standin_engine", "--port", str(self.port), *self.args]
        if self.stall:
            argv.append("--stall")
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import socket

        def listening() -> bool:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True

        wait_until(listening, 30, f"stand-in engine on :{self.port}")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


class Turns:
    """Reads the `turns` stream of one prefix."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.client: Any = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=5)
        self.key = f"{prefix}:turns"

    def all(self) -> list[Turn]:
        return [Turn.from_json(f["data"]) for _, f in self.client.xrange(self.key)]

    def of(self, session_id: str) -> list[Turn]:
        return [t for t in self.all() if t.session_id == session_id]

    def wait(self, pred: Callable[[list[Turn]], bool], timeout: float = 15, what: str = "turns",
             sessions: Iterable[str] | None = None) -> list[Turn]:  # fmt: skip
        wanted = set(sessions) if sessions is not None else None
        got: list[Turn] = []

        def ok() -> bool:
            nonlocal got
            got = [t for t in self.all() if wanted is None or t.session_id in wanted]
            return pred(got)

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return got
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; have {[_brief(t) for t in got]}")

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Turns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def standin_collector(tok_dir: Path, redis_url: str, *standin_args: str) -> Iterator[dict[str, str]]:
    """A collector (key `k`, its own Redis prefix) before a stand-in engine on a tiny tokenizer
    built in `tok_dir`: {"url", "prefix", "redis"}. The collector must stop cleanly."""
    from tests.support.tiny_model import build_tokenizer

    build_tokenizer(tok_dir)
    engine = StandIn(args=["--tokenizer", str(tok_dir), "--latency-ms", "1", *standin_args]).start()
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    env = {"NEXTSTATE_ENV": "test", "NEXTSTATE_REDIS__URL": redis_url, "NEXTSTATE_REDIS__PREFIX": prefix}
    collector = collector_process(env, engine.url, api_keys="k")
    try:
        wait_ready(None, collector)
        yield {"url": collector[1], "prefix": prefix, "redis": redis_url}
    finally:
        rc = collector[0].stop()
        engine.stop()
    assert rc == 0, collector[0].logs()


def _brief(t: Turn) -> str:
    return f"{t.session_id[:8]}#{t.turn_index}:{t.closed_by}"


def check_turn(turn: Turn, tpl: ChatTemplate, parser: str = "hermes") -> None:
    """What every captured turn must satisfy: exact prompt ids, aligned log-probs, and
    response ids that decode to what the client was sent."""
    assert turn.prompt_ids == tpl.encode(turn.messages, turn.tools)
    assert turn.response_ids, "no response ids"
    assert turn.response_logprobs is not None
    assert len(turn.response_logprobs) == len(turn.response_ids)
    assert all(lp <= 0 for lp in turn.response_logprobs)
    text = tpl.decode(turn.response_ids)
    msg = parse_assistant(text, tools_enabled=turn.tools is not None, parser=parser)
    assert msg.content == turn.response["content"]
    calls = turn.response.get("tool_calls") or []
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]
    assert turn.weight_version and turn.policy_version == int(turn.weight_version)
