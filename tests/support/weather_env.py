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
