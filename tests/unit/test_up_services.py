"""What `nextstate up` launches, checked without launching it: stable consumer names,
the serving path, and dependents built from the final port of what they depend on."""

from __future__ import annotations

import io
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from services.ctl.__main__ import build_parser
from services.ctl.supervisor import Proc, Supervisor
from services.ctl.up import Stack
from shared.consumer import consumer_name, default_consumer_name
from shared.settings import Settings, load_settings


class Recorder(Supervisor):
    """Takes each group of Procs as `up` builds it; the engine's first port turns out taken."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.started: list[list[str]] = []

    async def start_together(self, procs: Sequence[Proc]) -> list[bool]:
        for p in procs:
            if p.name == "engine":
                assert p.rebind is not None
                p.rebind(p)  # what the supervisor does after a bind failure before ready
        self.procs.extend(procs)
        self.started.append([p.name for p in procs])
        return [True] * len(procs)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("NEXTSTATE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("NEXTSTATE_RUN", "r1")


async def launched(tmp_path: Path, *argv: str) -> dict[str, Proc]:
    return (await groups(tmp_path, *argv))[0]


async def groups(tmp_path: Path, *argv: str) -> tuple[dict[str, Proc], list[list[str]]]:
    args = build_parser().parse_args(["up", "--home", str(tmp_path), *argv])
    recorder = Recorder(out=io.StringIO())
    stack = Stack(args, load_settings(Settings), recorder)
    await stack.services(tmp_path / "model")
    await stack.settled()
    return {p.name: p for p in stack.sup.procs}, recorder.started


async def test_independent_services_start_together(tmp_path: Path) -> None:
    """A group starts at once and only after the group before it is ready: first what needs
    neither the engine nor each other, then what talks to the engine (or the evaluation
    engine), then the environment workers that talk to the collector."""
    _, started = await groups(tmp_path / "a", "--judges", "2", "--envs", "2")
    assert started == [["engine", "buffer", "trainer", "eval-engine"],
                       ["collector", "judge-0", "judge-1", "watcher", "evaluator"],
                       ["envs-0", "envs-1"]]  # fmt: skip
    _, started = await groups(tmp_path / "b", "--no-train")
    assert started == [["engine", "buffer"], ["collector", "judge-0"]]


async def test_consumers_get_stable_names_and_the_serving_path_is_marked(tmp_path: Path) -> None:
    procs = await launched(tmp_path, "--judges", "2")
    assert set(procs) == {"engine", "collector", "judge-0", "judge-1", "buffer", "trainer", "watcher",
                          "eval-engine", "evaluator"}
    assert procs["evaluator"].env["NEXTSTATE_EVAL__CONSUMER_NAME"] == "evaluator"
    assert procs["judge-0"].env["NEXTSTATE_JUDGE__CONSUMER_NAME"] == "judge-0"
    assert procs["judge-1"].env["NEXTSTATE_JUDGE__CONSUMER_NAME"] == "judge-1"
    assert procs["buffer"].env["NEXTSTATE_BUFFER__CONSUMER_NAME"] == "buffer"
    assert "NEXTSTATE_TRAINER__CONSUMER_NAME" not in procs["trainer"].env  # default: trainer-<run>
    assert {n for n, p in procs.items() if p.serving_path} == {"engine", "collector"}
    ports = [p.port for p in procs.values()]
    assert None not in ports and len(set(ports)) == len(ports)


async def test_dependents_are_built_from_the_final_port(tmp_path: Path) -> None:
    procs = await launched(tmp_path, "--port", "18000")
    engine = procs["engine"]
    assert engine.argv[engine.argv.index("--port") + 1] == str(engine.port)
    engine_url = f"http://127.0.0.1:{engine.port}"
    assert procs["collector"].env["NEXTSTATE_COLLECTOR__ENGINE_URL"] == engine_url
    assert procs["watcher"].env["NEXTSTATE_WATCHER__ENGINE_URL"] == engine_url
    assert procs["judge-0"].env["NEXTSTATE_JUDGE__ENGINE_URL"] == engine_url
    # The port the user asked for is kept, never moved: a taken one is an error.
    assert procs["collector"].port == 18000 and procs["collector"].rebind is None


async def test_envs_workers(tmp_path: Path) -> None:
    """`--envs 2`: two environment workers on the collector, with stable names and ports of
    their own; none by default."""
    procs = await launched(tmp_path / "a", "--envs", "2", "--no-train")
    assert [n for n in procs if n.startswith("envs")] == ["envs-0", "envs-1"]
    collector = f"http://127.0.0.1:{procs['collector'].port}/v1"
    for i in (0, 1):
        env = procs[f"envs-{i}"].env
        assert env["NEXTSTATE_ENVS__URL"] == collector and env["NEXTSTATE_ENVS__CONSUMER_NAME"] == f"envs-{i}"
        assert procs[f"envs-{i}"].argv[-2:] == ["-m", "services.envs"] and not procs[f"envs-{i}"].serving_path
    assert procs["envs-0"].port != procs["envs-1"].port
    assert not any(n.startswith("envs") for n in await launched(tmp_path / "b"))


async def test_gate_and_no_eval_flags(tmp_path: Path) -> None:
    gated = await launched(tmp_path / "a", "--gate")
    assert gated["watcher"].env["NEXTSTATE_GATE__ENABLED"] == "true"
    assert gated["evaluator"].env["NEXTSTATE_EVAL__ENGINE_URL"] == f"http://127.0.0.1:{gated['eval-engine'].port}"
    bare = await launched(tmp_path / "b", "--no-eval")
    assert "eval-engine" not in bare and "evaluator" not in bare
    assert "NEXTSTATE_GATE__ENABLED" not in bare["watcher"].env


async def test_lora_trains_adapters_and_every_client_names_the_served_one(tmp_path: Path) -> None:
    procs = await launched(tmp_path / "a", "--lora", "8")
    t = procs["trainer"].env
    assert (t["NEXTSTATE_TRAINER__LORA"], t["NEXTSTATE_TRAINER__LORA_RANK"], t["NEXTSTATE_TRAINER__LORA_ALPHA"],
            t["NEXTSTATE_TRAINER__LORA_PUBLISH"], t["NEXTSTATE_TRAINER__LR"]) == ("true", "8", "16", "adapter", "1e-05")
    assert procs["collector"].env["NEXTSTATE_COLLECTOR__ENGINE_ADAPTERS"] == "true"
    assert procs["judge-0"].env["NEXTSTATE_JUDGE__ENGINE_ADAPTERS"] == "true"
    for engine in ("engine", "eval-engine"):
        assert procs[engine].env["NEXTSTATE_ENGINE__MAX_LORA_RANK"] == "8"
    assert (await launched(tmp_path / "b", "--lora", "8", "--lr", "3e-4"))["trainer"].env[
        "NEXTSTATE_TRAINER__LR"] == "0.0003"  # --lr wins
    plain = await launched(tmp_path / "c")
    assert "NEXTSTATE_TRAINER__LORA" not in plain["trainer"].env
    assert "NEXTSTATE_COLLECTOR__ENGINE_ADAPTERS" not in plain["collector"].env


def test_vllm_serves_adapters_with_lora() -> None:
    from shared.vllm_engine import VLLMLaunch

    argv, env = VLLMLaunch(python="python", threads=1, lora_rank=16).command(Path("/m"), 1)
    assert argv[argv.index("--max-lora-rank") + 1] == "16" and "--enable-lora" in argv
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    argv, env = VLLMLaunch(python="python", threads=1).command(Path("/m"), 1)
    assert "--enable-lora" not in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env


def test_consumer_name_placeholders(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "box")
    pid = os.getpid()
    assert consumer_name("judge-{hostname}", "judge") == "judge-box"
    assert consumer_name("{hostname}", "judge") == "box"
    assert consumer_name("buffer", "buffer") == "buffer"
    assert consumer_name("w-{hostname}-{pid}", "judge") == f"w-box-{pid}"
    assert consumer_name(None, "judge") == default_consumer_name("judge") == f"judge-box-{pid}"
    assert consumer_name("", "buffer") == f"buffer-box-{pid}"


async def test_mode_sets_the_judge_buffer_and_trainer_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--mode oel`: the experience teacher with top-K scoring in the judge (the rule extractor
    without a judge model of its own), opd samples in the buffer, opd_topk in the trainer; a
    NEXTSTATE_* variable of the user's own still wins."""
    procs = await launched(tmp_path / "a", "--mode", "oel", "--topk", "8")
    judge, buffer, trainer = procs["judge-0"].env, procs["buffer"].env, procs["trainer"].env
    assert (judge["NEXTSTATE_JUDGE__MODE"], judge["NEXTSTATE_JUDGE__TEACHER"], judge["NEXTSTATE_JUDGE__TOPK"],
            judge["NEXTSTATE_JUDGE__EXPERIENCE_EXTRACTOR"]) == ("opd", "experience", "8", "rule")
    assert buffer["NEXTSTATE_BUFFER__MODE"] == "opd"
    assert (trainer["NEXTSTATE_TRAINER__LOSS_MODE"], trainer["NEXTSTATE_TRAINER__LOSS"]) == ("opd", "opd_topk")
    monkeypatch.setenv("NEXTSTATE_JUDGE__URL", "http://judge.example:8000")
    monkeypatch.setenv("NEXTSTATE_JUDGE__TOPK", "20")
    mine = (await launched(tmp_path / "b", "--mode", "oel"))["judge-0"].env
    assert "NEXTSTATE_JUDGE__TOPK" not in mine  # the user's 20 comes from the environment
    assert mine["NEXTSTATE_JUDGE__EXPERIENCE_EXTRACTOR"] == "llm"
    topk = await launched(tmp_path / "c", "--mode", "opd-topk")
    assert "NEXTSTATE_JUDGE__TEACHER" not in topk["judge-0"].env
    assert topk["trainer"].env["NEXTSTATE_TRAINER__LOSS"] == "opd_topk"
    rl = await launched(tmp_path / "d")
    assert "NEXTSTATE_TRAINER__LOSS" not in rl["trainer"].env and "NEXTSTATE_JUDGE__TOPK" not in rl["judge-0"].env


async def test_judge_model_gets_an_engine_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--judge-model policy`: the policy's base weights on a `judge-model` engine that is not
    the serving one (its own port, never on the serving path); the judges use it (prm by
    default, its model name, the internal token through JUDGE_ENGINE_URL) — even over a
    NEXTSTATE_JUDGE__URL in the environment — and keep the policy engine for teacher log-probs."""
    monkeypatch.setenv("NEXTSTATE_JUDGE__URL", "https://hosted.example/v1")
    procs, started = await groups(tmp_path / "a", "--judge-model", "policy", "--judges", "2")
    # Beside the serving path, which never waits for them: the judge-model engine, then the judges.
    assert sorted(map(tuple, started)) == sorted([("judge-model",), ("engine", "buffer", "trainer", "eval-engine"),
                                                   ("collector", "watcher", "evaluator"), ("judge-0", "judge-1")])
    assert started.index(["judge-model"]) < started.index(["judge-0", "judge-1"])
    assert started.index(["engine", "buffer", "trainer", "eval-engine"]) < started.index(["judge-0", "judge-1"])
    engine, judging = procs["engine"], procs["judge-model"]
    assert judging.argv[-6:] == ["--model", str(tmp_path / "a" / "model"), "--port", str(judging.port),
                                 "--served-model-name", "judge"]  # fmt: skip
    assert "--served-model-name" not in engine.argv and engine.port != judging.port
    assert not judging.serving_path and judging.ready is not None
    assert {n for n, p in procs.items() if p.serving_path} == {"engine", "collector"}
    judge_url = f"http://127.0.0.1:{judging.port}"
    for name in ("judge-0", "judge-1"):
        env = procs[name].env
        assert env["NEXTSTATE_JUDGE__URL"] == env["NEXTSTATE_JUDGE__JUDGE_ENGINE_URL"] == judge_url
        assert (env["NEXTSTATE_JUDGE__TYPE"], env["NEXTSTATE_JUDGE__MODEL"]) == ("prm", "judge")
        assert env["NEXTSTATE_JUDGE__ENGINE_URL"] == f"http://127.0.0.1:{engine.port}"  # OPD's teacher
        assert env["NEXTSTATE_JUDGE__MAX_TOKENS"] == "256"  # a local CPU judge's defaults
        assert env["NEXTSTATE_JUDGE__JUDGE_TOKENIZER"] == str(tmp_path / "a" / "model")
    watcher = procs["watcher"].env["NEXTSTATE_WATCHER__ENGINE_URL"]
    assert watcher == f"http://127.0.0.1:{engine.port}"  # versions go to the serving engine only

    # A folder of its own; the user's NEXTSTATE_JUDGE__* (but the URL) still win over up's defaults.
    monkeypatch.setenv("NEXTSTATE_JUDGE__MAX_TOKENS", "64")
    other = await launched(tmp_path / "b", "--judge-model", str(tmp_path / "judge"), "--mode", "opd",
                           "--no-train", "--judge", "rule")
    assert other["judge-model"].argv[other["judge-model"].argv.index("--model") + 1] == str(tmp_path / "judge")
    env = other["judge-0"].env
    assert env["NEXTSTATE_JUDGE__TYPE"] == "rule" and "NEXTSTATE_JUDGE__MAX_TOKENS" not in env
    assert env["NEXTSTATE_JUDGE__HINT_SOURCE"] == "llm"  # hints from the judge model
    assert "judge-model" not in await launched(tmp_path / "c")


async def test_judge_model_on_vllm(tmp_path: Path) -> None:
    """With --engine vllm the judge model is a vLLM server of its own, named `judge`."""
    from shared.vllm_engine import VLLMLaunch

    args = build_parser().parse_args(["up", "--home", str(tmp_path), "--judge-model", "policy", "--no-train"])
    args.vllm = VLLMLaunch(python="/v/bin/python", threads=1)
    stack = Stack(args, load_settings(Settings), Recorder(out=io.StringIO()))
    await stack.services(tmp_path / "model")
    await stack.settled()
    procs = {p.name: p for p in stack.sup.procs}
    argv = procs["judge-model"].argv
    assert argv[:3] == ["/v/bin/python", "-m", "services.vllm"]
    assert argv[argv.index("--served-model-name") + 1] == "judge"
    assert procs["engine"].argv[procs["engine"].argv.index("--served-model-name") + 1] == "policy"
    assert procs["judge-model"].port != procs["engine"].port
    assert procs["judge-0"].env["NEXTSTATE_JUDGE__URL"] == f"http://127.0.0.1:{procs['judge-model'].port}"


def test_judge_model_must_be_a_model_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "policy"
    model.mkdir()
    (model / "config.json").write_text("{}")
    args = build_parser().parse_args(["up", "--home", str(tmp_path), "--model", str(model),
                                      "--judge-model", str(tmp_path / "nope")])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert f"--judge-model {tmp_path / 'nope'} is not an HF model folder" in err


async def test_the_serving_path_never_waits_for_the_judge_model(tmp_path: Path) -> None:
    """A judge-model engine that takes its time (a large model loading): the collector starts
    and `services` returns while it is still starting; the judges follow once it is up."""
    import asyncio

    release = asyncio.Event()

    class SlowJudgeModel(Recorder):
        async def start_together(self, procs: Sequence[Proc]) -> list[bool]:
            if [p.name for p in procs] == ["judge-model"]:
                await release.wait()
            return await super().start_together(procs)

    args = build_parser().parse_args(["up", "--home", str(tmp_path), "--judge-model", "policy", "--no-train"])
    recorder = SlowJudgeModel(out=io.StringIO())
    stack = Stack(args, load_settings(Settings), recorder)
    await asyncio.wait_for(stack.services(tmp_path / "model"), 10)
    assert recorder.started == [["engine", "buffer"], ["collector"]]  # serving, no judge model yet
    release.set()
    await asyncio.wait_for(stack.settled(), 10)
    assert recorder.started[2:] == [["judge-model"], ["judge-0"]]
