"""Scenario files of the `simulated-user` suite: who the user is, what they want, how the
conversation opens, how long it may run and how the user rates it.

One JSON object per `*.json` file in a folder (NEXTSTATE_EVAL__SCENARIOS, default
services/evaluator/scenarios/):

    {"name": "rainy-weekend",                     unique; names the tasks
     "persona": "A busy parent of two …",         who the simulated user is
     "goal": "A short indoor plan for …",         what they want from the assistant
     "opening": "Any ideas for …"                 the first user message — or a list of
                                                  them: one conversation per opening
     "max_turns": 3,                              assistant replies at most (1..20)
     "rubric": "10: … 1: …",                      how the user rates the assistant
     "scale": [1, 10],                            the rating range (default 1..10)
     "system": "…"}                               optional system prompt for the candidate

Files are read in name order; a file that does not parse or validate is a
`SettingsError` naming it and the field at fault.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared.errors import SettingsError
from shared.schemas import describe

DEFAULT_FOLDER = Path(__file__).resolve().parent.parent / "scenarios"


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=80, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    persona: str = Field(min_length=1)
    goal: str = Field(min_length=1)
    opening: str | list[str]
    max_turns: int = Field(3, ge=1, le=20)
    rubric: str = Field(min_length=1)
    scale: tuple[int, int] = (1, 10)
    system: str | None = None

    @field_validator("opening")
    @classmethod
    def _openings_not_empty(cls, v: str | list[str]) -> str | list[str]:
        items = [v] if isinstance(v, str) else v
        if not items or any(not o.strip() for o in items):
            raise ValueError("needs at least one opening message, none of them empty")
        return v

    @model_validator(mode="after")
    def _scale_ordered(self) -> Scenario:
        if self.scale[0] >= self.scale[1]:
            raise ValueError(f"scale must be [low, high] with low < high, got {list(self.scale)}")
        return self

    @property
    def openings(self) -> list[str]:
        return [self.opening] if isinstance(self.opening, str) else list(self.opening)


def load_scenario(path: Path) -> Scenario:
    try:
        return Scenario.model_validate(json.loads(path.read_text(encoding="utf-8")))
    except OSError as exc:
        raise SettingsError(f"scenario {path}: cannot read it: {exc}") from exc
    except ValueError as exc:  # JSON syntax (ValidationError is a ValueError too)
        why = describe(exc) if isinstance(exc, ValidationError) else f"not valid JSON: {exc}"
        raise SettingsError(f"scenario {path}: {why}") from exc


def load_scenarios(folder: Path | None = None) -> list[Scenario]:
    """Every scenario in `folder` (default: the package's), in file-name order."""
    folder = DEFAULT_FOLDER if folder is None else Path(folder)
    if not folder.is_dir():
        raise SettingsError(f"NEXTSTATE_EVAL__SCENARIOS={folder} is not a folder of scenario files")
    scenarios = [load_scenario(p) for p in sorted(folder.glob("*.json"))]
    if not scenarios:
        raise SettingsError(f"no scenario (*.json) in {folder}")
    seen: dict[str, int] = {}
    for s in scenarios:
        seen[s.name] = seen.get(s.name, 0) + 1
    dupes = sorted(n for n, k in seen.items() if k > 1)
    if dupes:
        raise SettingsError(f"scenario names must be unique in {folder}: {', '.join(dupes)} repeat")
    return scenarios
