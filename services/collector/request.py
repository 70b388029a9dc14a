"""A `/v1/chat/completions` body and headers -> one validated `ChatCall`, or a 400.

Strict where OpenAI is strict: every OpenAI field is type-checked without coercion
(`"temperature": "0.5"`, `"max_tokens": "10"`, `"stream": "yes"`, `"n": true` are 400s,
as at OpenAI), and so is every message (roles, content types, tool calls with an `id`,
`type: "function"` and string `arguments`), every tool (`type: "function"`, a valid
function name), `tool_choice` (naming a function that is in `tools`, and only with
`tools`), the pairing of tool messages with the assistant tool calls they answer (each
`tool_call_id` answers a call of the assistant message just before them, and every call
is answered before the conversation goes on), `response_format`, `logprobs` and
`top_logprobs` (0–20, only with `logprobs: true`), `stream_options` (only with `stream`).

Every error is a 400 in OpenAI's shape. `param` names the request's top-level parameter
(`messages`, `tools`, `temperature`, …) so that clients can switch on it; the message
names the exact place (`messages[2].tool_call_id`) and what to send instead. `code` is
`invalid_type`, `missing_required_parameter`, `invalid_value` or `unsupported_value`
(`invalid_json` for a body that is not JSON).

What the collector honours: messages, temperature, top_p, top_k (extension),
max_tokens / max_completion_tokens, stop, seed, tools, tool_choice, stream,
stream_options.include_usage, logprobs / top_logprobs, response_format, user, and
`session_id` (extension, also the `X-Session-Id` header; without either, the session id
an agent sends in its own headers: sessions.py).

n: up to `max_n` (16) choices sampled from the one prompt (a group: completion.py); with
`seed`, choice i samples with seed + i, so the choices differ and each is reproducible.
Streaming n > 1 is refused (a 400 naming `n`): send `stream: false`, or n requests.

response_format: `text` is plain generation; `json_object` and `json_schema`
(`{"name", "schema", "strict", "description"}`) become a JSON Schema
(`SamplingParams.json_schema`; `{"type": "object"}` for json_object, as SGLang does) that
the engine enforces by constrained decoding; an engine that cannot is a 400 from the
engine, never an unconstrained answer. Any other type is refused. The schema itself is
checked by the engine's grammar compiler; OpenAI's extra rules for `strict: true`
schemas (every property required, `additionalProperties: false`) are not enforced here.

tool_choice: "none" renders the prompt *without* the tools and parses no calls (the
model never sees them, so the captured prompt is exactly what it was given); "auto",
"required" and a named function render the tools and parse calls — "required" and a
named function are not enforced by constrained decoding.

Refused because they would be silently ignored otherwise: a non-empty `logit_bias`,
the deprecated `functions` / `function_call` (use tools / tool_choice), `audio` and
output `modalities` other than text. Accepted and ignored (type-checked): presence and
frequency penalties, `parallel_tool_calls`, `metadata`, `store`, `service_tier`,
`reasoning_effort`. Fields OpenAI does not define are ignored, as OpenAI-compatible
servers (vLLM, SGLang) do, so extension fields from their clients pass.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from services.collector.context_window import Api
from services.collector.openai_shapes import ApiError
from services.collector.sessions import MAX_ID, agent_session
from services.collector.settings import CollectorConfig
from shared.chat_messages import ChatTemplateError, normalize_messages, normalize_tools
from shared.schemas import SamplingParams

TurnType = Literal["main", "side"]
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
TRUE = frozenset({"1", "true", "yes", "on"})
NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # function and response_format names, as OpenAI checks them
NAME_RE = re.compile(NAME)
JSON_OBJECT_SCHEMA = '{"type":"object"}'


class _Strict(BaseModel):
    """No coercion between JSON types; unknown keys are kept (and ignored)."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatRequest(_Strict):
    model: str | None = None
    messages: list[Any] = Field(min_length=1)  # checked by MESSAGES, kept as sent
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    tools: list[Any] | None = None  # checked by TOOLS, kept as sent
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: Any = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    functions: Any = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    user: str | None = None
    session_id: str | None = None


# -- messages and tools, as OpenAI types them ---------------------------------------------------

Content = str | list[Any]  # the parts are checked by normalize_messages (text only)


class ToolCallFunction(_Strict):
    name: str = Field(min_length=1)
    arguments: str


class ToolCall(_Strict):
    id: str = Field(min_length=1)
    type: Literal["function"]
    function: ToolCallFunction


class SystemMessage(_Strict):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None
    name: str | None = None


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


Message = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]
MESSAGES: TypeAdapter[list[Message]] = TypeAdapter(list[Message])
ROLES = ("system", "developer", "user", "assistant", "tool")


class FunctionDef(_Strict):
    name: str = Field(pattern=NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


TOOLS: TypeAdapter[list[Tool]] = TypeAdapter(list[Tool])


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


@dataclass(frozen=True, slots=True)
class ChatCall:
    """Everything the handler needs, validated once."""

    raw_messages: list[dict[str, Any]]  # as the client sent them (for the Turn)
    messages: list[dict[str, Any]]  # normalized for the chat template and pairing
    tools: list[dict[str, Any]] | None  # what the prompt renders (None with tool_choice none)
    tools_enabled: bool
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    turn_type: TurnType
    # X-Session-Id / session_id, else the agent's own (sessions.py): wins over an inherited
    # session, and scopes the pairing anchors
    session_hint: str | None
    user: str | None
    session_done: bool
    logprobs: bool = False  # return choices[].logprobs
    top_logprobs: int = 0  # per token, with logprobs
    n: int = 1  # choices sampled from the prompt (> 1: a group)
    api: Api = "chat"  # the API it came through: errors are said in its words
    dropped_tools: tuple[str, ...] = ()  # built-in tools left out of the prompt (their types)
    session_from: str | None = None  # where session_hint was read (a header's name, a field)


# -- schema errors in OpenAI's words --------------------------------------------------------------

_TYPE_NAMES = {
    "string_type": "a string", "int_type": "an integer", "float_type": "a number",
    "bool_type": "a boolean", "list_type": "an array", "dict_type": "an object",
    "model_type": "an object", "model_attributes_type": "an object",
}  # fmt: skip
# pydantic names union members and discriminator values in `loc`; they are not fields
_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|literal\[.*\]|function-.*|constrained-.*)$")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _path(loc: Sequence[Any]) -> str:
    out = ""
    prev: Any = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not (_TAG.match(str(part)) or (isinstance(prev, int) and out.startswith("messages")
                                             and part in ROLES)):  # fmt: skip
            out += f".{part}" if out else str(part)
        prev = part
    return out


def _depth(loc: Sequence[Any]) -> int:
    return _path(loc).count(".") + _path(loc).count("[")


def schema_error(exc: ValidationError, prefix: tuple[str | int, ...] = ()) -> ApiError:
    """The first problem pydantic found, said the way OpenAI says it."""
    errors: list[dict[str, Any]] = [{**e, "loc": (*prefix, *e.get("loc", ()))} for e in exc.errors()]
    first = errors[0]
    top = str(first["loc"][0]) if first["loc"] else None
    # Of a union's alternatives, the deepest error is the one about the shape that matched.
    same = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
    depth = max(_depth(e["loc"]) for e in same)
    deepest = [e for e in same if _depth(e["loc"]) == depth]
    err = deepest[0]
    where = _path(err["loc"])
    kind = str(err.get("type", ""))
    group = [e for e in deepest if _path(e["loc"]) == where]
    if all(str(e.get("type")) in _TYPE_NAMES for e in group):
        wanted = " or ".join(dict.fromkeys(_TYPE_NAMES[str(e["type"])] for e in group))
        got = _json_type(err.get("input"))
        return ApiError(400, f"Invalid type for '{where}': expected {wanted}, but got {got} instead.",
                        param=top, code="invalid_type")  # fmt: skip
    if kind in ("missing", "union_tag_not_found"):
        missing = where if kind == "missing" else f"{where}.role"
        return ApiError(400, f"Missing required parameter: '{missing}'.", param=top,
                        code="missing_required_parameter")  # fmt: skip
    if kind == "union_tag_invalid":
        tag = (err.get("ctx") or {}).get("tag")
        return ApiError(400, f"Invalid value for '{where}.role': {tag!r} is not one of "
                             f"{', '.join(ROLES)}.", param=top, code="invalid_value")  # fmt: skip
    if kind == "too_short" and err.get("ctx", {}).get("min_length") == 1:
        return ApiError(400, f"Invalid '{where}': empty array; send at least one item.",
                        param=top, code="invalid_value")  # fmt: skip
    msg = str(err.get("msg", "invalid")).rstrip(".")
    got = json.dumps(err.get("input"), ensure_ascii=False, default=str)
    got = got if len(got) <= 80 else got[:77] + "..."
    return ApiError(400, f"Invalid value for '{where}': {msg}, got {got}.", param=top,
                    code="invalid_value")  # fmt: skip


def parse_body(body: bytes) -> ChatRequest:
    """JSON and schema validation, each failure a 400 in OpenAI's shape."""
    if not body.strip():
        raise ApiError(400, "the request body is empty: send a JSON object")
    try:
        req = ChatRequest.model_validate_json(body)
    except ValidationError as exc:
        if any(e.get("type") == "json_invalid" for e in exc.errors()):
            raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
        if any(e.get("type") == "model_type" and not e.get("loc") for e in exc.errors()):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_type") from None
        raise schema_error(exc) from None
    check_integers(body)
    return req


# -- integers: 64 bits at most, anywhere in a body -----------------------------------------------

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# A 64-bit integer has at most 19 digits: a body without a run of 19 needs no second look.
# Found as a substring of the body with every digit mapped to "0" (C-speed: ~1 ns a byte).
_DIGITS_AS_ZERO = bytes(48 if 48 <= i <= 57 else 120 for i in range(256))
_LONG_RUN = b"0" * 19


def _too_wide(data: Any) -> tuple[list[str | int], int] | None:
    """The path to the first integer outside 64 bits in a JSON value, and the integer."""
    stack: list[tuple[list[str | int], Any]] = [([], data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT64_MIN <= value <= INT64_MAX:
                return path, value
        elif isinstance(value, dict):
            stack += [([*path, k], v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [([*path, i], v) for i, v in reversed(list(enumerate(value)))]
    return None


def check_integers(body: bytes, anthropic: bool = False) -> None:
    """Refuse (400) a body holding an integer JSON can carry but nothing after the edge
    can (orjson, Redis, the engines take 64 bits): `seed`, `max_tokens` and `top_k` as
    much as one nested in a tool's schema that a response echoes. Costs one pass over the
    bytes (~90 µs for Claude Code's 80 KB requests): only a body with a run of 19 digits is
    parsed again to look."""
    if _LONG_RUN not in body.translate(_DIGITS_AS_ZERO):
        return
    try:
        found = _too_wide(json.loads(body))
    except (ValueError, RecursionError):  # the validator already accepted it; nothing to add
        return
    if found is None:
        return
    path, value = found
    where = ".".join(map(str, path)) if anthropic else _path(path)
    shown = str(value) if len(str(value)) <= 40 else f"{str(value)[:20]}… ({len(str(value).lstrip('-'))} digits)"
    above = value > INT64_MAX
    bound = f"<= {INT64_MAX}" if above else f">= {INT64_MIN}"
    raise ApiError(400, f"Invalid '{where}': integer {'above' if above else 'below'} the 64-bit range. "
                        f"Expected a value {bound}, but got {shown} instead.",
                   param=str(path[0]) if path else None,
                   code="integer_above_max_value" if above else "integer_below_min_value")  # fmt: skip


# -- semantics beyond the schema ----------------------------------------------------------------


def _bad(message: str, param: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _check_messages(raw: list[Any]) -> None:
    """Types of every message, and tool results paired with the calls they answer."""
    try:
        messages = MESSAGES.validate_python(raw)
    except ValidationError as exc:
        raise schema_error(exc, ("messages",)) from None
    open_calls: dict[str, int] = {}  # call id -> index of the assistant message that made it
    for i, m in enumerate(messages):
        if isinstance(m, ToolMessage):
            if m.tool_call_id not in open_calls:
                if not open_calls:
                    raise _bad(f"Invalid 'messages[{i}]': a message with role 'tool' must answer a "
                               "tool call of the assistant message just before it (that message "
                               "has no unanswered tool_calls).", "messages")  # fmt: skip
                raise _bad(f"Invalid 'messages[{i}].tool_call_id': {m.tool_call_id!r} matches no "
                           f"tool call of messages[{next(iter(open_calls.values()))}] still "
                           f"unanswered ({', '.join(map(repr, open_calls))}).", "messages")  # fmt: skip
            del open_calls[m.tool_call_id]
            continue
        if open_calls:
            raise _bad(f"Invalid 'messages[{i}]': the tool calls of messages[{next(iter(open_calls.values()))}] "
                       f"must each be answered by a tool message first; no answer for "
                       f"{', '.join(map(repr, open_calls))}.", "messages")  # fmt: skip
        if isinstance(m, AssistantMessage):
            if m.content is None and not m.tool_calls and m.refusal is None:
                raise _bad(f"Missing required parameter: 'messages[{i}].content' (an assistant "
                           "message needs content or tool_calls).", "messages",
                           "missing_required_parameter")  # fmt: skip
            for j, call in enumerate(m.tool_calls or []):
                if call.id in open_calls:
                    raise _bad(f"Invalid 'messages[{i}].tool_calls[{j}].id': {call.id!r} is "
                               "used twice.", "messages")  # fmt: skip
                open_calls[call.id] = i
    if open_calls:
        raise _bad(f"Invalid 'messages': the tool calls of messages[{next(iter(open_calls.values()))}] "
                   f"have no tool message answering them ({', '.join(map(repr, open_calls))}); "
                   "send each result as {\"role\": \"tool\", \"tool_call_id\": …, \"content\": …}.",
                   "messages")  # fmt: skip


def _check_tools(req: ChatRequest) -> list[str]:
    """The function names `tools` offers (validated), checking tool_choice against them."""
    names: list[str] = []
    if req.tools is not None:
        if not req.tools:
            raise _bad("Invalid 'tools': empty array; send at least one tool or leave tools out.",
                       "tools")  # fmt: skip
        try:
            names = [t.function.name for t in TOOLS.validate_python(req.tools)]
        except ValidationError as exc:
            raise schema_error(exc, ("tools",)) from None
    choice = req.tool_choice
    if choice is not None and not names:
        raise _bad("Invalid value for 'tool_choice': tool_choice is only allowed when 'tools' "
                   "are specified.", "tool_choice")  # fmt: skip
    if req.parallel_tool_calls is not None and not names:
        raise _bad("Invalid value for 'parallel_tool_calls': parallel_tool_calls is only allowed "
                   "when 'tools' are specified.", "parallel_tool_calls")  # fmt: skip
    if choice is None or choice in ("none", "auto", "required"):
        return names
    if isinstance(choice, str):
        raise _bad(f"Invalid value for 'tool_choice': {choice!r} is not one of none, auto, "
                   "required, or {\"type\": \"function\", \"function\": {\"name\": …}}.",
                   "tool_choice")  # fmt: skip
    if not isinstance(choice, Mapping):
        raise _bad(f"Invalid type for 'tool_choice': expected a string or an object, but got "
                   f"{_json_type(choice)} instead.", "tool_choice", "invalid_type")  # fmt: skip
    if choice.get("type") != "function":
        raise _bad(f"Invalid value for 'tool_choice.type': {choice.get('type')!r}; expected "
                   "'function'.", "tool_choice")  # fmt: skip
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise _bad("Missing required parameter: 'tool_choice.function.name'.", "tool_choice",
                   "missing_required_parameter")  # fmt: skip
    if name not in names:
        raise _bad(f"Invalid value for 'tool_choice': no function named {name!r} in tools "
                   f"(tools has {', '.join(map(repr, names))}).", "tool_choice")  # fmt: skip
    return names


def _tools_enabled(choice: Any) -> bool:
    return not (isinstance(choice, str) and choice == "none")


def _response_format(rf: Any) -> str | None:
    """The JSON Schema the answer must follow (serialized), or None for plain text."""
    if rf is None:
        return None
    if not isinstance(rf, Mapping):
        raise _bad(f"Invalid type for 'response_format': expected an object, but got "
                   f"{_json_type(rf)} instead.", "response_format", "invalid_type")  # fmt: skip
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if spec is None:
            raise _bad("Missing required parameter: 'response_format.json_schema'.",
                       "response_format", "missing_required_parameter")  # fmt: skip
        try:
            fmt = JsonSchemaFormat.model_validate(spec)
        except ValidationError as exc:
            raise schema_error(exc, ("response_format", "json_schema")) from None
        return json.dumps(fmt.schema_ if fmt.schema_ is not None else {}, ensure_ascii=False,
                          separators=(",", ":"))  # fmt: skip
    if kind is None:
        raise _bad("Missing required parameter: 'response_format.type'.", "response_format",
                   "missing_required_parameter")  # fmt: skip
    raise _bad(f"Invalid value for 'response_format.type': {kind!r} is not supported; use "
               "'text', 'json_object' or 'json_schema'.", "response_format",
               "unsupported_value")  # fmt: skip


def _refuse_ignored(req: ChatRequest) -> None:
    """Fields whose effect this server cannot give: a 400 rather than a silent no-op."""
    if req.logit_bias:
        raise _bad("logit_bias is not supported by this server; leave it out.", "logit_bias",
                   "unsupported_value")  # fmt: skip
    for name in ("functions", "function_call"):
        if getattr(req, name) is not None:
            raise _bad(f"'{name}' (deprecated) is not supported: send 'tools' and 'tool_choice'.",
                       name, "unsupported_value")  # fmt: skip
    if req.audio is not None or (req.modalities and set(req.modalities) != {"text"}):
        raise _bad("only text output is supported: leave out audio and modalities other than "
                   "['text'].", "audio" if req.audio is not None else "modalities",
                   "unsupported_value")  # fmt: skip


def _stop(stop: str | list[str] | None) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP:
        raise _bad(f"stop has {len(stops)} strings; at most {MAX_STOP}", "stop")
    if any(not s for s in stops):
        raise _bad("stop strings must not be empty", "stop")
    return stops or None


def _turn_type(value: str | None, default: TurnType) -> TurnType:
    if value is None or not value.strip():
        return default
    v = value.strip().lower()
    if v == "main" or v == "side":
        return v  # type: ignore[return-value]
    raise _bad(f"X-Turn-Type is {value!r}: main or side", "X-Turn-Type")


def build_call(req: ChatRequest, headers: Mapping[str, str], cfg: CollectorConfig) -> ChatCall:
    """Validate semantics beyond the schema and resolve defaults from the configuration."""
    n = 1 if req.n is None else req.n
    if n > cfg.max_n:
        raise _bad(f"Invalid value for 'n': {n}; this server samples at most {cfg.max_n} choices "
                   "per request.", "n")  # fmt: skip
    if n > 1 and req.stream:
        raise _bad(f"n={n} is not supported with stream: true; send stream: false to get the "
                   f"{n} choices in one response, or {n} streamed requests.", "n",
                   "unsupported_value")  # fmt: skip
    _check_messages(req.messages)
    _check_tools(req)
    _refuse_ignored(req)
    if req.top_k is not None and req.top_k != -1 and req.top_k < 1:
        raise _bad(f"Invalid value for 'top_k': {req.top_k}; -1 (off) or at least 1.", "top_k")
    if req.top_logprobs is not None and not req.logprobs:
        raise _bad("Invalid value for 'top_logprobs': it needs 'logprobs': true.", "top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise _bad("Invalid value for 'stream_options': stream_options is only allowed when "
                   "'stream' is true.", "stream_options")  # fmt: skip
    call = make_call(
        req.messages, req.tools, tools_enabled=_tools_enabled(req.tool_choice), headers=headers,
        cfg=cfg, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        max_tokens=req.max_completion_tokens or req.max_tokens, stop=_stop(req.stop), seed=req.seed,
        json_schema=_response_format(req.response_format), stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        user=req.user, session_id=req.session_id, logprobs=bool(req.logprobs),
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
    )  # fmt: skip
    return call if n == 1 else replace(call, n=n)


def make_call(
    raw_messages: list[Any], raw_tools: list[Any] | None, *, tools_enabled: bool,
    headers: Mapping[str, str], cfg: CollectorConfig, temperature: float | None = None,
    top_p: float | None = None, top_k: int | None = None, max_tokens: int | None = None,
    stop: list[str] | None = None, seed: int | None = None, json_schema: str | None = None,
    stream: bool = False, include_usage: bool = False, user: str | None = None,
    session_id: str | None = None, logprobs: bool = False, top_logprobs: int = 0,
    messages_param: str = "messages", tools_param: str = "tools", api: Api = "chat",
    dropped_tools: tuple[str, ...] = (), embedded_session: str | None = None,
) -> ChatCall:  # fmt: skip
    """The internal conversation (chat messages and tools, checked by the caller) and the
    sampling and session fields, with the configuration's defaults: one `ChatCall`, whichever
    API the request came through (chat completions, responses, messages). The session is
    `X-Session-Id`, else `session_id`, else the agent's own (`embedded_session`: the one
    in Anthropic's `metadata.user_id`; sessions.py)."""
    try:
        messages = normalize_messages(raw_messages)
    except ChatTemplateError as exc:
        raise _bad(str(exc), messages_param) from None
    try:
        tools = normalize_tools(raw_tools)
    except ChatTemplateError as exc:
        raise _bad(str(exc), tools_param) from None
    enabled = tools_enabled and tools is not None
    sampling = SamplingParams(
        temperature=cfg.default_temperature if temperature is None else temperature,
        top_p=cfg.default_top_p if top_p is None else top_p,
        top_k=cfg.default_top_k if top_k is None else top_k,
        max_tokens=max_tokens or cfg.default_max_tokens,
        stop=stop,
        seed=seed,
        json_schema=json_schema,
    )
    header = headers.get("x-session-id")
    hint, source = (header, "x-session-id") if header and header.strip() else (session_id, "session_id")
    for name, value in (("session_id", hint), ("user", user)):
        if value is not None and len(value) > MAX_ID:
            raise _bad(f"{name} is longer than {MAX_ID} characters", name)
    hint = hint.strip() or None if hint else None
    if hint is None and (agent := agent_session(headers, embedded_session)) is not None:
        hint, source = agent.id, agent.source
    return ChatCall(
        raw_messages=raw_messages,
        messages=messages,
        tools=tools if enabled else None,
        tools_enabled=enabled,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        turn_type=_turn_type(headers.get("x-turn-type"), cfg.default_turn_type),
        session_hint=hint,
        user=user or None,
        session_done=headers.get("x-session-done", "").strip().lower() in TRUE,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        api=api,
        dropped_tools=dropped_tools,
        session_from=source if hint is not None else None,
    )
