"""The `toolcall` environment with its tools and tasks from a config file
(NEXTSTATE_ENVS__TOOLS_CONFIG, services/envs/tools_config.py): each way a tool answers, calls
checked against the file's schemas, text and number answers graded, and the errors a bad
file gets at load (the worker's start); without a file the built-in tools stay."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.envs import tools_config
from services.envs.sandbox import Sandbox
from services.envs.settings import EnvsConfig, configure
from services.envs.toolcall import ToolCallEnv

WEATHER = {
    "name": "get_weather", "description": "Today's weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "a city"},
                                                     "unit": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False},
    "answer": {"table": [{"when": {"city": "Paris"}, "answer": "18 C, light rain"},
                         {"when": {"city": "Oslo", "unit": "F"}, "answer": "41 F in {city}"}],
               "default": "no weather data for {city}"},
}
CONFIG = {
    "tools": [
        {"builtin": "submit"}, WEATHER,
        {"name": "clock", "description": "The time now.", "answer": {"fixed": "09:30"}},
        {"name": "greet", "description": "Greets someone.",
         "parameters": {"type": "object", "properties": {"name": {"type": "string"}, "times": {"type": "integer"}},
                        "required": ["name"]},
         "answer": {"template": "Hello {name}! {{x{times}}}"}},
    ],
    "tasks": [
        {"id": "paris", "prompt": "How warm is it in Paris today, in degrees C?", "answer": 18},
        {"id": "paris-sky", "prompt": "Is it raining in Paris?", "answer": "light rain"},
        {"prompt": "What time is it?", "answer": "09:30", "split": "heldout"},
    ],
}


@pytest.fixture
def use(tmp_path: Path) -> Iterator[Callable[[Any], Path]]:
    def write(config: Any) -> Path:
        path = tmp_path / f"tools-{len(list(tmp_path.iterdir()))}.json"
        path.write_text(config if isinstance(config, str) else json.dumps(config))
        configure(EnvsConfig(tools_config=path))
        return path

    yield write
    configure(None)
    tools_config.load.cache_clear()


async def test_tools_and_tasks_come_from_the_file(use: Callable[[Any], Path]) -> None:
    use(CONFIG)
    train, heldout = ToolCallEnv.tasks("train"), ToolCallEnv.tasks("heldout")
    assert [t.id for t in train] == ["paris", "paris-sky"] and [t.id for t in heldout] == ["toolcall-heldout-2"]
    env = ToolCallEnv()
    with Sandbox() as sb:
        opening = await env.reset(train[0], sb)
    assert "submit" in opening[0]["content"]
    tools = {t["function"]["name"]: t["function"] for t in env.tools()}
    assert list(tools) == ["submit", "get_weather", "clock", "greet"]
    assert tools["get_weather"]["parameters"] == WEATHER["parameters"]
    assert tools["clock"]["parameters"] == {"type": "object", "properties": {}}
    step = env.step
    assert await step("get_weather", {"city": " paris "}) == "18 C, light rain"  # case and spaces ignored
    assert await step("get_weather", '{"city": "Oslo", "unit": "F"}') == "41 F in Oslo"
    assert await step("get_weather", {"city": "Oslo"}) == "no weather data for Oslo"  # unit missing: default
    assert await step("clock", None) == "09:30"
    assert await step("greet", {"name": "Ada", "times": 2}) == "Hello Ada! {x2}"
    assert await step("greet", {"name": "Ada"}) == "Error: greet: this answer needs the argument 'times'"
    assert (await step("get_weather", {})).startswith("Error: get_weather: missing required argument(s): city")
    assert "unknown argument(s): country" in await step("get_weather", {"city": "Rome", "country": "IT"})
    assert "must be a integer" in await step("greet", {"name": "Ada", "times": "two"})
    assert "there is no tool 'python'" in await step("python", {"code": "print(1)"})  # not in the file
    assert (await step("submit", {"answer": "18.0"})).startswith("Submitted")
    assert (await env.verify()).passed


async def test_number_and_text_answers(use: Callable[[Any], Path]) -> None:
    use(CONFIG)
    number, text = ToolCallEnv.tasks("train")

    async def verdict(task: Any, *, submit: str | None = None, say: str = "") -> bool:
        env = ToolCallEnv()
        with Sandbox() as sb:
            await env.reset(task, sb)
        if submit is not None:
            await env.step("submit", {"answer": submit})
        return (await env.verify([{"role": "assistant", "content": say}])).passed

    assert await verdict(number, say="It is 18 degrees.") and not await verdict(number, say="About 20.")
    assert await verdict(text, submit="Light  Rain.") and not await verdict(text, submit="rain")
    assert await verdict(text, say="Yes: there is light rain in Paris today.")
    assert not await verdict(text, say="Answer: heavy rain, not light rain")  # the stated answer counts
    assert await verdict(text, say="\\boxed{light rain}")


async def test_without_a_file_the_builtin_tools_stay() -> None:
    configure(EnvsConfig())
    try:
        env = ToolCallEnv()
        assert [t["function"]["name"] for t in env.tools()] == ["python", "submit"]
        assert ToolCallEnv.tasks("train", n=2)[0].id == "toolcall-train-0-0"
    finally:
        configure(None)


@pytest.mark.parametrize(("config", "error"), [
    ("{not json", r"is not JSON"),
    ({"tools": []}, r"tools: List should have at least 1 item"),
    ({"tools": [{**WEATHER, "answer": {"template": "in {town}"}}]},
     r"tools\[0\] \(get_weather\): answer names \{town\}, which is not one of its parameters "
     r"\(city, unit\)"),
    ({"tools": [{**WEATHER, "answer": {"fixed": "x", "template": "y"}}]},
     r"tools\[0\] \(get_weather\)\.answer: give exactly one of fixed, template, table"),
    ({"tools": [WEATHER, WEATHER]}, r"tool 'get_weather' is given twice"),
    ({"tools": [{**WEATHER, "parameters": {"type": "object", "properties": {"city": {"type": "text"}}}}]},
     r"parameters\.properties\.city\.type: one of string, integer"),
    ({"tools": [{**WEATHER, "name": "get weather"}]}, r"name: letters, digits, _ and - only"),
    ({"tools": [{"builtin": "shell"}]}, r"tools\[0\]\.builtin: Input should be 'python' or 'submit'"),
    ({"tools": [{"name": "x", "answer": {"fixed": "y"}, "color": "red"}]}, r"tools\[0\] \(x\)\.color: Extra inputs are not permitted"),
    ({"tools": [{"builtin": "submit"}], "tasks": [{"prompt": "p"}]}, r"tasks\[0\]\.answer: Field required"),
])
def test_a_bad_file_is_refused_naming_the_entry(use: Callable[[Any], Path], config: Any, error: str) -> None:
    path = use(config)
    with pytest.raises(tools_config.ToolsConfigError, match=error) as got:
        tools_config.load(path)
    assert str(got.value).startswith(str(path))


def test_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(tools_config.ToolsConfigError, match=r"TOOLS_CONFIG: cannot read .*missing\.json"):
        tools_config.load(tmp_path / "missing.json")
