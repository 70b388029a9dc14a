"""A `/v1/responses` body -> the internal conversation (chat messages and tools) -> one `ChatCall`.

The Responses API is turned into the conversation a Chat Completions client would send
for the same exchange, so that the policy's chat template renders the same prompt ids
and the same `Turn` is captured, whichever API the agent speaks:

- `instructions` -> a leading system message (not carried over by `previous_response_id`,
  as at OpenAI: the follow-up's own instructions apply);
- `input` as a string -> one user message; as items:
  - a message (`type: "message"` or a bare `{role, content}`) -> that message; content
    parts `input_text` / `output_text` / `refusal` are text, joined by "\\n" as chat content
    parts are; images, files and audio are refused (the models served read text only);
  - consecutive assistant-side items form one assistant message: `function_call` ->
    a tool call (`call_id` is its id), an assistant message -> its content, `reasoning`
    -> its `reasoning_content` (reasoning text, else the summary);
  - `function_call_output` -> a tool message answering `call_id` (text parts joined);
- `previous_response_id` -> the stored conversation of that response (response_store.py),
  then this request's input;
- function `tools` ({type, name, description, parameters, strict}) -> chat tools in chat's
  key order (the order a template's `tojson` writes them); a `namespace` tool (the Codex
  CLI's `multi_agent_v1`) -> the function tools it holds, each named `namespace.name`
  (a function name cannot hold a dot, so the flat name is unambiguous); a tool call of
  such a name goes back as a `function_call` with `name` and `namespace`, and comes back
  (a `function_call` item with a `namespace`) as the same flat name, so the captured
  turn and its follow-up agree; built-in tools (web search, file search, computer use,
  code interpreter, …) are left out of the prompt or refused (builtin_tools.py);
- `tool_choice` none / auto / required / {type: function, name[, namespace]} (one forcing a
  built-in tool is a 400); `text.format` text /
  json_object / json_schema -> constrained decoding, as chat's `response_format`;
  `max_output_tokens`, `temperature`, `top_p` (and the extensions `top_k`, `seed`).

Every function call must be answered by a `function_call_output` before the conversation
goes on, and every output must answer a call ("No tool output found for function call
…" otherwise, as OpenAI says it). `include: ["message.output_text.logprobs"]` returns
the log-probs of the text's tokens (text_logprobs.py), with `top_logprobs` (0–20)
alternatives each; `top_logprobs` > 0 without that include is refused, as chat refuses
`top_logprobs` without `logprobs`. Accepted and ignored: `parallel_tool_calls`,
`reasoning`, other `include` values, `metadata`, `truncation`, `service_tier`,
`prompt_cache_key`, `safety_identifier`, `stream_options`, `text.verbosity`. Refused,
because they would be ignored: `background`, `conversation`, `prompt`, `max_tool_calls`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError

from services.collector.builtin_tools import RESPONSES_BUILTINS, Dropped
from services.collector.openai_shapes import ApiError
from services.collector.request import (
    JSON_OBJECT_SCHEMA,
    NAME_RE,
    ChatCall,
    _Strict,
    check_integers,
    make_call,
    schema_error,
)
from services.collector.settings import CollectorConfig
from shared.chat_messages import PART_SEPARATOR

INPUT_TEXT = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"  # the `include` asking for output_text.logprobs
ROLES = ("user", "system", "developer", "assistant")


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    seed: int | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tool_calls: int | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class ResponsesCall:
    req: ResponsesRequest
    call: ChatCall
    history: list[dict[str, Any]]  # the conversation without the instructions (kept by `store`)


def _bad(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def parse_responses(body: bytes) -> ResponsesRequest:
    if not body.strip():
        raise _bad("the request body is empty: send a JSON object", None)
    try:
        req = ResponsesRequest.model_validate_json(body)
    except ValidationError as exc:
        if any(e.get("type") == "json_invalid" for e in exc.errors()):
            raise _bad("the request body is not valid JSON", None, "invalid_json") from None
        if any(e.get("type") == "model_type" and not e.get("loc") for e in exc.errors()):
            raise _bad("the request body must be a JSON object", None, "invalid_type") from None
        raise schema_error(exc) from None
    check_integers(body)
    return req


# -- input items -> chat messages ---------------------------------------------------------


def _text(value: Any, where: str, kinds: tuple[str, ...] = INPUT_TEXT) -> str:
    """A string, or a list of text parts joined as chat content parts are."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(f"Invalid type for '{where}': expected a string or an array of content parts.",
                   "input", "invalid_type")  # fmt: skip
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, Mapping) else None
        key = "refusal" if kind == "refusal" else "text" if kind in kinds else None
        if key is None:
            raise _bad(f"Invalid '{where}[{j}]': content of type {kind!r} is not supported; this "
                       "model reads text only (input_text / output_text).", "input",
                       "unsupported_value")  # fmt: skip
        text = part.get(key)
        if not isinstance(text, str):
            raise _bad(f"Invalid type for '{where}[{j}].{key}': expected a string.", "input", "invalid_type")
        texts.append(text)
    return PART_SEPARATOR.join(texts)


def _str_field(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if value is None:
        raise _bad(f"Missing required parameter: '{where}.{key}'.", "input", "missing_required_parameter")
    if not isinstance(value, str):
        raise _bad(f"Invalid type for '{where}.{key}': expected a string.", "input", "invalid_type")
    return value


class Conversation:
    """Builds chat messages from Responses input items, after an optional stored history."""

    def __init__(self, prior: list[dict[str, Any]] | None = None) -> None:
        self.messages: list[dict[str, Any]] = list(prior or [])
        self.open: dict[str, str] = _open_calls(self.messages)  # call id -> where it was made
        self.turn: dict[str, Any] | None = None  # the assistant message being assembled
        self.reasoning: str | None = None

    def add(self, i: int, item: Any) -> None:
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise _bad(f"Invalid type for '{where}': expected an object.", "input", "invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(where, item)
        elif kind == "function_call":
            self._function_call(where, item)
        elif kind == "function_call_output":
            self._output(where, item)
        elif kind == "reasoning":
            self._reasoning(where, item)
        elif kind == "item_reference":
            raise _bad(f"Invalid '{where}': item references are not supported here; send the "
                       "item itself, or continue with previous_response_id.", "input",
                       "unsupported_value")  # fmt: skip
        elif kind is None:
            raise _bad(f"Missing required parameter: '{where}.type'.", "input", "missing_required_parameter")
        else:
            raise _bad(f"Invalid '{where}': items of type {kind!r} are not supported; this server "
                       "runs no built-in tools (send messages, function_call, function_call_output "
                       "and reasoning items).", "input", "unsupported_value")  # fmt: skip

    def finish(self) -> list[dict[str, Any]]:
        if self.open:
            raise _bad(f"No tool output found for function call {next(iter(self.open))}.", "input")
        if not self.messages:
            raise _bad("Invalid 'input': empty; send at least one item.", "input")
        return self.messages

    def _need_answers(self, where: str) -> None:
        if self.open:
            raise _bad(f"No tool output found for function call {next(iter(self.open))} (before "
                       f"'{where}'): answer each function call with a function_call_output "
                       "first.", "input")  # fmt: skip

    def _assistant(self) -> dict[str, Any]:
        if self.turn is None:
            self.turn = {"role": "assistant", "content": None}
            if self.reasoning is not None:
                self.turn["reasoning_content"] = self.reasoning
                self.reasoning = None
            self.messages.append(self.turn)
        return self.turn

    def _message(self, where: str, item: Mapping[str, Any]) -> None:
        role = item.get("role")
        if role not in ROLES:
            raise _bad(f"Invalid value for '{where}.role': {role!r} is not one of "
                       f"{', '.join(ROLES)}.", "input")  # fmt: skip
        if "content" not in item:
            raise _bad(f"Missing required parameter: '{where}.content'.", "input", "missing_required_parameter")
        text = _text(item["content"], f"{where}.content")
        if role == "assistant":
            turn = self.turn
            if turn is not None and turn["content"] is None:  # after its own function calls
                turn["content"] = text
                return
            self._need_answers(where)
            self.turn = None
            self._assistant()["content"] = text
            return
        self._need_answers(where)
        self.turn = None
        self.messages.append({"role": role, "content": text})

    def _function_call(self, where: str, item: Mapping[str, Any]) -> None:
        call_id = _str_field(item, "call_id", where)
        name = flat_name(_str_field(item, "name", where), item.get("namespace"))
        args = _str_field(item, "arguments", where)
        if self.turn is None:
            self._need_answers(where)
        if call_id in self.open:
            raise _bad(f"Invalid '{where}.call_id': {call_id!r} is used twice.", "input")
        turn = self._assistant()
        turn.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        self.open[call_id] = where

    def _output(self, where: str, item: Mapping[str, Any]) -> None:
        call_id = _str_field(item, "call_id", where)
        if call_id not in self.open:
            raise _bad(f"Invalid '{where}.call_id': no function_call with call_id {call_id!r} "
                       "waits for an output here.", "input")  # fmt: skip
        if "output" not in item:
            raise _bad(f"Missing required parameter: '{where}.output'.", "input", "missing_required_parameter")
        del self.open[call_id]
        self.turn = None
        self.messages.append({"role": "tool", "tool_call_id": call_id,
                              "content": _text(item["output"], f"{where}.output")})  # fmt: skip

    def _reasoning(self, where: str, item: Mapping[str, Any]) -> None:
        parts = item.get("content") or item.get("summary") or []
        kinds = ("reasoning_text", "summary_text", "text")
        text = _text(parts, f"{where}.content" if item.get("content") else f"{where}.summary", kinds)
        if self.turn is None:  # for the assistant message that follows
            self.reasoning = text if self.reasoning is None else self.reasoning + PART_SEPARATOR + text
            return
        held = self.turn.get("reasoning_content")
        self.turn["reasoning_content"] = text if held is None else held + PART_SEPARATOR + text


def _open_calls(messages: list[dict[str, Any]]) -> dict[str, str]:
    """The calls of a history's last assistant message that no tool message answers yet."""
    for k in range(len(messages) - 1, -1, -1):
        if messages[k].get("role") == "assistant":
            calls = {c["id"]: "previous_response_id" for c in messages[k].get("tool_calls") or []}
            for m in messages[k + 1 :]:
                calls.pop(m.get("tool_call_id", ""), None)
            return calls
    return {}


def input_messages(req: ResponsesRequest, prior: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation (without instructions): the stored history, then the input."""
    conv = Conversation(prior)
    if req.input is None:
        if prior is None:
            raise _bad("Missing required parameter: 'input'.", "input", "missing_required_parameter")
    elif isinstance(req.input, str):
        conv.add(0, {"role": "user", "content": req.input})
    else:
        for i, item in enumerate(req.input):
            conv.add(i, item)
    return conv.finish()


# -- tools ----------------------------------------------------------------------------------


def flat_name(name: str, namespace: Any = None) -> str:
    """The chat tool name of a function (of a namespace): `namespace.name`. A function
    name cannot hold a dot (1-64 letters, digits, _ or -), so the flat name is unambiguous."""
    return f"{namespace}.{name}" if isinstance(namespace, str) and namespace else name


def split_name(flat: str) -> tuple[str, str | None]:
    """A chat tool call's name as a Responses function call's (name, namespace)."""
    namespace, dot, name = flat.partition(".")
    return (name, namespace) if dot and name and namespace else (flat, None)


def _function(tool: Mapping[str, Any], where: str, namespace: str | None = None) -> dict[str, Any]:
    name = tool.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise _bad(f"Invalid '{where}.name': {name!r}; a function name is 1-64 letters, "
                   "digits, _ or -.", "tools")  # fmt: skip
    fn: dict[str, Any] = {"name": flat_name(name, namespace)}
    for key, types in (("description", str), ("parameters", dict), ("strict", bool)):
        value = tool.get(key)
        if value is None:
            continue
        if not isinstance(value, types):
            raise _bad(f"Invalid type for '{where}.{key}'.", "tools", "invalid_type")
        fn[key] = value
    return {"type": "function", "function": fn}


def _kind(tool: Any, where: str) -> str:
    if not isinstance(tool, Mapping):
        raise _bad(f"Invalid type for '{where}': expected an object.", "tools", "invalid_type")
    kind = tool.get("type")
    if not isinstance(kind, str):
        missing = kind is None
        raise _bad(f"Missing required parameter: '{where}.type'." if missing else
                   f"Invalid type for '{where}.type': expected a string, but got "
                   f"{type(kind).__name__} instead.", "tools",
                   "missing_required_parameter" if missing else "invalid_type")  # fmt: skip
    return kind


def _builtin(kind: str, where: str, dropped: Dropped) -> None:
    dropped.offer(kind, kind, _bad(
        f"Invalid '{where}': the built-in tool {kind!r} cannot run on this server (it serves a "
        "model, not OpenAI's tools); define it as a function tool and run it in your agent, or "
        "let this server leave it out (NEXTSTATE_COLLECTOR__UNSUPPORTED_TOOLS=drop).", "tools",
        "unsupported_value"))  # fmt: skip


def _namespace(tool: Mapping[str, Any], where: str, dropped: Dropped) -> list[dict[str, Any]]:
    """A namespace's function tools, named `namespace.function`."""
    ns = tool.get("name")
    if not isinstance(ns, str) or not NAME_RE.match(ns):
        raise _bad(f"Invalid '{where}.name': {ns!r}; a namespace name is 1-64 letters, digits, _ "
                   "or -.", "tools")  # fmt: skip
    inner = tool.get("tools")
    if not isinstance(inner, list):
        raise _bad(f"Invalid type for '{where}.tools': expected an array of tools.", "tools", "invalid_type")
    out = []
    for j, member in enumerate(inner):
        here = f"{where}.tools[{j}]"
        kind = _kind(member, here)
        if kind == "function":
            out.append(_function(member, here, ns))
        elif kind == "custom":
            _builtin(kind, here, dropped)
        else:
            raise _bad(f"Invalid value for '{here}.type': {kind!r}; a namespace holds 'function' "
                       "and 'custom' tools.", "tools")  # fmt: skip
    return out


def chat_tools(tools: list[Any] | None, dropped: Dropped) -> tuple[list[dict[str, Any]] | None, list[str]]:
    """Function tools as chat tools (chat's key order), a namespace's as its functions
    (`namespace.function`), and their names; built-in tools to `dropped`."""
    if tools is None:
        return None, []
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = _kind(tool, where)
        if kind == "function":
            out.append(_function(tool, where))
        elif kind == "namespace":
            out += _namespace(tool, where, dropped)
        elif kind in RESPONSES_BUILTINS:
            _builtin(kind, where, dropped)
        else:
            raise _bad(f"Invalid value for '{where}.type': {kind!r}; expected 'function' or "
                       "'namespace' (or a built-in tool type).", "tools")  # fmt: skip
    return out or None, [t["function"]["name"] for t in out]


def _tools_enabled(choice: Any, names: list[str]) -> bool:
    if choice is None or choice == "auto":
        return True
    if choice == "none":
        return False
    if choice == "required":
        if not names:
            raise _bad("Invalid value for 'tool_choice': 'required' needs 'tools' (function tools: "
                       "built-in ones cannot run here).", "tool_choice")  # fmt: skip
        return True
    if isinstance(choice, Mapping):
        kind = choice.get("type")
        if kind == "function":
            name = choice.get("name")
            if isinstance(name, str):
                name = flat_name(name, choice.get("namespace"))
            if name not in names:
                raise _bad(f"Invalid value for 'tool_choice': no function named {name!r} in tools.",
                           "tool_choice")  # fmt: skip
            return True
        if isinstance(kind, str) and kind in RESPONSES_BUILTINS:
            raise _bad(f"Invalid value for 'tool_choice': it forces the built-in tool {kind!r}, which "
                       "this server cannot run (it serves a model, not OpenAI's tools); use auto, "
                       "required or a function tool.", "tool_choice", "unsupported_value")  # fmt: skip
        raise _bad(f"Invalid value for 'tool_choice.type': {kind!r} is not supported here; use "
                   "none, auto, required or {\"type\": \"function\", \"name\": …}.", "tool_choice",
                   "unsupported_value")  # fmt: skip
    raise _bad(f"Invalid value for 'tool_choice': {choice!r}; use none, auto, required or "
               "{\"type\": \"function\", \"name\": …}.", "tool_choice")  # fmt: skip


def text_format(text: Mapping[str, Any] | None) -> str | None:
    """`text.format` as the JSON Schema the engine enforces, or None for plain text."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise _bad("Missing required parameter: 'text.format.schema'.", "text",
                       "missing_required_parameter")  # fmt: skip
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    raise _bad(f"Invalid value for 'text.format.type': {kind!r}; use text, json_object or "
               "json_schema.", "text", "unsupported_value")  # fmt: skip


def _refuse(req: ResponsesRequest) -> None:
    for name, what in (("background", "background responses"), ("conversation", "conversations"),
                       ("prompt", "prompt templates"), ("max_tool_calls", "max_tool_calls")):  # fmt: skip
        value = getattr(req, name)
        if value is not None and value is not False:
            raise _bad(f"{what} are not supported by this server; leave '{name}' out"
                       + (" and continue with previous_response_id." if name == "conversation" else "."),
                       name, "unsupported_value")  # fmt: skip
    if req.top_logprobs and LOGPROBS not in (req.include or ()):
        raise _bad(f"Invalid value for 'top_logprobs': it needs 'include': ['{LOGPROBS}'].",
                   "top_logprobs")  # fmt: skip


def build_responses_call(
    req: ResponsesRequest, prior: list[dict[str, Any]] | None, headers: Mapping[str, str],
    cfg: CollectorConfig,
) -> ResponsesCall:  # fmt: skip
    _refuse(req)
    if req.top_k is not None and req.top_k != -1 and req.top_k < 1:
        raise _bad(f"Invalid value for 'top_k': {req.top_k}; -1 (off) or at least 1.", "top_k")
    if req.previous_response_id is not None and prior is None:
        raise AssertionError("the caller looks previous_response_id up first")
    history = input_messages(req, prior)
    dropped = Dropped("responses", cfg.unsupported_tools)
    tools, names = chat_tools(req.tools, dropped)
    enabled = _tools_enabled(req.tool_choice, names)
    messages = history if req.instructions is None else [
        {"role": "system", "content": req.instructions}, *history]  # fmt: skip
    logprobs = LOGPROBS in (req.include or ())
    call = make_call(
        messages, tools, tools_enabled=enabled, headers=headers, cfg=cfg,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
        max_tokens=req.max_output_tokens, seed=req.seed, json_schema=text_format(req.text),
        stream=bool(req.stream), user=req.user or req.safety_identifier,
        session_id=req.session_id, messages_param="input", logprobs=logprobs, api="responses",
        top_logprobs=(req.top_logprobs or 0) if logprobs else 0, dropped_tools=dropped.header(),
    )  # fmt: skip
    return ResponsesCall(req, call, history)
