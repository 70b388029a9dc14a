"""A `/v1/chat/completions` body and headers -> one validated `ChatCall`, or a 400.

What the collector honours: messages, temperature, top_p, top_k (extension),
max_tokens / max_completion_tokens, stop, seed, tools, tool_choice, stream,
stream_options.include_usage, user, and `session_id` (extension, also the
`X-Session-Id` header). `n` other than 1 is refused (400): send n requests instead.

tool_choice: "none" renders the prompt *without* the tools and parses no calls (the
model never sees them, so the captured prompt is exactly what it was given); "auto",
"required" and a named function render the tools and parse calls — "required" and a
named function are not enforced (there is no constrained decoding behind this API).

Fields OpenAI defines that have no effect here are accepted and ignored (logprobs,
presence/frequency penalties, response_format, parallel_tool_calls, metadata, …);
unknown fields are ignored too, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.collector.openai_shapes import ApiError
from services.collector.settings import CollectorConfig
from shared.chat_messages import ChatTemplateError, normalize_messages, normalize_tools
from shared.schemas import SamplingParams

TurnType = Literal["main", "side"]
MAX_STOP = 16
MAX_ID = 256  # session ids and `user`
TRUE = frozenset({"1", "true", "yes", "on"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
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
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    user: str | None = None
    session_id: str | None = None


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
    session_hint: str | None  # X-Session-Id / session_id: wins over an inherited session
    user: str | None
    session_done: bool


def _param(exc: ValidationError) -> tuple[str | None, str]:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ())]
    where = ".".join(loc)
    msg = str(err.get("msg", "invalid"))
    return (loc[0] if loc else None), (f"{where}: {msg}" if where else msg)


def parse_body(body: bytes) -> ChatRequest:
    """JSON and schema validation, each failure a 400 in OpenAI's shape."""
    if not body.strip():
        raise ApiError(400, "the request body is empty: send a JSON object")
    try:
        return ChatRequest.model_validate_json(body)
    except ValidationError as exc:
        if any(e.get("type") == "json_invalid" for e in exc.errors()):
            raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
        param, msg = _param(exc)
        raise ApiError(400, f"invalid request: {msg}", param=param) from None


def _stop(stop: str | list[str] | None) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"stop has {len(stops)} strings; at most {MAX_STOP}", param="stop")
    if any(not s for s in stops):
        raise ApiError(400, "stop strings must not be empty", param="stop")
    return stops or None


def _tools_enabled(choice: str | dict[str, Any] | None) -> bool:
    if choice is None or isinstance(choice, dict):
        return True
    if choice in ("auto", "required"):
        return True
    if choice == "none":
        return False
    raise ApiError(
        400, f"tool_choice {choice!r} is not one of none, auto, required or a function",
        param="tool_choice",
    )


def _turn_type(value: str | None, default: TurnType) -> TurnType:
    if value is None or not value.strip():
        return default
    v = value.strip().lower()
    if v == "main" or v == "side":
        return v  # type: ignore[return-value]
    raise ApiError(400, f"X-Turn-Type is {value!r}: main or side", param="X-Turn-Type")


def build_call(req: ChatRequest, headers: Mapping[str, str], cfg: CollectorConfig) -> ChatCall:
    """Validate semantics beyond the schema and resolve defaults from the configuration."""
    if req.n is not None and req.n != 1:
        raise ApiError(400, f"n={req.n} is not supported: send {req.n} requests with n=1", param="n")
    try:
        messages = normalize_messages(req.messages)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    try:
        tools = normalize_tools(req.tools)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="tools") from None
    enabled = _tools_enabled(req.tool_choice) and tools is not None
    max_tokens = req.max_completion_tokens or req.max_tokens or cfg.default_max_tokens
    sampling = SamplingParams(
        temperature=cfg.default_temperature if req.temperature is None else req.temperature,
        top_p=cfg.default_top_p if req.top_p is None else req.top_p,
        top_k=cfg.default_top_k if req.top_k is None else req.top_k,
        max_tokens=max_tokens,
        stop=_stop(req.stop),
        seed=req.seed,
    )
    hint = headers.get("x-session-id") or req.session_id
    for name, value in (("session_id", hint), ("user", req.user)):
        if value is not None and len(value) > MAX_ID:
            raise ApiError(400, f"{name} is longer than {MAX_ID} characters", param=name)
    return ChatCall(
        raw_messages=req.messages,
        messages=messages,
        tools=tools if enabled else None,
        tools_enabled=enabled,
        sampling=sampling,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        turn_type=_turn_type(headers.get("x-turn-type"), cfg.default_turn_type),
        session_hint=hint.strip() or None if hint else None,
        user=req.user or None,
        session_done=headers.get("x-session-done", "").strip().lower() in TRUE,
    )
