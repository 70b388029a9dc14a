"""`GET /openapi.json`: the three agent APIs as an OpenAPI 3.1 document.

The request bodies are the validating models themselves (request.py,
responses_request.py, anthropic_request.py) with their free-form fields (`messages`,
`input`, `tools`, `tool_choice`, …) given the shapes the validators accept, so the
document describes what the collector takes, not a guess at it; a unit test checks the
recorded real agents' requests against it (tests/unit/test_collector_openapi.py), and
the fuzz test (tests/integration/test_collector_fuzz.py) generates requests from it.
Responses are described by their envelope: the answer objects are OpenAI's and
Anthropic's, the errors each API's error shape.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.collector.anthropic_request import CountTokensRequest, MessagesRequest
from services.collector.builtin_tools import RESPONSES_BUILTINS
from services.collector.request import NAME, ChatRequest, JsonSchemaFormat, Message, Tool
from services.collector.responses_request import ResponsesRequest

INT64 = {"minimum": -(1 << 63), "maximum": (1 << 63) - 1}


class _Shape(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- Chat Completions ----------------------------------------------------------------------------


class NamedToolChoiceFunction(_Shape):
    name: str


class NamedToolChoice(_Shape):
    type: Literal["function"]
    function: NamedToolChoiceFunction


class TextFormat(_Shape):
    type: Literal["text", "json_object"]


class JsonSchemaResponseFormat(_Shape):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


class ChatCompletionRequest(ChatRequest):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: TextFormat | JsonSchemaResponseFormat | None = None


# -- Responses -----------------------------------------------------------------------------------


class InputText(_Shape):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(_Shape):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]


class FunctionCallItem(_Shape):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None


class FunctionCallOutputItem(_Shape):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


class SummaryText(_Shape):
    type: Literal["summary_text", "reasoning_text"]
    text: str


class ReasoningItem(_Shape):
    type: Literal["reasoning"]
    summary: list[SummaryText] = []
    content: list[SummaryText] | None = None


class FunctionTool(_Shape):
    type: Literal["function"]
    name: str = Field(pattern=NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(_Shape):
    type: Literal["namespace"]
    name: str = Field(pattern=NAME)
    description: str | None = None
    tools: list[FunctionTool]


class BuiltinTool(_Shape):
    """Offered, left out of the prompt (or refused: NEXTSTATE_COLLECTOR__UNSUPPORTED_TOOLS)."""

    type: Literal[tuple(sorted(RESPONSES_BUILTINS))]  # type: ignore[valid-type]


class FunctionToolChoice(_Shape):
    type: Literal["function"]
    name: str
    namespace: str | None = None


class ResponsesText(_Shape):
    format: TextFormat | JsonSchemaTextFormat | None = None


class JsonSchemaTextFormat(_Shape):
    type: Literal["json_schema"]
    name: str = Field(pattern=NAME)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


ResponsesText.model_rebuild()


class ResponsesCreateRequest(ResponsesRequest):
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem] | None = None
    tools: list[FunctionTool | NamespaceTool | BuiltinTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    text: ResponsesText | None = None  # type: ignore[assignment]


# -- Messages ------------------------------------------------------------------------------------


class TextBlock(_Shape):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Shape):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Shape):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool | None = None


class ThinkingBlock(_Shape):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class AnthropicMessage(_Shape):
    role: Literal["user", "assistant", "system"]
    content: str | list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock]


class CustomTool(_Shape):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=NAME)
    description: str | None = None
    input_schema: dict[str, Any]


class ServerTool(_Shape):
    """Anthropic's own tools (web_search_20250305, …): left out, or refused."""

    type: str = Field(pattern=r"^(web_search|web_fetch|code_execution|bash|text_editor|computer|memory)_\d{8}$")
    name: str


class AnthropicToolChoice(_Shape):
    type: Literal["auto", "any", "none", "tool"]
    name: str | None = None


class CountTokensBody(CountTokensRequest):
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[CustomTool | ServerTool] | None = None
    tool_choice: AnthropicToolChoice | None = None  # type: ignore[assignment]


class MessagesCreateRequest(MessagesRequest):
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[CustomTool | ServerTool] | None = None
    tool_choice: AnthropicToolChoice | None = None  # type: ignore[assignment]


# -- the document --------------------------------------------------------------------------------

BODIES: dict[str, type[BaseModel]] = {
    "ChatCompletionRequest": ChatCompletionRequest, "ResponsesCreateRequest": ResponsesCreateRequest,
    "MessagesCreateRequest": MessagesCreateRequest, "CountTokensRequest": CountTokensBody,
}  # fmt: skip
OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}  # fmt: skip
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "request_id": {"type": "string"},
    "error": {"type": "object", "required": ["type", "message"],
              "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}  # fmt: skip
OBJECT = {"type": "object"}
STREAM = {"type": "string", "description": "server-sent events"}


def _bounded(schema: Any) -> Any:
    """Every integer in the document within 64 bits, as the collector accepts them."""
    if isinstance(schema, dict):
        out = {k: _bounded(v) for k, v in schema.items()}
        if out.get("type") == "integer":
            out.setdefault("minimum", INT64["minimum"])
            out.setdefault("maximum", INT64["maximum"])
        return out
    if isinstance(schema, list):
        return [_bounded(v) for v in schema]
    return schema


def _answers(ok: dict[str, Any], error: dict[str, Any], stream: bool = False) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": ok}}
    if stream:
        content["text/event-stream"] = {"schema": STREAM}
    err = {"content": {"application/json": {"schema": error}}}
    return {"200": {"description": "the answer", "content": content},
            **{code: {"description": what, **err} for code, what in (
                ("400", "the request is wrong (the message names the field and what to send)"),
                ("401", "no or a wrong API key"), ("404", "no such object"),
                ("413", "the body is larger than NEXTSTATE_COLLECTOR__MAX_BODY_BYTES"),
                ("502", "the model server is unavailable"), ("504", "the model server did not answer in time"))}}  # fmt: skip


def _post(summary: str, body: str, error: dict[str, Any], stream: bool = True) -> dict[str, Any]:
    return {"summary": summary, "requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{body}"}}}},
        "responses": _answers(OBJECT, error, stream)}  # fmt: skip


def _get(summary: str, error: dict[str, Any], parameters: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    return {"summary": summary, "parameters": list(parameters), "responses": _answers(OBJECT, error)}


@functools.cache
def document() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for name, model in BODIES.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", by_alias=True)
        schemas.update(schema.pop("$defs", {}))
        schemas[name] = schema
    rid = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
    mid = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
    page: list[dict[str, Any]] = [rid, {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
            {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
            {"name": "after", "in": "query", "schema": {"type": "string"}},
            {"name": "include", "in": "query", "schema": {"type": "array", "items": {"type": "string"}}}]  # fmt: skip
    oa, an = OPENAI_ERROR, ANTHROPIC_ERROR
    paths = {
        "/v1/chat/completions": {"post": _post("OpenAI Chat Completions", "ChatCompletionRequest", oa)},
        "/v1/responses": {"post": _post("OpenAI Responses", "ResponsesCreateRequest", oa)},
        "/v1/responses/{response_id}": {"get": _get("A stored response", oa, [rid]),
                                        "delete": _get("Delete a stored response", oa, [rid])},
        "/v1/responses/{response_id}/input_items": {"get": _get("A stored response's input items", oa, page)},
        "/v1/messages": {"post": _post("Anthropic Messages", "MessagesCreateRequest", an)},
        "/v1/messages/count_tokens": {"post": _post("Anthropic token count", "CountTokensRequest", an, False)},
        "/v1/models": {"get": _get("The served model (Anthropic's shape with an anthropic-version header)", oa)},
        "/v1/models/{model_id}": {"get": _get("The served model, under any name", oa, [mid])},
    }  # fmt: skip
    doc: dict[str, Any] = _bounded({
        "openapi": "3.1.0",
        "info": {"title": "nextstate collector", "version": "1",
                 "description": "OpenAI Chat Completions and Responses, Anthropic Messages: the policy "
                                "served, every main-line turn captured for training."},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"},
            "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
        "security": [{"bearer": []}, {"x-api-key": []}],
    })  # fmt: skip
    return doc
