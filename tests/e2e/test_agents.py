"""The real agents through the real collector: OpenClaw, the Codex CLI and Claude Code.

Installed by `make agents` (tests/support/agents.py), unchanged, each in a private HOME with
its telemetry and update checks off, against the collector in front of a deterministic
scripted engine: tests/support/standin_engine.py `--script`, a real process speaking
SGLang's native API (as our engine does) with the agent model folder of
tests/support/agent_model.py (its tokenizer and chat template, which the collector renders
every request with, and a 32k context that holds the agents' default prompts). The engine
decodes each prompt and answers by the script's ordered rules (a call of Codex's and of
Claude Code's shell tool for their tasks, an answer to the tool's result, a reply to
OpenClaw), so what the agents are answered is exact by construction; a prompt no rule
matches is refused (a 500), never answered. Each test asserts which rules its run fired,
and that no prompt was refused. Turns are read back from the collector's `turns` stream
in this session's Redis.

- OpenClaw's default setup (its full system prompt and tools, ~12k tokens here), two
  messages in one session on each of `openai-completions`, `openai-responses` and
  `anthropic-messages`: the first turn's next state is the second message.
- `codex exec` (Codex's default configuration plus a custom provider, `wire_api =
  "responses"`) and `claude -p` (ANTHROPIC_BASE_URL) each run a task with one shell tool
  call, which the agent really runs in a temporary workspace (`ls`): the tool's output is
  the tool-call turn's next state, and the agent prints the scripted answer.
- A prompt over the context is refused by the collector (it never reaches the engine) on
  each API in the wording the agents classify, checked against OpenClaw's own
  context-overflow classifier (its installed package, with its Node).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shared.schemas import Turn
from tests.support import agents as A
from tests.support.agent_model import (
    ANSWER,
    CLAUDE_TASK,
    CODEX_TASK,
    CONTEXT,
    REPLY,
    build_agent_model,
)
from tests.support.collector_harness import Turns, collector_process, wait_ready
from tests.support.scripted_engine import ScriptCounts, scripted_engine_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "agent-model"
WORKSPACE = {"notes.txt": "buy milk\n", "hello.py": "print('hello')\n"}


@pytest.fixture(scope="module", autouse=True)
def openclaw_tmp_files() -> Iterator[None]:
    """OpenClaw keeps its state locks in /tmp/openclaw-state-locks-<uid> and its log in
    /tmp/openclaw, Codex its daemon's folder in /tmp/codex-daemon-<uid>, whatever TMPDIR says:
    what this module's runs add there goes after them."""
    uid = os.getuid()
    folders = [Path(f"/tmp/openclaw-state-locks-{uid}"), Path("/tmp/openclaw"), Path(f"/tmp/codex-daemon-{uid}")]
    before = {f: set(f.iterdir()) if f.is_dir() else None for f in folders}
    yield
    for folder, had in before.items():
        if not folder.is_dir():
            continue
        if had is None:
            shutil.rmtree(folder, ignore_errors=True)
            continue
        for path in set(folder.iterdir()) - had:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def agents_root() -> Path:
    return A.require_agents()


@pytest.fixture(scope="module")
def agent_model(agents_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_agent_model(tmp_path_factory.mktemp("agent-model") / MODEL)


@pytest.fixture(scope="module")
def stack(agent_model: Path, redis_url: str) -> Iterator[dict[str, str]]:
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    env = {"NEXTSTATE_ENV": "test", "NEXTSTATE_REDIS__URL": redis_url,
           "NEXTSTATE_REDIS__PREFIX": prefix}  # fmt: skip
    engine = scripted_engine_process(agent_model, model=MODEL)
    collector = collector_process(env, engine[1], api_keys=A.API_KEY)
    try:
        wait_ready(engine, collector)
        yield {"url": collector[1], "prefix": prefix, "redis": redis_url, "engine": engine[1]}
    finally:
        rc = collector[0].stop()
        engine[0].stop()
    assert rc == 0, collector[0].logs()


@pytest.fixture
def script(stack: dict[str, str]) -> ScriptCounts:
    """The scripted engine's rule counts from the start of the test."""
    return ScriptCounts(stack["engine"])


@pytest.fixture
def turns(stack: dict[str, str]) -> Iterator[Turns]:
    with Turns(stack["redis"], stack["prefix"]) as t:
        yield t


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    for name, text in WORKSPACE.items():
        (work / name).write_text(text)
    return work


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content or "")


def _containing(turns: list[Turn], marker: str) -> list[Turn]:
    return [t for t in turns if any(marker in _text(m) for m in t.messages)]


def _ran(proc: subprocess.CompletedProcess[str], what: str) -> None:
    assert proc.returncode == 0, (
        f"{what} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )


# -- OpenClaw's default setup, on each API -----------------------------------------------------


@pytest.mark.timeout(900)  # two OpenClaw turns: ~20-40 s of its own CPU each, more on a busy host
@pytest.mark.parametrize("api", ["openai-completions", "openai-responses", "anthropic-messages"])
def test_openclaw_default_setup_pairs_its_second_message(
    api: str,
    stack: dict[str, str],
    script: ScriptCounts,
    turns: Turns,
    workspace: Path,
    tmp_path: Path,
) -> None:
    home = A.AgentHome(tmp_path / "home")
    config = A.openclaw_config(stack["url"], api, MODEL, context_window=CONTEXT)
    config["agents"]["defaults"]["workspace"] = str(workspace)
    A.write_openclaw_config(home, config)
    marker = uuid.uuid4().hex[:8]
    first, second = f"Hello, I am {marker}.", f"Thanks {marker}, see you."
    session = f"s-{marker}"
    t0 = time.monotonic()
    one = A.openclaw_turn(home, session, first, cwd=workspace)
    _ran(one, "openclaw turn 1")
    two = A.openclaw_turn(home, session, second, cwd=workspace)
    _ran(two, "openclaw turn 2")
    took = time.monotonic() - t0
    for run in (one, two):  # the scripted reply reached the user as the engine sent it
        out = json.loads(run.stdout)
        assert out["meta"]["finalAssistantVisibleText"] == REPLY, out["meta"]
    assert script.fired() == {"openclaw": 2}  # one request a message, each answered REPLY

    # Turn 1 is closed by the request of message 2 (before that request reaches the engine).
    def first_turns(ts: list[Turn]) -> list[Turn]:
        return [
            t for t in _containing(ts, first) if not any(second in _text(m) for m in t.messages)
        ]

    got = turns.wait(lambda ts: bool(first_turns(ts)), timeout=15,
                     what=f"OpenClaw's first turn on {api}, closed by its second message")  # fmt: skip
    [turn1] = first_turns(got)
    assert turn1.closed_by == "next_request", turn1.closed_by
    assert turn1.response.get("content") == REPLY and not turn1.response.get("tool_calls"), (
        turn1.response
    )
    assert turn1.next_state, "the first turn has no next state"
    users = [m for m in turn1.next_state if m.get("role") == "user"]
    assert users and second in _text(users[0]), turn1.next_state
    assert not any(first in _text(m) for m in turn1.next_state)
    assert len(turn1.prompt_ids) > 8000  # the full default prompt reached the model
    print(f"openclaw {api}: two turns in {took:.0f} s, prompt {len(turn1.prompt_ids)} tokens")


# -- the coding agents: one shell tool call each ----------------------------------------------


def _tool_turn(turns: Turns, marker: str, tool: str, what: str) -> Turn:
    """The turn (its messages mention `marker`) whose response called `tool`, once closed."""

    def calls(ts: list[Turn]) -> list[Turn]:
        return [t for t in _containing(ts, marker)
                if any(c["function"]["name"] == tool for c in t.response.get("tool_calls") or [])]  # fmt: skip

    got = turns.wait(lambda ts: bool(calls(ts)), timeout=15, what=what)
    [turn] = calls(got)
    return turn


def _assert_tool_result_is_next_state(turn: Turn) -> None:
    assert turn.closed_by == "next_request", turn.closed_by
    assert turn.next_state, "the tool-call turn has no next state"
    [result] = [m for m in turn.next_state if m.get("role") == "tool"]
    assert "hello.py" in _text(result) and "notes.txt" in _text(result), result  # ls really ran


@pytest.mark.timeout(600)
def test_codex_exec_runs_a_shell_tool_and_its_output_pairs(
    stack: dict[str, str], script: ScriptCounts, turns: Turns, workspace: Path, tmp_path: Path
) -> None:
    home = A.AgentHome(tmp_path / "home")
    A.write_codex_config(home, A.codex_config(stack["url"], MODEL))
    t0 = time.monotonic()
    run = A.codex_exec(home, workspace, CODEX_TASK)
    took = time.monotonic() - t0
    _ran(run, "codex exec")
    assert ANSWER in run.stdout, run.stdout
    assert script.fired() == {"codex-call": 1, "codex-answer": 1}
    turn = _tool_turn(turns, str(workspace), "exec_command", "Codex's exec_command turn, paired")
    assert json.loads(turn.response["tool_calls"][0]["function"]["arguments"]) == {"cmd": "ls"}
    _assert_tool_result_is_next_state(turn)
    # Its session is Codex's own (the thread: a root thread's id is the session id it prints).
    said = re.search(r"^session id: (\S+)$", run.stdout + "\n" + run.stderr, re.MULTILINE)
    assert said is not None and turn.session_id == said[1], (turn.session_id, run.stderr[-2000:])
    print(f"codex exec: {took:.0f} s")


@pytest.mark.timeout(600)
def test_claude_print_runs_bash_and_its_output_pairs(
    stack: dict[str, str], script: ScriptCounts, turns: Turns, workspace: Path, tmp_path: Path
) -> None:
    home = A.AgentHome(tmp_path / "home")
    t0 = time.monotonic()
    run = A.claude_print(home, workspace, stack["url"], MODEL, CLAUDE_TASK)
    took = time.monotonic() - t0
    _ran(run, "claude -p")
    result = json.loads(run.stdout)
    assert result["result"] == ANSWER and not result["is_error"], result
    assert script.fired() == {"claude-call": 1, "claude-answer": 1}
    turn = _tool_turn(turns, str(workspace), "Bash", "Claude Code's Bash turn, paired")
    assert json.loads(turn.response["tool_calls"][0]["function"]["arguments"])["command"] == "ls"
    _assert_tool_result_is_next_state(turn)
    # Its session is Claude Code's own; its user the device (no login here), not the session.
    assert turn.session_id == result["session_id"], (turn.session_id, result["session_id"])
    assert turn.user is not None and re.fullmatch(r"[0-9a-f]{64}", turn.user), turn.user
    print(f"claude -p: {took:.0f} s")


# -- a prompt over the context, in the words the agents classify ------------------------------


def openclaw_classifier(messages: list[str]) -> list[bool]:
    """OpenClaw's own `isContextOverflowError` (its failover classifier) on each message,
    imported from its installed package and run with its Node."""
    dist = A.agents_dir() / "node_modules" / "openclaw" / "dist"
    for module in sorted(dist.glob("classify-*.mjs")):
        found = re.search(r"export \{[^}]*\bisContextOverflowError as (\w+)", module.read_text())
        if found:
            break
    else:
        raise AssertionError(f"no module of {dist} exports OpenClaw's isContextOverflowError")
    script = (
        f"import * as m from {json.dumps(module.as_uri())};"
        "let s = ''; process.stdin.on('data', d => s += d); process.stdin.on('end', () =>"
        f" console.log(JSON.stringify(JSON.parse(s).map(x => m[{json.dumps(found[1])}](x)))));"
    )
    out = subprocess.run([str(A.node_bin() / "node"), "--input-type=module", "-e", script],
                         input=json.dumps(messages), capture_output=True, text=True, timeout=120,
                         check=True)  # fmt: skip
    got: list[bool] = json.loads(out.stdout)
    return got


OVERFLOW = {  # API -> (path, body for a prompt of `big`)
    "openai-completions": ("/v1/chat/completions",
                           lambda big: {"messages": [{"role": "user", "content": big}], "max_tokens": 16}),
    "openai-responses": ("/v1/responses", lambda big: {"input": big, "max_output_tokens": 16}),
    "anthropic-messages": ("/v1/messages",
                           lambda big: {"messages": [{"role": "user", "content": big}], "max_tokens": 16}),
}  # fmt: skip


@pytest.mark.timeout(600)
def test_a_prompt_over_the_context_is_an_overflow_the_agents_recognise(
    stack: dict[str, str], script: ScriptCounts
) -> None:
    big = "hello world " * (CONTEXT * 2 // 3)  # well over the 32,768-token context
    headers = {"authorization": f"Bearer {A.API_KEY}", "x-api-key": A.API_KEY,
               "anthropic-version": "2023-06-01"}  # fmt: skip
    seen: list[str] = []
    with httpx.Client(base_url=stack["url"], headers=headers, timeout=120) as client:
        for api, (path, make) in OVERFLOW.items():
            resp = client.post(path, json={"model": MODEL, "stream": True, **make(big)})
            assert resp.status_code == 400, (api, resp.status_code, resp.text[:500])
            body = resp.json()
            if api == "anthropic-messages":
                assert (
                    body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
                ), body
                message = body["error"]["message"]
                # Anthropic's words; the maximum is the most input tokens (the context less one)
                assert re.fullmatch(
                    rf"prompt is too long: \d+ tokens > {CONTEXT - 1} maximum", message
                ), message
                seen += [message, f"400 {json.dumps(body)}"]  # as Anthropic's SDK words it
            else:  # OpenAI's words for each of its APIs
                assert body["error"]["code"] == "context_length_exceeded", body
                message = body["error"]["message"]
                words = (rf"This model's maximum context length is {CONTEXT} tokens\. However, "
                         if api == "openai-completions" else
                         rf"Your input exceeds the context window of this model: its maximum context "
                         rf"length is {CONTEXT} tokens, and ")  # fmt: skip
                assert re.match(words + r"your (messages|input) resulted in \d+ tokens", message), (
                    message
                )
                seen += [message, f"400 {message}"]  # as OpenAI's SDK words it
    assert script.fired() == {}  # the collector refused them all: none reached the engine
    # Today's wording before issue 22 is no overflow to OpenClaw: the classifier discriminates.
    before = ("the model server refused the request: /generate: engine answered 400: the prompt "
              "has 40000 tokens; the context length is 32768")  # fmt: skip
    verdicts = openclaw_classifier([*seen, before])
    assert verdicts[-1] is False
    assert all(verdicts[:-1]), dict(zip(seen, verdicts[:-1], strict=True))
