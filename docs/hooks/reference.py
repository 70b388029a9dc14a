"""The site's generated references: configuration from the settings classes, streams and
messages from shared/keys.py and shared/schemas.py.

A MkDocs hook (`hooks:` in mkdocs.yml): a page holding the marker
`<!-- nextstate:generated NAME -->` gets the reference NAME in its place when the site is
built, so the pages cannot drift from the code. tests/unit/test_docs.py and
tests/unit/test_references.py call the same functions.

What a variable's text is, first found: the field's `description`; the comment lines right
above the field (or at the end of its line); its line in the module's or group class's
docstring (`NEXTSTATE_X=default   what it does`, the form the settings modules use).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import inspect
import io
import re
import sys
import tokenize
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!--\s*nextstate:generated\s+([a-z-]+)\s*-->")
ENV_ASSIGN = re.compile(r"(?<![\w$])(NEXTSTATE_[A-Z0-9_]+)=(\S*)")


def _repo_first() -> None:
    """Document this checkout's code, whatever else is installed."""
    if sys.path[:1] != [str(ROOT)]:
        sys.path.insert(0, str(ROOT))


# -- source text: comments, docstrings ---------------------------------------------------


@dataclasses.dataclass
class _Source:
    """A module's comments by line, and each class's field lines."""

    comments: dict[int, str]
    code_lines: set[int]
    fields: dict[str, dict[str, int]]  # class name -> field name -> line
    attr_docs: dict[str, dict[str, str]]  # class name -> field name -> string after it

    @classmethod
    def of(cls, path: Path) -> _Source:
        text = path.read_text()
        comments: dict[int, str] = {}
        code: set[int] = set()
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string.lstrip("#").strip()
            elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                                  tokenize.DEDENT, tokenize.ENDMARKER):
                code.add(tok.start[0])
        fields: dict[str, dict[str, int]] = {}
        docs: dict[str, dict[str, str]] = {}
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ClassDef):
                continue
            fields[node.name], docs[node.name] = {}, {}
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    fields[node.name][stmt.target.id] = stmt.lineno
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    if (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                            and isinstance(nxt.value.value, str)):
                        docs[node.name][stmt.target.id] = inspect.cleandoc(nxt.value.value)
        return cls(comments, code, fields, docs)

    def comment_for(self, cls_name: str, field: str) -> str:
        line = self.fields.get(cls_name, {}).get(field)
        if line is None:
            return ""
        if field in self.attr_docs.get(cls_name, {}):
            return self.attr_docs[cls_name][field]
        above: list[str] = []
        n = line - 1
        while n in self.comments and n not in self.code_lines:
            if re.fullmatch(r"-+.*?-+|-+", self.comments[n]):
                break  # a divider (`# -- loss ----`), not a field's comment
            above.insert(0, self.comments[n])
            n -= 1
        if above:
            return " ".join(above)
        return self.comments.get(line, "")


_SOURCES: dict[Path, _Source] = {}


def _source(obj: Any) -> tuple[_Source | None, str]:
    try:
        path = Path(inspect.getfile(obj))
    except (TypeError, OSError):
        return None, ""
    if path not in _SOURCES:
        _SOURCES[path] = _Source.of(path)
    return _SOURCES[path], obj.__name__


def env_lines(*texts: str | None) -> dict[str, tuple[str, str]]:
    """`NEXTSTATE_X=default   what it does` in docstrings, two to a line or one continued on
    the indented lines under it: variable -> (default, text)."""
    out: dict[str, tuple[str, str]] = {}
    for text in texts:
        if not text:
            continue
        current: str | None = None
        for line in text.splitlines():
            found = list(ENV_ASSIGN.finditer(line))
            if found:
                current = None
                for i, m in enumerate(found):
                    end = found[i + 1].start() if i + 1 < len(found) else len(line)
                    said = line[m.end():end].strip()
                    if m.group(1) not in out:
                        out[m.group(1)] = (m.group(2), said)
                        current = m.group(1)
            elif current and line.strip() and line.startswith((" ", "\t")):
                default, said = out[current]
                out[current] = (default, f"{said} {line.strip()}".strip())
            else:
                current = None
    return out


# -- types and defaults ---------------------------------------------------------------------


def type_name(t: Any) -> str:
    """A field's annotation as a reader would write it: `int`, `list[str]`, `a | b`."""
    from pydantic import SecretStr

    origin = typing.get_origin(t)
    args = typing.get_args(t)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    if t is type(None):
        return "none"
    if t is SecretStr:
        return "secret"
    if isinstance(t, type):
        if issubclass(t, enum.Enum):
            return " \\| ".join(f"`{m.value}`" for m in t)
        if issubclass(t, Path):
            return "path"
        return t.__name__
    return str(t).replace("typing.", "")


def default_text(field: Any) -> str:
    from pydantic import BaseModel, SecretStr
    from pydantic_core import PydanticUndefined

    factory = field.default_factory
    if factory is not None:
        if factory not in (list, dict, set, tuple) and getattr(factory, "__name__", "") != "<lambda>":
            return f"`{getattr(factory, '__name__', 'computed')}()`"  # a new id, the time: per message
        try:
            value = factory()
        except TypeError:  # a factory of the validated data
            return "computed"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, BaseModel):
        return "its fields' defaults"
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, dict, tuple)):
        import json

        try:
            return f"`{json.dumps(value)}`"
        except TypeError:
            return f"`{value!r}`"
    text = str(value)
    return f"`{text}`" if text else "empty"


def _cell(text: str) -> str:
    """Text for a table cell: one line, `|` escaped, `<run>` shown (not read as HTML) outside code."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    out = [p if p.startswith("`") else p.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
           for p in parts]
    return "".join(out).replace("|", "\\|")


# -- configuration ---------------------------------------------------------------------------


# What a field of these names means in every service that has one.
GENERIC = {
    "host": "the address its HTTP endpoints listen on",
    "port": "the port of its HTTP endpoints (`/healthz`, `/readyz`, `/metrics`, and its API)",
}


@dataclasses.dataclass
class Variable:
    name: str
    type: str
    default: str
    text: str


def _model_class(annotation: Any) -> type | None:
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def variables(model: type, prefix: str, docs: dict[str, tuple[str, str]],
              only: Callable[[str], bool] = lambda name: True) -> Iterator[tuple[str, Variable]]:
    """(group path, Variable) for every leaf field of `model`, nested groups expanded."""
    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        if not only(name):
            continue
        env = f"{prefix}{name.upper()}"
        nested = _model_class(field.annotation)
        if nested is not None:
            yield from variables(nested, env + "__", {**docs, **env_lines(nested.__doc__)})
            continue
        owner = next((c for c in model.__mro__ if name in getattr(c, "__annotations__", {})), model)
        src, cls_name = _source(owner)
        text = field.description or (src.comment_for(cls_name, name) if src else "")
        if not text and env in docs:
            text = docs[env][1]
        if not text and name in GENERIC:
            text = GENERIC[name]
        yield prefix, Variable(env, type_name(field.annotation), default_text(field), text)


def _settings_classes() -> list[tuple[str, type]]:
    """(service, class) of every Settings subclass in shared/ and services/*/."""
    _repo_first()
    from shared.settings import Settings

    found: list[tuple[str, type]] = []
    files = sorted(ROOT.glob("shared/*.py")) + sorted(ROOT.glob("services/*/settings.py"))
    for path in files:
        text = path.read_text()
        if not re.search(r"^class \w+\(Settings\):", text, re.M):
            continue
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, Settings) and obj is not Settings and obj.__module__ == module.__name__:
                service = path.parent.name if path.parent.name != "shared" else _group_of(obj)
                found.append((service, obj))
    return found


def _group_of(cls: type) -> str:
    from shared.settings import Settings

    own = [n for n in cls.model_fields if n not in Settings.model_fields]  # type: ignore[attr-defined]
    return own[0] if own else cls.__name__


def _table(rows: list[Variable]) -> list[str]:
    out = ["| variable | type | default | what it does |", "| --- | --- | --- | --- |"]
    for v in rows:
        out.append(f"| `{v.name}` | {v.type} | {_cell(v.default)} | {_cell(v.text)} |")
    return out


def configuration_markdown() -> str:
    _repo_first()
    from shared.settings import ENV_PREFIX, Settings

    lines = ["## Shared", "",
             "Read by every service (`shared/settings.py`).", ""]
    shared_docs = env_lines(sys.modules[Settings.__module__].__doc__)
    lines += _table([v for _, v in variables(Settings, ENV_PREFIX, shared_docs)])
    by_service: dict[str, list[type]] = {}
    for service, cls in _settings_classes():
        by_service.setdefault(service, []).append(cls)
    for service in sorted(by_service):
        lines += ["", f"## {service}", ""]
        classes = by_service[service]
        where = ", ".join(f"`{Path(inspect.getfile(c)).relative_to(ROOT)}`" for c in classes)
        runs = f"`python -m services.{service}`" if (ROOT / "services" / service / "__main__.py").exists() else ""
        lines += [(f"{runs}; " if runs else "") + f"settings: {where}.", ""]
        rows: dict[str, Variable] = {}
        for cls in classes:
            module_doc = sys.modules[cls.__module__].__doc__
            docs = env_lines(module_doc)
            own = lambda n: n not in Settings.model_fields  # noqa: E731
            for _, v in variables(cls, ENV_PREFIX, docs, only=own):
                if v.name not in rows or (not rows[v.name].text and v.text):
                    rows[v.name] = v
        lines += _table(list(rows.values()))
    return "\n".join(lines) + "\n"


# -- streams and messages --------------------------------------------------------------------


def _constants_with_comments(path: Path, pattern: str) -> list[tuple[str, str, str]]:
    """(name, value, trailing comment) of module-level string constants named like `pattern`."""
    src = _Source.of(path)
    out = []
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and re.fullmatch(pattern, node.targets[0].id)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            out.append((node.targets[0].id, node.value.value, src.comments.get(node.lineno, "")))
    return out


def _key_examples() -> list[tuple[str, str]]:
    """(key as built for the default prefix, its docstring) of every `Keys` method and property."""
    _repo_first()
    from shared.keys import STREAMS, Keys

    keys = Keys()
    out = []
    for name, member in inspect.getmembers(Keys):
        if name.startswith("_") or name in ("prefix",):
            continue
        if isinstance(member, property):
            value, doc = member.fget(keys), member.__doc__  # type: ignore[misc]
        elif inspect.isfunction(member):
            params = list(inspect.signature(member).parameters)[1:]
            if name in ("stream", "short"):
                continue
            try:
                value = member(keys, *[f"<{p}>" for p in params])
            except Exception:
                continue
            doc = member.__doc__
        else:
            continue
        streams = {keys.stream(s) for s in STREAMS}
        if isinstance(value, str) and value not in streams:  # streams have a table of their own
            out.append((value, inspect.cleandoc(doc or "")))
    return sorted(set(out))


def _fields_table(model: type) -> list[str]:
    _src, _cls_name = _source(model)
    rows = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        owner = next((c for c in model.__mro__ if name in getattr(c, "__annotations__", {})), model)
        osrc, oname = _source(owner)
        text = field.description or (osrc.comment_for(oname, name) if osrc else "")
        rows.append(f"| `{name}` | {type_name(field.annotation)} | {_cell(default_text(field))} | {_cell(text)} |")
    return rows


def _nested_models(model: type, seen: set[type]) -> Iterator[type]:
    for field in model.model_fields.values():  # type: ignore[attr-defined]
        stack = [field.annotation]
        while stack:
            t = stack.pop()
            stack.extend(typing.get_args(t))
            m = _model_class(t)
            if m is not None and m not in seen:
                seen.add(m)
                yield m
                yield from _nested_models(m, seen)


def streams_markdown() -> str:
    _repo_first()
    import shared.keys as keys_module
    from shared import schemas

    path = Path(inspect.getfile(keys_module))
    prefix = keys_module.Keys().prefix
    lines = ["## Streams", "",
             f"Every stream's key is `<prefix>:<name>` (default prefix `{prefix}`); "
             f"the message is the JSON in the entry's `{keys_module.FIELD}` field.", "",
             "| stream | key |", "| --- | --- |"]
    for name in keys_module.STREAMS:
        lines.append(f"| `{name}` | `{keys_module.Keys().stream(name)}` |")
    lines += ["", "## Consumer groups", "", "| constant | group | what |", "| --- | --- | --- |"]
    for const, value, comment in _constants_with_comments(path, r"GROUP_[A-Z_]+"):
        what = comment or ", ".join(f"on `{s}`" for s, g in keys_module.GROUPS.items() if g == value)
        lines.append(f"| `{const}` | `{value}` | {_cell(what)} |")
    lines += ["", "## Keys", "",
              "Every other Redis key, as `shared/keys.py` builds it for the default prefix.", "",
              "| key | what |", "| --- | --- |"]
    for value, doc in _key_examples():
        lines.append(f"| `{value}` | {_cell(doc)} |")
    lines += ["", "## Messages", "",
              f"Every message has `type`, `schema_version` (now {schemas.SCHEMA_VERSION}), an idempotency "
              "`id` and `created_at` (unix seconds); unknown fields are refused "
              "(`shared/schemas.py`).", ""]
    seen: set[type] = set(schemas.MESSAGE_TYPES.values())
    nested: list[type] = []
    for type_, model in schemas.MESSAGE_TYPES.items():
        doc = inspect.cleandoc(model.__doc__ or "")
        lines += [f"### {model.__name__}", "", f"`type: {type_}`" + (f" — {_cell(doc)}" if doc else ""), ""]
        lines += [*_fields_table(model), ""]
        nested.extend(_nested_models(model, seen))
    if nested:
        lines += ["## Parts of messages", ""]
        for model in nested:
            doc = inspect.cleandoc(model.__doc__ or "")
            if model.__module__ == "pydantic.main" or doc.startswith("!!! abstract"):
                doc = ""
            lines += [f"### {model.__name__}", ""] + ([_cell(doc), ""] if doc else [])
            lines += [*_fields_table(model), ""]
    return "\n".join(lines).rstrip() + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "configuration": configuration_markdown,
    "streams": streams_markdown,
}


def expand(markdown: str) -> str:
    """The page's markdown with every generated-reference marker replaced."""
    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            raise ValueError(f"unknown generated reference {name!r}; one of {', '.join(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(one, markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return expand(markdown)
