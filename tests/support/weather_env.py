"""An environment the tool-calling tiny model (tests/support/tool_model.py) can solve, loaded
as `tests.support.weather_env:WeatherEnv`: its one tool is the model's `get_weather`, whose
result is the one the model was trained on; it passes when the answer says it is sunny."""

from __future__ import annotations

from collections.abc import Sequence

from services.envs.base import Environment, Message, Split, Task, Verdict, pick
from services.envs.sandbox import Sandbox
from tests.support.tool_model import QUESTIONS, TOOL_RESULT, TOOLS

TASKS = [Task(id=f"weather-{i}", env="weather", prompt=q) for i, q in enumerate(QUESTIONS)]
# Held out only in name: the tiny model knows nothing else (the evaluation suite's tests).
HELDOUT = [t.model_copy(update={"id": f"heldout-{t.id}", "split": "heldout"}) for t in TASKS]


class WeatherEnv(Environment):
    name = "weather"

    def __init__(self) -> None:
        self.cities: list[str] = []

    @classmethod
    def tasks(cls, split: Split, n: int | None = None, seed: int = 0) -> list[Task]:
        return pick(TASKS if split == "train" else HELDOUT, n, seed)

    def tools(self) -> list[Message]:
        return TOOLS

    async def reset(self, task: Task, sandbox: Sandbox) -> list[Message]:
        self.cities = []
        return [{"role": "user", "content": task.prompt}]  # as the model was trained: no system

    async def tool_get_weather(self, city: str) -> str:
        self.cities.append(city)
        return TOOL_RESULT

    async def verify(self, messages: Sequence[Message] | None = None) -> Verdict:
        last = (messages or [{}])[-1]
        said = str(last.get("content") or "") if last.get("role") == "assistant" else ""
        return Verdict.of("sunny" in said.lower(), cities=self.cities)


class ScriptedWeatherEnv(WeatherEnv):
    """WeatherEnv whose outcome the test scripts: the episode runs through the model as
    usual, and `verify` returns the task's `data["reward"]` (so advantages can be computed
    by hand). Each episode's task is enqueued whole (`task_json`), a group's members with
    the same task id and different rewards. Loaded as `tests.support.weather_env:ScriptedWeatherEnv`."""

    def __init__(self) -> None:
        super().__init__()
        self.reward = 0.0

    async def reset(self, task: Task, sandbox: Sandbox) -> list[Message]:
        self.reward = float(task.data["reward"])
        return await super().reset(task, sandbox)

    async def verify(self, messages: Sequence[Message] | None = None) -> Verdict:
        return Verdict(reward=self.reward, passed=self.reward >= 0.5, details={"cities": self.cities})


def scripted_task(index: int, reward: float) -> Task:
    """Task `weather-<index % 2>` whose episode's outcome reward will be `reward`."""
    base = TASKS[index % len(TASKS)]
    return base.model_copy(update={"env": "scripted-weather", "data": {"reward": reward}})
