"""`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}` and `GET …/{id}/input_items`:
OpenAI's Responses API.

The request becomes the internal conversation (responses_request.py) and goes down the
one answer path every API shares (completion.py: template, engine, parse, capture), so
its `Turn` is the one a chat completion of the same conversation would give. The
answer is shaped here:

- the response object: `id` (resp_…), `status` completed (incomplete with
  `incomplete_details.reason` max_output_tokens when the token limit cut it), `output`
  items — `reasoning` (when the model thinks and the collector parses reasoning), one
  assistant `message` with an `output_text` part, a `function_call` per tool call
  (`call_id` is the tool call's id, as the captured turn has it) — and `usage`; the
  request's settings are echoed as OpenAI does;
- streamed: `event: <type>` / `data: {…, "sequence_number"}` server-sent events —
  `response.created`, `response.in_progress`; per item `response.output_item.added`,
  then `response.content_part.added` and `response.output_text.delta`s (or
  `response.reasoning_text.delta`s; for a function call one
  `response.function_call_arguments.delta` with the whole arguments, as a call is
  known valid only once it closes, then `….done`), `…done` events and
  `response.output_item.done`; finally `response.completed` (or `response.incomplete`)
  with the whole response and its usage. A failure after the stream began is one
  `error` event. The assistant message stays open until the end, so text after a
  tool call joins it, as in the plain response;
- `include: ["message.output_text.logprobs"]` (+ `top_logprobs`): the `output_text`
  part carries the log-probs of the tokens its text came from (text_logprobs.py), in a
  stream each `response.output_text.delta` those of its own text;
- `store` (default true): the response and its conversation are kept in Redis
  (response_store.py), written in the same round trip as the turn's pending record or
  its emission at the end of a session (on its own only for a side turn or while
  capture spools), before the response (or its closing event) goes out, so a
  follow-up by `previous_response_id` finds it on any replica; `GET …/input_items`
  lists the items it was generated from (input_items.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from services.collector.completion import Answer, ChatService, EventWriter, ExtraWrite, Prepared
from services.collector.input_items import conversation_items, page, page_params
from services.collector.openai_shapes import ApiError, dumps
from services.collector.response_store import ResponseStore
from services.collector.responses_request import (
    ResponsesRequest,
    build_responses_call,
    parse_responses,
    split_name,
)
from services.collector.text_logprobs import TextLogprobs
from shared.schemas import SamplingParams
from shared.toolcalls import ContentDelta, Delta, ReasoningDelta

Reply = tuple[bytes | AsyncIterator[bytes], dict[str, str]]


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def usage(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}  # fmt: skip


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("rs_"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def message_item(text: str, status: str = "completed", item_id: str | None = None,
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    return {"id": item_id or new_id("msg_"), "type": "message", "status": status,
            "role": "assistant", "content": [text_part(text, logprobs)]}  # fmt: skip


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None) -> dict[str, Any]:
    """A tool call as a `function_call` item; a namespaced function's flat name
    (`namespace.function`, responses_request.py) as its `name` and `namespace`."""
    fn, namespace = split_name(name)
    item = {"id": item_id or new_id("fc_"), "type": "function_call", "status": "completed",
            "call_id": call_id, "name": fn, "arguments": arguments}  # fmt: skip
    if namespace is not None:
        item["namespace"] = namespace
    return item


def output_items(message: Mapping[str, Any], finish: str,
                 logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """An assistant message (chat's shape) as Responses output items (`logprobs`: its
    text's, when asked for)."""
    out: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        out.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        status = "incomplete" if finish == "length" else "completed"
        out.append(message_item(message["content"], status, logprobs=logprobs))
    for call in message.get("tool_calls") or ():
        fn = call["function"]
        out.append(call_item(call["id"], fn["name"], fn["arguments"]))
    return out


class ResponseShape:
    """The response object of one request: its settings echoed, its output and usage."""

    def __init__(self, req: ResponsesRequest, model: str, sampling: SamplingParams) -> None:
        self.id = new_id("resp_")
        self.created = int(time.time())
        self.req = req
        self.model = model
        self.sampling = sampling

    def body(self, status: str, output: list[dict[str, Any]], ans: Answer | None = None) -> dict[str, Any]:
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": None, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None, "model": self.model, "output": output,
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "service_tier": "default", "store": req.store is not False,
            "temperature": self.sampling.temperature,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
            "tools": req.tools or [], "top_logprobs": req.top_logprobs or 0,
            "top_p": self.sampling.top_p,
            "truncation": req.truncation or "disabled",
            "usage": None if ans is None else usage(ans.prompt_tokens, ans.completion_tokens),
            "user": req.user, "metadata": req.metadata or {},
        }  # fmt: skip

    def final(self, ans: Answer, output: list[dict[str, Any]]) -> dict[str, Any]:
        return self.body("incomplete" if ans.finish == "length" else "completed", output, ans)


class ResponsesEvents(EventWriter):
    """The server-sent events of one streamed response."""

    def __init__(self, shape: ResponseShape, keep: ResponsesApi | None, history: list[dict[str, Any]],
                 logprobs: bool = False) -> None:  # fmt: skip
        self.shape = shape
        self.answer_id = shape.id
        self.keep = keep  # stores the final response (None: store false)
        self.history = history
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.reasoning: int | None = None  # output index of the open reasoning item
        self.message: int | None = None  # … of the open message item
        self.closing: list[bytes] | None = None
        self.response: dict[str, Any] = {}
        self.response_json: bytes | None = None  # as stored (store true)
        self.lp = TextLogprobs() if logprobs else None  # the tokens' entries, tied to text
        self.text_lp: list[dict[str, Any]] = []  # the open message's

    def _ev(self, kind: str, **fields: Any) -> bytes:
        data = dumps({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def start(self) -> list[bytes]:
        r = self.shape.body("in_progress", [])
        return [self._ev("response.created", response=r), self._ev("response.in_progress", response=r)]

    def _open(self, item: dict[str, Any], out: list[bytes]) -> int:
        self.items.append(item)
        out.append(self._ev("response.output_item.added", output_index=len(self.items) - 1, item=item))
        return len(self.items) - 1

    def feed(self, deltas: list[Delta], logprobs: list[dict[str, Any]]) -> list[bytes]:
        out: list[bytes] = []
        lp = self.lp
        if lp is not None:
            lp.add(logprobs)
        for d in deltas:
            mine = [] if lp is None else lp.route(d)
            if isinstance(d, ReasoningDelta):
                if self.reasoning is None:
                    self.reasoning = self._open({"id": new_id("rs_"), "type": "reasoning",
                                                 "summary": [], "content": []}, out)  # fmt: skip
                    out.append(self._part("added", self.reasoning, {"type": "reasoning_text", "text": ""}))
                item = self.items[self.reasoning]
                item["text"] = item.get("text", "") + d.text
                out.append(self._ev("response.reasoning_text.delta", item_id=item["id"],
                                    output_index=self.reasoning, content_index=0, delta=d.text))  # fmt: skip
                continue
            self._close_reasoning(out)
            if isinstance(d, ContentDelta):
                if self.message is None:
                    self.message = self._open({"id": new_id("msg_"), "type": "message",
                                               "status": "in_progress", "role": "assistant",
                                               "content": []}, out)  # fmt: skip
                    out.append(self._part("added", self.message, text_part("")))
                item = self.items[self.message]
                item["text"] = item.get("text", "") + d.text
                self.text_lp += mine
                out.append(self._ev("response.output_text.delta", item_id=item["id"],
                                    output_index=self.message, content_index=0, delta=d.text,
                                    logprobs=mine))  # fmt: skip
                continue
            done = call_item(d.id or "", d.name or "", d.arguments)
            index = self._open({**done, "status": "in_progress", "arguments": ""}, out)
            self.items[index] = done
            out.append(self._ev("response.function_call_arguments.delta", item_id=done["id"],
                                output_index=index, delta=d.arguments))  # fmt: skip
            out.append(self._ev("response.function_call_arguments.done", item_id=done["id"],
                                output_index=index, name=done["name"], arguments=d.arguments))  # fmt: skip
            out.append(self._ev("response.output_item.done", output_index=index, item=done))
        return out

    def _part(self, what: str, index: int, part: dict[str, Any]) -> bytes:
        return self._ev(f"response.content_part.{what}", item_id=self.items[index]["id"],
                        output_index=index, content_index=0, part=part)  # fmt: skip

    def _close_reasoning(self, out: list[bytes]) -> None:
        if self.reasoning is None:
            return
        index, self.reasoning = self.reasoning, None
        text = self.items[index].pop("text", "")
        item = self.items[index] = reasoning_item(text, self.items[index]["id"])
        out.append(self._ev("response.reasoning_text.done", item_id=item["id"], output_index=index,
                            content_index=0, text=text))  # fmt: skip
        out.append(self._part("done", index, item["content"][0]))
        out.append(self._ev("response.output_item.done", output_index=index, item=item))

    def _close_message(self, finish: str, out: list[bytes]) -> None:
        if self.message is None:
            return
        index, self.message = self.message, None
        text = self.items[index].pop("text", "")
        status = "incomplete" if finish == "length" else "completed"
        item = self.items[index] = message_item(text, status, self.items[index]["id"], self.text_lp)
        out.append(self._ev("response.output_text.done", item_id=item["id"], output_index=index,
                            content_index=0, text=text, logprobs=self.text_lp))  # fmt: skip
        out.append(self._part("done", index, item["content"][0]))
        out.append(self._ev("response.output_item.done", output_index=index, item=item))

    def _finish(self, ans: Answer) -> list[bytes]:
        if self.closing is None:
            self.closing = []
            self._close_reasoning(self.closing)
            self._close_message(ans.finish, self.closing)
            self.response = self.shape.final(ans, self.items)
        return self.closing

    def persist(self, ans: Answer) -> ExtraWrite | None:
        self._finish(ans)
        if self.keep is None:
            return None
        self.response_json = dumps(self.response)
        return self.keep.store.prepare(self.response, [*self.history, ans.message], self.response_json)

    def end(self, ans: Answer) -> list[bytes]:
        closing = self._finish(ans)
        kind = "response.completed" if self.response["status"] == "completed" else "response.incomplete"
        if self.response_json is None:
            return [*closing, self._ev(kind, response=self.response)]
        # The response as stored, serialized once: {"type", "sequence_number", "response"}.
        head = self._ev(kind)[: -len(b"}\n\n")]
        return [*closing, head + b',"response":' + self.response_json + b"}\n\n"]

    def error(self, err: ApiError) -> bytes:
        return self._ev("error", code=err.code or err.kind, message=err.message, param=err.param)


class ResponsesApi:
    def __init__(self, service: ChatService, store: ResponseStore) -> None:
        self.service = service
        self.store = store

    async def create(self, raw: bytes, headers: Mapping[str, str]) -> Reply:
        service = self.service
        req = parse_responses(raw)
        prior = None
        if req.previous_response_id is not None:
            stored = await self.store.get(req.previous_response_id)
            if stored is None:
                raise ApiError(404, f"Previous response with id '{req.previous_response_id}' not "
                                    "found: it may still be streaming, have expired (stored "
                                    f"responses are kept {service.cfg.responses_ttl_s:g} s), been "
                                    "deleted, been created with store: false, or not been stored "
                                    "because Redis was unavailable. Send the whole conversation "
                                    "as input instead.",
                               param="previous_response_id",
                               code="previous_response_not_found")  # fmt: skip
            prior = stored.messages
        rc = build_responses_call(req, prior, headers, service.cfg)
        shape = ResponseShape(req, service.model_name, rc.call.sampling)
        keep = self if req.store is not False else None
        if rc.call.stream:
            def writer(prep: Prepared, version: str) -> EventWriter:
                return ResponsesEvents(shape, keep, rc.history, rc.call.logprobs)

            return await service.open_stream(rc.call, writer)
        t0 = time.perf_counter()
        ans = await service.generate(rc.call, shape.id)
        logprobs = service.text_logprobs(ans) if rc.call.logprobs else None
        body = shape.final(ans, output_items(ans.message, ans.finish, logprobs))
        out = dumps(body)
        extra = None if keep is None else self.store.prepare(body, [*rc.history, ans.message], out)
        await service.keep(ans, extra)
        service.observe(ans, t0)
        return out, service.headers(ans.prep, ans.version)

    async def retrieve(self, response_id: str) -> bytes:
        stored = await self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return dumps(stored.response)

    async def input_items(self, response_id: str, query: Mapping[str, str], includes: list[str]) -> bytes:
        """A page of the items the stored response was generated from (input_items.py)."""
        limit, order, after = page_params(query, includes)
        stored = await self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        items = conversation_items(stored.messages[:-1])  # its answer is its output, not input
        return dumps(page(items, limit, order, after))

    async def delete(self, response_id: str) -> bytes:
        if not await self.store.delete(response_id):
            raise _not_found(response_id)
        return dumps({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id",
                    code="not_found")  # fmt: skip
