"""The environment API: what an episode driver needs from an environment, and where
environments and their tasks come from.

One episode, as the driver runs it:

    env = load_environment("terminal")            # or "package.module:MyEnv"
    task = load_tasks(env, "train", n=1, seed=7)[0]
    with Sandbox() as sandbox:
        messages = await env.reset(task, sandbox)  # system + user
        ... the policy answers through the collector, offered env.tools();
        ... each tool call -> await env.step(name, arguments) -> the tool message's text
        ... until it answers without a tool call, env.done, or the turn budget
        verdict = await env.verify(messages)       # the whole conversation
        env.close()

`step` never raises on what the model got wrong (unknown tool, bad or missing arguments, a
path outside the sandbox): the model reads an error observation and may try again.
Everything an episode runs, runs in its `Sandbox`. `verify` decides the reward from the
sandbox's final state (or the answer given) with checks the model never sees.

A user's environment subclasses `Environment` and is named `module:Class`.
"""

from __future__ import annotations

import importlib
import json
import random
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.envs.sandbox import ExecResult, Sandbox, SandboxError
from shared.errors import NextstateError

Split = Literal["train", "heldout"]
Message = dict[str, Any]

BUILTIN: dict[str, str] = {
    "toolcall": "services.envs.toolcall:ToolCallEnv",
    "terminal": "services.envs.terminal:TerminalEnv",
    "swe": "services.envs.swe:SweEnv",
    "browser": "services.envs.browser:BrowserEnv",
}


class EnvironmentNotFound(NextstateError):
    """An environment name or `module:Class` spec that does not resolve to an Environment."""


class Task(BaseModel):
    """One task of an environment: what the user asks, and what its checks need (`data`)."""

    model_config = ConfigDict(frozen=True)

    id: str
    env: str
    prompt: str
    data: dict[str, Any] = Field(default_factory=dict)
    split: Split = "train"


class Verdict(BaseModel):
    """How an episode went: `reward` in [0, 1] (1 or 0 for pass/fail checks)."""

    model_config = ConfigDict(frozen=True)

    reward: float = Field(ge=0.0, le=1.0)
    passed: bool
    details: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def of(cls, passed: bool, **details: Any) -> Verdict:
        return cls(reward=1.0 if passed else 0.0, passed=passed, details=details)


class ToolError(Exception):
    """Raised by a tool handler for a call the model got wrong; `step` turns it into an
    error observation."""


def function_tool(name: str, description: str, params: dict[str, tuple[str | list[str], str]]) -> Message:
    """An OpenAI function tool; `params` maps each (required) argument to (JSON type or
    types, description)."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t, "description": d} for k, (t, d) in params.items()},
                "required": list(params),
                "additionalProperties": False,
            },
        },
    }


JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "object": (dict,), "array": (list,),
}


def check_arguments(schema: dict[str, Any], arguments: Any) -> dict[str, Any]:
    """The arguments of a call, checked against its tool's parameter schema (the subset
    `function_tool` writes: required, property types, no extras). Raises ToolError."""
    if arguments is None:  # a call without arguments
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as e:
            raise ToolError(f"arguments are not valid JSON ({e.msg}); send a JSON object") from e
    if not isinstance(arguments, dict):
        raise ToolError(f"arguments must be a JSON object, not {type(arguments).__name__}")
    props: dict[str, Any] = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        raise ToolError(f"missing required argument(s): {', '.join(missing)}")
    extra = [k for k in arguments if k not in props]
    if extra and schema.get("additionalProperties") is False:
        raise ToolError(f"unknown argument(s): {', '.join(extra)}; expected: {', '.join(props) or 'none'}")
    for key, value in arguments.items():
        kind = props.get(key, {}).get("type")
        kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
        allowed = tuple(t for k in kinds for t in JSON_TYPES.get(k, ()))
        if not allowed:
            continue
        if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
            raise ToolError(f"argument {key!r} must be a {' or '.join(kinds)}, not {type(value).__name__}")
    return arguments


def error(text: str) -> str:
    """An error observation: what the model did wrong, so it can try again."""
    return f"Error: {text}"


# Runs in the sandbox, as its uid: a symlink the episode planted on the way is replaced,
# never followed; a directory is never replaced by a file (nor a file by a directory).
_WRITER = r"""
import json, os, sys
for path, text in json.load(sys.stdin).items():
    parts = path.split("/")
    try:
        for i in range(1, len(parts) + 1):
            p = "/".join(parts[:i])
            if os.path.islink(p):
                os.unlink(p)
            if i < len(parts) and not os.path.exists(p):
                os.mkdir(p)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        sys.exit(f"{path}: {e.strerror}")
"""


def relative_path(path: str) -> str:
    """`path` normalised, if it stays inside the sandbox directory; else ToolError."""
    if not path.strip():
        raise ToolError("the path is empty")
    pure = PurePosixPath(path.strip())
    if not pure.parts:
        raise ToolError(f"{path!r} is the working directory itself, not a file in it")
    if pure.is_absolute() or ".." in pure.parts:
        raise ToolError(f"{path!r} is outside the working directory: use a relative path without '..'")
    return str(pure)


async def write_files(sandbox: Sandbox, files: Mapping[str, str]) -> ExecResult:
    """Write text files (relative paths, parents made) into the sandbox, as its uid."""
    paths = {relative_path(p): text for p, text in files.items()}
    return await sandbox.arun(["python3", "-I", "-S", "-c", _WRITER], stdin=json.dumps(paths))


async def setup_files(sandbox: Sandbox, files: Mapping[str, str]) -> None:
    """A task's files into a fresh sandbox; a failure is the sandbox's, not the model's."""
    if files:
        result = await write_files(sandbox, files)
        if result.exit_code != 0:
            raise SandboxError(f"could not write the task's files into {sandbox.path}: {result.observation()}")


def opening(system: str, task: Task) -> list[Message]:
    return [{"role": "system", "content": system}, {"role": "user", "content": task.prompt}]


def pick(tasks: Sequence[Task], n: int | None, seed: int) -> list[Task]:
    """`n` of `tasks` chosen by `seed` (all of them, in order, when n is None)."""
    if n is None:
        return list(tasks)
    return random.Random(seed).sample(list(tasks), min(n, len(tasks)))


class Environment(ABC):
    """One episode of one task at a time. Subclasses give `tools()`, the `tool_<name>`
    coroutines `step` dispatches to (or their own `step`), `reset`, `verify` and `tasks`."""

    name: ClassVar[str] = ""
    done: bool = False  # the episode is over (e.g. an answer was submitted): stop asking the model

    @classmethod
    @abstractmethod
    def tasks(cls, split: Split, n: int | None = None, seed: int = 0) -> list[Task]:
        """This environment's tasks of `split`: `n` of them chosen by `seed`, or all."""

    @abstractmethod
    def tools(self) -> list[Message]:
        """The tools offered to the model, in the OpenAI function-tool format."""

    @abstractmethod
    async def reset(self, task: Task, sandbox: Sandbox) -> list[Message]:
        """Start an episode of `task` in `sandbox` (fresh, owned by the caller); the opening
        messages (system, user)."""

    @abstractmethod
    async def verify(self, messages: Sequence[Message] | None = None) -> Verdict:
        """The episode's verdict, from the sandbox's state and, where the answer can be
        given in text, the conversation."""

    async def step(self, tool_name: str, arguments: dict[str, Any] | str | None) -> str:
        """Run one tool call; its observation. What the model got wrong is an error
        observation, never an exception."""
        specs = {t["function"]["name"]: t["function"] for t in self.tools()}
        if tool_name not in specs:
            return error(f"there is no tool {tool_name!r}; the tools are: {', '.join(specs)}")
        handler: Callable[..., Awaitable[str]] | None = getattr(self, f"tool_{tool_name}", None)
        if handler is None:
            raise NotImplementedError(f"{type(self).__name__} offers {tool_name!r} but has no tool_{tool_name}")
        try:
            args = check_arguments(specs[tool_name].get("parameters", {}), arguments)
            return await handler(**args)
        except ToolError as e:
            return error(f"{tool_name}: {e}")

    def close(self) -> None:
        """End the episode; release what it holds beyond its sandbox (the caller closes that)."""
        self.done = True


def environment_class(spec: str) -> type[Environment]:
    """The class named by a built-in name (toolcall, terminal, swe) or `module:Class`."""
    target = BUILTIN.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise EnvironmentNotFound(f"unknown environment {spec!r}: use one of {', '.join(BUILTIN)} "
                                  "or 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvironmentNotFound(f"environment {spec!r}: cannot import {module_name!r} ({e}); "
                                  "is it on PYTHONPATH?") from e
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise EnvironmentNotFound(f"environment {spec!r}: {attr!r} in {module_name!r} is not a "
                                  "subclass of services.envs.base.Environment")
    return cls


def load_environment(spec: str) -> Environment:
    """A fresh environment for one episode."""
    return environment_class(spec)()


def load_tasks(env: str | Environment | type[Environment], split: Split = "train",
               n: int | None = None, seed: int = 0) -> list[Task]:
    """Tasks of an environment (given by name/spec, class or instance): deterministic in `seed`."""
    cls = environment_class(env) if isinstance(env, str) else env if isinstance(env, type) else type(env)
    return cls.tasks(split, n, seed)
