"""The `toolcall` environment's tools, and optionally its tasks, from a JSON file
(NEXTSTATE_ENVS__TOOLS_CONFIG). Without one, the built-in `python` and `submit` and the
generated word problems are used.

    {"tools": [
        {"builtin": "submit"},
        {"name": "get_weather", "description": "Today's weather in a city.",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                        "required": ["city"]},
         "answer": {"table": [{"when": {"city": "Paris"}, "answer": "18 C, light rain"}],
                    "default": "no weather data for {city}"}},
        {"name": "clock", "description": "The time now.", "parameters": {"type": "object", "properties": {}},
         "answer": {"fixed": "09:30"}},
        {"name": "greet", "description": "...", "parameters": {...}, "answer": {"template": "Hello {name}!"}}],
     "tasks": [{"id": "paris", "prompt": "How warm is it in Paris today, in C?", "answer": 18}]}

A tool is a built-in (`{"builtin": "python"}` or `"submit"`) or one of the file's own: a
`name` (letters, digits, `_`, `-`; at most 64), a `description`, its `parameters` (a JSON
Schema object: `properties` with their `type`s, `required`; calls are checked against it
as the built-ins' are) and how it `answer`s:

- `fixed`: always this text;
- `template`: the text with each `{argument}` replaced by the call's value (`{{`, `}}`: braces);
- `table`: the first row whose `when` matches the call (each named argument equal; strings
  ignoring case and surrounding space) answers with its `answer` (a template); no row: the
  table's `default` (a template), else an error observation the model reads.

`tasks` (optional) replace the generated problems: each a `prompt` and an `answer` — a
number (checked as the built-in tasks are: the submitted, else the last stated, number
within 1e-6) or a text (the submitted answer, or the final message's `\\boxed{…}` /
"answer: …", equal to it ignoring case and spacing; else the text found in the final
message as a whole phrase) — with an optional `id` and `split` (train | heldout).

`load` validates all of it once (the worker's start), with errors naming the file, the
tool or task, and the field.
"""

from __future__ import annotations

import json
import re
import string
from functools import cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.envs.base import JSON_TYPES, Message, ToolError
from shared.errors import NextstateError

BUILTINS = ("python", "submit")
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolsConfigError(NextstateError):
    """The tools config cannot be used: the message names the file, the entry and the field."""


class Row(BaseModel):
    model_config = ConfigDict(extra="forbid")

    when: dict[str, Any]
    answer: str


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fixed: str | None = None
    template: str | None = None
    table: list[Row] | None = None
    default: str | None = None  # a table's answer when no row matches

    @model_validator(mode="after")
    def _one_kind(self) -> Answer:
        kinds = [k for k in ("fixed", "template", "table") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(f"give exactly one of fixed, template, table (got {', '.join(kinds) or 'none'})")
        if self.default is not None and self.table is None:
            raise ValueError("default goes with table")
        return self


class ConfigTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    builtin: Literal["python", "submit"] | None = None
    name: str | None = None
    description: str = ""
    parameters: dict[str, Any] | None = None
    answer: Answer | None = None

    @model_validator(mode="after")
    def _shape(self) -> ConfigTool:
        if self.builtin is not None:
            if self.name is not None or self.parameters is not None or self.answer is not None:
                raise ValueError("a builtin names only which one (python or submit)")
            return self
        if self.name is None or not NAME.match(self.name):
            raise ValueError("name: letters, digits, _ and - only, 1 to 64 of them")
        if self.answer is None:
            raise ValueError("answer: say how the tool answers (fixed, template or table)")
        if self.parameters is None:
            self.parameters = {"type": "object", "properties": {}}
        _check_schema(self.parameters)
        props = set(self.parameters.get("properties", {}))
        a = self.answer
        for text in [a.template, a.default, *(r.answer for r in a.table or [])]:
            if text is not None:
                unknown = sorted(set(_fields(text)) - props)
                if unknown:
                    raise ValueError(f"answer names {{{unknown[0]}}}, which is not one of its parameters "
                                     f"({', '.join(sorted(props)) or 'none'})")
        for i, row in enumerate(a.table or []):
            unknown = sorted(set(row.when) - props)
            if unknown:
                raise ValueError(f"answer.table[{i}].when names {unknown[0]!r}, which is not one of its "
                                 f"parameters ({', '.join(sorted(props)) or 'none'})")
        return self

    def spec(self) -> Message:
        """The OpenAI function tool the model is offered."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def respond(self, arguments: dict[str, Any]) -> str:
        """The tool's answer to checked arguments; ToolError when a table has none."""
        a = self.answer
        assert a is not None
        if a.fixed is not None:
            return a.fixed
        if a.template is not None:
            return fill(a.template, arguments)
        for row in a.table or []:
            if all(k in arguments and _same(arguments[k], v) for k, v in row.when.items()):
                return fill(row.answer, arguments)
        if a.default is not None:
            return fill(a.default, arguments)
        raise ToolError(f"no answer for {json.dumps(arguments, sort_keys=True)}")


class ConfigTask(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[\w.-]+$")
    prompt: str = Field(min_length=1)
    answer: float | str
    split: Literal["train", "heldout"] = "train"


class ToolsConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tools: list[ConfigTool] = Field(min_length=1)
    tasks: list[ConfigTask] | None = None

    @model_validator(mode="after")
    def _unique(self) -> ToolsConfig:
        names = [t.builtin or t.name for t in self.tools]
        twice = sorted({n for n in names if names.count(n) > 1 and n is not None})
        if twice:
            raise ValueError(f"tool {twice[0]!r} is given twice")
        ids = [t.id for t in self.tasks or [] if t.id is not None]
        again = sorted({i for i in ids if ids.count(i) > 1})
        if again:
            raise ValueError(f"task id {again[0]!r} is given twice")
        return self

    def custom(self) -> dict[str, ConfigTool]:
        return {t.name: t for t in self.tools if t.name is not None}

    def builtins(self) -> list[str]:
        return [t.builtin for t in self.tools if t.builtin is not None]


def _check_schema(schema: dict[str, Any]) -> None:
    if schema.get("type") != "object":
        raise ValueError('parameters: a JSON Schema object ({"type": "object", "properties": {...}})')
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        raise ValueError("parameters.properties: an object of argument name -> schema")
    for name, prop in props.items():
        kind = prop.get("type") if isinstance(prop, dict) else None
        kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else None
        if not kinds or any(k not in JSON_TYPES for k in kinds):
            raise ValueError(f"parameters.properties.{name}.type: one of {', '.join(JSON_TYPES)} (or a list of them)")
    required = schema.get("required", [])
    missing = [r for r in required if r not in props] if isinstance(required, list) else ["?"]
    if missing:
        raise ValueError(f"parameters.required names {missing[0]!r}, which is not in its properties")


def _fields(text: str) -> list[str]:
    """The `{names}` a template fills; a field that is not a plain name raises."""
    out = []
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise ValueError(f"answer {text!r}: {exc} (write {{{{ and }}}} for braces)") from None
    for _, field, spec, conversion in parsed:
        if field is None:
            continue
        if not re.fullmatch(r"[A-Za-z_]\w*", field) or spec or conversion:
            raise ValueError(f"answer {text!r}: {{{field}}} is not a plain argument name")
        out.append(field)
    return out


def fill(template: str, arguments: dict[str, Any]) -> str:
    values = {k: v if isinstance(v, str) else json.dumps(v) for k, v in arguments.items()}
    missing = [f for f in _fields(template) if f not in values]
    if missing:
        raise ToolError(f"this answer needs the argument {missing[0]!r}")
    return template.format(**values)


def _same(got: Any, want: Any) -> bool:
    if isinstance(got, str) and isinstance(want, str):
        return got.strip().casefold() == want.strip().casefold()
    if isinstance(got, bool) or isinstance(want, bool):
        return got is want
    return bool(got == want)


@cache
def load(path: Path) -> ToolsConfig:
    """The tools config at `path`, validated (cached per path: read once per process)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ToolsConfigError(f"NEXTSTATE_ENVS__TOOLS_CONFIG: cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ToolsConfigError(f"{path} is not JSON: {exc}") from None
    try:
        return ToolsConfig.model_validate(raw)
    except ValidationError as exc:
        raise ToolsConfigError(f"{path}: " + "; ".join(_where(raw, e) for e in exc.errors())) from None


def _where(raw: Any, err: Any) -> str:
    """`tools[2] (get_weather).answer: give exactly one of ...`."""
    loc = list(err.get("loc", ()))
    parts: list[str] = []
    node = raw
    for i, key in enumerate(loc):
        if isinstance(key, int):
            parts[-1] += f"[{key}]"
            node = node[key] if isinstance(node, list) and key < len(node) else None
            if i == 1 and isinstance(node, dict) and (node.get("name") or node.get("id")):
                parts[-1] += f" ({node.get('name') or node.get('id')})"
        else:
            parts.append(str(key))
            node = node.get(key) if isinstance(node, dict) else None
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    return f"{'.'.join(parts) or 'the file'}: {msg}"
