"""OpenAI-compatible `/v1/chat/completions` and `/v1/models`, so the engine can be a judge.

Messages go through the tokenizer's chat template, then the same generation path as
`/generate`. Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`
so the official SDK raises its usual exceptions. Tool definitions are passed to the
template. With a tool-call parser configured (NEXTSTATE_ENGINE__TOOL_CALL_PARSER, as
SGLang's `--tool-call-parser`), a request with `tools` gets the output's tool calls parsed
into `tool_calls` (streamed as tool-call deltas), by the same parser as the collector's
(shared/toolcalls.py); without one, the text is returned as is.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.engine.engine import Engine
from services.engine.native import sse
from services.engine.protocol import BadRequest, SGLangSampling, sampling_to_params
from services.engine.request import GenParams, Snapshot
from services.engine.scheduler import UnknownAdapter
from shared.errors import EngineUnavailable
from shared.schemas import describe
from shared.toolcalls import StreamParser, delta_dicts, finish_reason, message_dict, parse_assistant


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    skip_special_tokens: bool | None = None
    ignore_eos: bool | None = None


def openai_error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _text_content(content: Any, index: int) -> Any:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadRequest(f"messages[{index}].content: only text parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise BadRequest(f"messages[{index}].content must be a string or a list of text parts")


def render_prompt(engine: Engine, req: ChatRequest) -> list[int]:
    messages = [{**m, "content": _text_content(m.get("content"), i)} for i, m in enumerate(req.messages)]
    try:
        rendered = engine.tokenizer.apply_chat_template(
            messages,
            tools=req.tools,
            add_generation_prompt=True,
            tokenize=False,
            **(req.chat_template_kwargs or {}),
        )
    except Exception as exc:
        raise BadRequest(f"cannot apply the chat template: {type(exc).__name__}: {exc}") from None
    ids = list(engine.tokenizer.encode(str(rendered), add_special_tokens=False))
    if not ids:
        raise BadRequest("the rendered prompt is empty")
    if len(ids) >= engine.context_length:
        raise BadRequest(f"the prompt has {len(ids)} tokens; the context length is {engine.context_length}")
    return ids


def chat_params(engine: Engine, req: ChatRequest) -> GenParams:
    if req.n not in (None, 1):
        raise BadRequest("only n=1 is supported")
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise BadRequest("response_format other than text is not supported")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sp = SGLangSampling(
        max_new_tokens=max_tokens,  # None: until EOS or the context length
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        seed=req.seed,
        skip_special_tokens=req.skip_special_tokens,
        ignore_eos=req.ignore_eos,
    )
    params = sampling_to_params(
        sp,
        input_ids=render_prompt(engine, req),
        rid=f"chatcmpl-{uuid.uuid4().hex}",
        default_max_new_tokens=0,  # unused: max_new_tokens is always set above
        vocab_size=engine.vocab_size,
    )
    if req.logprobs:
        params.return_logprob = True
        params.top_logprobs_num = req.top_logprobs or 0
    params.stream = req.stream
    return params


def _finish_reason(snap: Snapshot) -> str | None:
    if snap.finish is None:
        return None
    kind = str(snap.finish.get("type"))
    return "length" if kind == "length" else "stop" if kind == "stop" else kind


def _logprobs(engine: Engine, snap: Snapshot, start: int = 0) -> dict[str, Any]:
    def entry(lp: float, tid: int) -> dict[str, Any]:
        tok = str(engine.tokenizer.decode([tid]))
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}

    content = []
    for i, (lp, tid) in enumerate(snap.output_logprobs[start:], start):
        item = entry(lp, tid)
        top = snap.output_top[i] if i < len(snap.output_top) else []
        item["top_logprobs"] = [entry(v, t) for v, t in top]
        content.append(item)
    return {"content": content}


def router(engine: Engine) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": engine.served_model_name,
            "object": "model",
            "created": int(engine.started),
            "owned_by": "nextstate",
            "root": engine.model_path,
            "parent": None,
            "max_model_len": engine.context_length,
        }
        adapters = [{"id": name, "object": "model", "created": int(engine.started), "owned_by": "nextstate",
                     "root": path, "parent": engine.served_model_name, "max_model_len": None}
                    for name, path in engine.loaded_adapters().items()]  # as vLLM lists its LoRA adapters
        return {"object": "list", "data": [card, *adapters]}

    @r.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            try:
                body = json.loads(await request.body())
                req = ChatRequest.model_validate(body)
            except ValueError as exc:
                msg = describe(exc) if isinstance(exc, ValidationError) else f"invalid JSON: {exc}"
                raise BadRequest(msg) from None
            params = chat_params(engine, req)
            if req.model and req.model in engine.loaded_adapters():
                params.adapter = req.model  # vLLM's way of naming an adapter
            job = engine.submit(params)
        except (BadRequest, UnknownAdapter) as exc:
            return openai_error(400, str(exc), "invalid_request_error")
        except EngineUnavailable as exc:
            return openai_error(503, str(exc), "service_unavailable")
        created = int(time.time())
        model = req.model or engine.served_model_name
        parser = engine.cfg.tool_call_parser if req.tools else None
        if req.stream:
            return StreamingResponse(
                _chat_stream(engine, job, model, created, bool(req.logprobs), parser),
                media_type="text/event-stream",
            )
        try:
            snap = await engine.final(job)
        except Exception as exc:
            return openai_error(500, f"generation failed: {type(exc).__name__}", "server_error")
        message: dict[str, Any] = {"role": "assistant", "content": snap.text}
        reason = _finish_reason(snap)
        if parser is not None:
            parsed = parse_assistant(snap.text, tools_enabled=True, parser=parser)
            message, reason = message_dict(parsed), finish_reason(parsed, reason)
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": reason,
            "logprobs": _logprobs(engine, snap) if req.logprobs else None,
        }
        return JSONResponse(
            {
                "id": params.rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": snap.prompt_tokens,
                    "completion_tokens": len(snap.output_ids),
                    "total_tokens": snap.prompt_tokens + len(snap.output_ids),
                },
                "metadata": {"weight_version": snap.weight_version},
            }
        )

    return r


async def _chat_stream(
    engine: Engine, job: Any, model: str, created: int, logprobs: bool, parser: str | None = None
) -> AsyncIterator[bytes]:
    """Text deltas as generated; with a tool-call parser, the parser's deltas (content, then
    each call's name and arguments) and `tool_calls` as the finish reason."""
    base = {"id": job.params.rid, "object": "chat.completion.chunk", "created": created, "model": model}
    calls = None if parser is None else StreamParser(True, parser)
    sent_text, sent_tokens = "", 0
    first = True
    try:
        async for snap in engine.outputs(job):
            piece, reason = snap.text[len(sent_text) :], _finish_reason(snap)
            deltas: list[dict[str, Any]] = [{"content": piece}]
            if calls is not None:
                deltas = delta_dicts([*calls.feed(piece), *(calls.finish() if reason else [])]) or [{}]
                reason = calls.finish_reason(reason) if reason else None
            for i, delta in enumerate(deltas):
                if first:
                    delta = {"role": "assistant", **delta}
                    first = False
                last = i == len(deltas) - 1
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason if last else None}
                if logprobs and last:
                    choice["logprobs"] = _logprobs(engine, snap, sent_tokens)
                yield sse({**base, "choices": [choice]})
            sent_text, sent_tokens = snap.text, len(snap.output_ids)
    except Exception as exc:
        yield sse({"error": {"message": f"{type(exc).__name__}: {exc}", "type": "server_error"}})
    yield b"data: [DONE]\n\n"
