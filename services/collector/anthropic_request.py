"""A `/v1/messages` body (Anthropic's Messages API) -> the internal conversation -> one `ChatCall`.

The conversation a Chat Completions client would send for the same exchange, so the
chat template renders the same prompt ids and the same `Turn` is captured:

- `system` (a string or text blocks) -> a leading system message;
- a `system` entry inside `messages` (Claude Code sends its environment block so: a text
  block list with `cache_control` while it is the newest entry, a plain string after)
  -> a system message in its place, its text blocks joined: the same message either
  way, so a follow-up continues the captured turn. Where the chat template writes no
  system message after the first, it renders as a user message (shared/chat.py);
- a user message: its `tool_result` blocks -> one tool message each (answering
  `tool_use_id`; content a string or text blocks; `is_error` kept on the tool message
  as a flag the judge sees in the next state), then its text blocks -> one user
  message (blocks joined by "\\n", as chat content parts are);
- an assistant message: text blocks -> its content, `tool_use` blocks -> tool calls
  (`input` as JSON arguments), `thinking` -> its `reasoning_content`;
- `tools` ({name, description, input_schema}) -> chat function tools; Anthropic's
  server and schema-less tools (web search, web fetch, bash, text editor, computer use,
  code execution, …) are left out of the prompt or refused (builtin_tools.py);
- `tool_choice` auto / any (chat's "required") / tool (a named function; naming one of
  those tools is a 400) / none;
  `max_tokens` (required), `stop_sequences`, `temperature`, `top_p`, `top_k`;
  `metadata.user_id` is the `user` — Claude Code's (a JSON string with its device,
  account and session) gives its account or device as the user and its session id
  (sessions.py).

Refused with a 400 in Anthropic's error shape: images and documents (the models served
read text only), a conversation ending on an assistant message (a prefill to continue:
the chat template closes that message instead), tool results that answer no `tool_use`
of the message before, `tool_use` blocks without results in the next message, and
`container` / `mcp_servers`. `thinking` is accepted and ignored: whether the model thinks
is its chat template's matter.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import Field, ValidationError

from services.collector.builtin_tools import Dropped, anthropic_family
from services.collector.openai_shapes import ApiError
from services.collector.request import (
    NAME_RE,
    ChatCall,
    _stop,
    _Strict,
    check_integers,
    make_call,
    schema_error,
)
from services.collector.sessions import claude_user
from services.collector.settings import CollectorConfig
from shared.chat_messages import PART_SEPARATOR


class CountTokensRequest(_Strict):
    """`/v1/messages/count_tokens`: the conversation of a message request, no sampling."""

    model: str = Field(min_length=1)
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    mcp_servers: Any = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = None
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class MessagesCall:
    req: MessagesRequest
    call: ChatCall


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def parse_messages(body: bytes) -> MessagesRequest:
    return _parse(MessagesRequest, body)


def parse_count_tokens(body: bytes) -> CountTokensRequest:
    return _parse(CountTokensRequest, body)


R = TypeVar("R", bound=CountTokensRequest)


def _parse(model: type[R], body: bytes) -> R:
    if not body.strip():
        raise _bad("the request body is empty: send a JSON object")
    try:
        req = model.model_validate_json(body)
    except ValidationError as exc:
        if any(e.get("type") == "json_invalid" for e in exc.errors()):
            raise _bad("the request body is not valid JSON") from None
        if any(e.get("type") == "model_type" and not e.get("loc") for e in exc.errors()):
            raise _bad("the request body must be a JSON object") from None
        raise schema_error(exc) from None
    check_integers(body, anthropic=True)
    return req


def _blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}: expected a string or a list of content blocks")
    for j, block in enumerate(content):
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise _bad(f"{where}.{j}: expected a content block with a type")
    return content


def _text_of(block: Mapping[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}.text: expected a string")
    return text


def _refuse_block(kind: str, where: str) -> ApiError:
    if kind in ("image", "document", "search_result", "container_upload"):
        return _bad(f"{where}: {kind} blocks are not supported; this model reads text only")
    return _bad(f"{where}: content blocks of type {kind!r} are not supported here")


def _texts(blocks: list[Mapping[str, Any]], where: str) -> str:
    """Text blocks joined as chat content parts are (their `cache_control` is the client's
    caching hint, not content); any other block is refused."""
    for j, b in enumerate(blocks):
        if b["type"] != "text":
            raise _refuse_block(b["type"], f"{where}.{j}")
    return PART_SEPARATOR.join(_text_of(b, f"{where}.{j}") for j, b in enumerate(blocks))


def _system(system: str | list[Any] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return _texts(_blocks(system, "system"), "system")


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{where}.tool_use_id: expected a string")
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    else:
        parts = []
        for j, b in enumerate(_blocks(content, f"{where}.content")):
            if b["type"] != "text":
                raise _refuse_block(b["type"], f"{where}.content.{j}")
            parts.append(_text_of(b, f"{where}.content.{j}"))
        text = PART_SEPARATOR.join(parts)
    out: dict[str, Any] = {"role": "tool", "tool_call_id": call_id, "content": text}
    if block.get("is_error") is True:
        out["is_error"] = True
    return out


def _user(blocks: list[Mapping[str, Any]], where: str, open_calls: set[str]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        here = f"{where}.content.{j}"
        if b["type"] == "text":
            texts.append(_text_of(b, here))
        elif b["type"] == "tool_result":
            result = _tool_result(b, here)
            if result["tool_call_id"] not in open_calls:
                raise _bad(f"{here}: unexpected tool_use_id found in tool_result blocks: "
                           f"{result['tool_call_id']}. Each tool_result block must have a "
                           "corresponding tool_use block in the previous message.")  # fmt: skip
            open_calls.discard(result["tool_call_id"])
            results.append(result)
        else:
            raise _refuse_block(b["type"], here)
    if open_calls:
        raise _bad(f"{where}: tool_use ids were found without tool_result blocks immediately "
                   f"after: {', '.join(sorted(open_calls))}. Each tool_use block must have a "
                   "corresponding tool_result block in the next message.")  # fmt: skip
    if texts or not results:
        results.append({"role": "user", "content": PART_SEPARATOR.join(texts)})
    return results


def _assistant(blocks: list[Mapping[str, Any]], where: str) -> dict[str, Any]:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        here = f"{where}.content.{j}"
        kind = b["type"]
        if kind == "text":
            texts.append(_text_of(b, here))
        elif kind == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise _bad(f"{here}.thinking: expected a string")
            thinking.append(b["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            call_id, name, args = b.get("id"), b.get("name"), b.get("input")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
                raise _bad(f"{here}: a tool_use block needs a string id and name")
            if not isinstance(args, Mapping):
                raise _bad(f"{here}.input: expected an object")
            calls.append({"id": call_id, "type": "function", "function": {
                "name": name, "arguments": json.dumps(args, ensure_ascii=False)}})  # fmt: skip
        else:
            raise _refuse_block(kind, here)
    msg: dict[str, Any] = {"role": "assistant", "content": PART_SEPARATOR.join(texts) if texts else None}
    if thinking:
        msg["reasoning_content"] = PART_SEPARATOR.join(thinking)
    if calls:
        msg["tool_calls"] = calls
    elif msg["content"] is None:
        msg["content"] = ""
    return msg


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = _system(req.system)
    if system is not None:
        out.append({"role": "system", "content": system})
    open_calls: set[str] = set()
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        if not isinstance(m, Mapping):
            raise _bad(f"{where}: expected an object with role and content")
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise _bad(f"{where}.role: {role!r}; expected 'user', 'assistant' or 'system'")
        if "content" not in m:
            raise _bad(f"{where}.content: Field required")
        blocks = _blocks(m["content"], f"{where}.content")
        if role == "system":  # context the harness adds at this point (Claude Code's environment)
            if open_calls:
                raise _bad(f"{where}: tool_use ids were found without tool_result blocks immediately "
                           f"after: {', '.join(sorted(open_calls))}.")  # fmt: skip
            out.append({"role": "system", "content": _texts(blocks, f"{where}.content")})
            continue
        if role == "user":
            out += _user(blocks, where, open_calls)
            continue
        if open_calls:
            raise _bad(f"{where}: tool_use ids were found without tool_result blocks immediately "
                       f"after: {', '.join(sorted(open_calls))}.")  # fmt: skip
        msg = _assistant(blocks, where)
        open_calls = {c["id"] for c in msg.get("tool_calls", ())}
        out.append(msg)
    if out[-1]["role"] == "assistant":
        raise _bad("messages: the last message is from the assistant; continuing it (a prefill) "
                   "is not supported here: end with a user message")  # fmt: skip
    return out


def chat_tools(tools: list[Any] | None, dropped: Dropped) -> list[dict[str, Any]] | None:
    """Custom tools as chat function tools; Anthropic's built-in ones to `dropped`."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, Mapping):
            raise _bad(f"{where}: expected an object", "tools")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            family = anthropic_family(kind) if isinstance(kind, str) else None
            if family is None:
                raise _bad(f"{where}.type: {kind!r} is not a tool type this server knows; send a "
                           "custom tool (name, description, input_schema)", "tools")  # fmt: skip
            dropped.offer(kind, family, _bad(
                f"{where}: the server tool {kind!r} cannot run here (this server serves a model, "
                "not Anthropic's tools); define it as a custom tool with an input_schema and run it "
                "in your agent, or let this server leave it out "
                "(NEXTSTATE_COLLECTOR__UNSUPPORTED_TOOLS=drop)", "tools"))  # fmt: skip
            continue
        name = tool.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise _bad(f"{where}.name: {name!r}; a tool name is 1-64 letters, digits, _ or -", "tools")
        schema = tool.get("input_schema")
        if not isinstance(schema, Mapping):
            raise _bad(f"{where}.input_schema: Field required (an object)", "tools")
        fn: dict[str, Any] = {"name": name}
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise _bad(f"{where}.description: expected a string", "tools")
            fn["description"] = tool["description"]
        fn["parameters"] = dict(schema)
        out.append({"type": "function", "function": fn})
    return out or None


def _builtin_names(tools: list[Any] | None) -> list[str]:
    """The names of the built-in tools a request offers (what a tool_choice would name)."""
    return [t["name"] for t in tools or () if isinstance(t, Mapping) and t.get("type") not in (None, "custom")
            and isinstance(t.get("name"), str)]  # fmt: skip


def _tools_enabled(choice: Mapping[str, Any] | None, tools: list[dict[str, Any]] | None,
                   builtins: list[str]) -> bool:  # fmt: skip
    if choice is None:
        return True
    kind = choice.get("type")
    if kind == "none":
        return False
    name = choice.get("name")
    if kind == "tool" and name in builtins:
        raise _bad(f"tool_choice.name: it forces the server tool {name!r}, which cannot run here "
                   "(this server serves a model, not Anthropic's tools); use auto, any or a custom "
                   "tool", "tool_choice")  # fmt: skip
    if tools is None:
        raise _bad("tool_choice: it needs tools (custom tools: server tools cannot run here)", "tool_choice")
    if kind in ("auto", "any"):
        return True
    if kind == "tool":
        if name not in [t["function"]["name"] for t in tools]:
            raise _bad(f"tool_choice.name: no tool named {name!r} in tools", "tool_choice")
        return True
    raise _bad(f"tool_choice.type: {kind!r}; expected auto, any, tool or none", "tool_choice")


def _conversation(req: CountTokensRequest, dropped: Dropped) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool]:
    """(chat messages, chat tools, whether the tools are rendered and parsed)."""
    for name in ("container", "mcp_servers"):
        if getattr(req, name, None) is not None:
            raise _bad(f"{name}: not supported by this server; leave it out", name)
    messages = chat_messages(req)
    tools = chat_tools(req.tools, dropped)
    return messages, tools, _tools_enabled(req.tool_choice, tools, _builtin_names(req.tools))


def build_count_call(req: CountTokensRequest, cfg: CollectorConfig) -> ChatCall:
    """The call whose prompt a `/v1/messages` request of this conversation would render."""
    dropped = Dropped("count_tokens", cfg.unsupported_tools)
    messages, tools, enabled = _conversation(req, dropped)
    return make_call(messages, tools, tools_enabled=enabled, headers={}, cfg=cfg, api="messages",
                     dropped_tools=dropped.header())  # fmt: skip


def build_messages_call(req: MessagesRequest, headers: Mapping[str, str], cfg: CollectorConfig) -> MessagesCall:
    dropped = Dropped("messages", cfg.unsupported_tools)
    messages, tools, enabled = _conversation(req, dropped)
    user_id = (req.metadata or {}).get("user_id")
    if user_id is not None and not isinstance(user_id, str):
        raise _bad("metadata.user_id: expected a string", "metadata")
    user, embedded = claude_user(user_id) if user_id is not None else (None, None)
    try:
        stop = _stop(req.stop_sequences)
    except ApiError as exc:
        raise _bad(f"stop_sequences: {exc.message}", "stop_sequences") from None
    call = make_call(
        messages, tools, tools_enabled=enabled, headers=headers, cfg=cfg,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, max_tokens=req.max_tokens,
        stop=stop, stream=bool(req.stream), user=user, session_id=req.session_id, api="messages",
        dropped_tools=dropped.header(), embedded_session=embedded,
    )  # fmt: skip
    return MessagesCall(req, call)
