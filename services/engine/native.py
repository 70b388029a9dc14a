"""SGLang's native HTTP API: /generate, weight updates, model info, health, pause.

Shapes follow SGLang's `http_server.py`: `/generate` answers
`{"text", "output_ids", "meta_info"}`, or with `stream: true` server-sent events
`data: {json}\\n\\n` … `data: [DONE]\\n\\n` whose chunks are cumulative (text,
output_ids and output log-probs so far — SGLang's default, without
`--incremental-streaming-output`). A failed weight update answers 400 with
`success: false`, as SGLang does. LoRA adapters load and unload by name as in SGLang
(`/load_lora_adapter {lora_name, lora_path}`, `/unload_lora_adapter {lora_name}`, answered
with `success`, `error_message` and every `loaded_adapters`; vLLM's `/v1/…` paths take the
same bodies); `/update_weight_version {new_version}` makes a loaded adapter the default. A request with a grammar (`json_schema` or `ebnf`) has
it compiled in a worker thread before it is queued; a grammar that does not compile is
a 400 naming the problem.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from services.engine.engine import Engine
from services.engine.grammar import GrammarError, compile_grammar
from services.engine.protocol import BadRequest, error_body, parse_generate, sglang_output
from services.engine.request import GenParams, Job
from services.engine.sampling import SamplingConfig
from services.engine.scheduler import UnknownAdapter
from shared.errors import EngineUnavailable
from shared.schemas import describe

log = logging.getLogger(__name__)


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # load_format, is_async, token_step, ...

    model_path: str
    weight_version: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True  # nothing is cached across requests here


class LoadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # pinned: one pool here, nothing to pin

    lora_name: str
    lora_path: str


class UnloadAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str


class WeightVersionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    new_version: str


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    mode: str = "abort"  # SGLang's default; "in_place" and "retract" freeze requests


def _json_error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind), status_code=status)


async def _body(request: Request) -> Any:
    raw = await request.body()
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None


async def _until_final_or_disconnect(engine: Engine, job: Job, request: Request) -> Any:
    """The final snapshot; if the client disconnects first, abort the job and return None."""
    final = asyncio.ensure_future(engine.final(job))
    try:
        while True:
            done, _ = await asyncio.wait({final}, timeout=1.0)
            if done:
                return final.result()
            if await request.is_disconnected():
                engine.scheduler.abort(job, "the client went away")
                final.cancel()
                return None
    finally:
        if not final.done():
            final.cancel()


def _adapter_answer(engine: Engine, ok: bool, error: str) -> JSONResponse:
    """SGLang's answer to /load_lora_adapter and /unload_lora_adapter (400 when refused)."""
    body = {"success": ok, "error_message": error, "loaded_adapters": engine.loaded_adapters()}
    return JSONResponse(body, status_code=200 if ok else 400)


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def router(engine: Engine) -> APIRouter:
    r = APIRouter()

    @r.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        try:
            params, text_lp = parse_generate(
                await _body(request),
                tokenizer=engine.tokenizer,
                vocab_size=engine.vocab_size,
                context_length=engine.context_length,
                default_max_new_tokens=engine.cfg.default_max_new_tokens,
            )
            if params.grammar_spec is not None:
                params.grammar = await asyncio.to_thread(
                    compile_grammar, params.grammar_spec, engine.tokenizer_path, engine.vocab_size
                )
            job = engine.submit(params)
        except (BadRequest, GrammarError, UnknownAdapter) as exc:
            return _json_error(400, str(exc), "BadRequest")
        except EngineUnavailable as exc:
            return _json_error(503, str(exc), "ServiceUnavailable")

        def render(snap: Any) -> dict[str, Any]:
            return sglang_output(snap, params, tokenizer=engine.tokenizer, text_in_logprobs=text_lp)

        if params.stream:
            return StreamingResponse(_stream(engine, job, render), media_type="text/event-stream")
        try:
            snap = await _until_final_or_disconnect(engine, job, request)
        except Exception as exc:
            return _json_error(500, f"generation failed: {type(exc).__name__}: {exc}", "InternalServerError")
        if snap is None:
            return Response(status_code=499)
        return JSONResponse(render(snap))

    @r.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        try:
            req = UpdateWeightsRequest.model_validate(await _body(request))
        except (ValidationError, BadRequest) as exc:
            msg = describe(exc) if isinstance(exc, ValidationError) else str(exc)
            return JSONResponse(
                {"success": False, "message": msg, "num_paused_requests": 0}, status_code=400
            )
        ok, message, n = await engine.update_weights(
            req.model_path, req.weight_version, abort=req.abort_all_requests
        )
        if ok and req.weight_version is not None:
            message += f" Weight version updated to {req.weight_version}."
        return JSONResponse(
            {"success": ok, "message": message, "num_paused_requests": n},
            status_code=200 if ok else 400,
        )

    @r.post("/load_lora_adapter")
    @r.post("/v1/load_lora_adapter")  # vLLM's path, same body
    async def load_lora_adapter(request: Request) -> JSONResponse:
        try:
            req = LoadAdapterRequest.model_validate(await _body(request))
        except (ValidationError, BadRequest) as exc:
            return _adapter_answer(engine, False, describe(exc) if isinstance(exc, ValidationError) else str(exc))
        ok, message = await engine.load_adapter(req.lora_name, req.lora_path)
        return _adapter_answer(engine, ok, "" if ok else message)

    @r.post("/unload_lora_adapter")
    @r.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        try:
            req = UnloadAdapterRequest.model_validate(await _body(request))
        except (ValidationError, BadRequest) as exc:
            return _adapter_answer(engine, False, describe(exc) if isinstance(exc, ValidationError) else str(exc))
        ok, message = await engine.unload_adapter(req.lora_name)
        return _adapter_answer(engine, ok, "" if ok else message)

    @r.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        try:
            req = WeightVersionRequest.model_validate(await _body(request))
        except (ValidationError, BadRequest) as exc:
            return _json_error(400, describe(exc) if isinstance(exc, ValidationError) else str(exc), "BadRequest")
        engine.scheduler.set_default(req.new_version)
        return JSONResponse({"success": True, "message": f"weight version is {engine.weight_version}"})

    @r.get("/model_info")
    @r.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return engine.model_info()

    @r.get("/get_weight_version")
    @r.get("/weight_version")
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": engine.weight_version}

    @r.get("/get_server_info")
    @r.get("/server_info")
    async def server_info() -> dict[str, Any]:
        waiting, running = engine.scheduler.load()
        return {
            **engine.model_info(),
            "max_running_requests": engine.cfg.max_running,
            "max_queue": engine.cfg.max_queue,
            "waiting": waiting,
            "running": running,
            "paused": engine.scheduler.paused,
            "device": str(engine.scheduler.model.device),
            "version": "nextstate-cpu-engine",
        }

    @r.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.scheduler.alive() else 503)

    @r.get("/health_generate")
    async def health_generate() -> Response:
        """Runs a one-token greedy generation through the queue, like SGLang's."""
        params = GenParams(
            input_ids=[0], rid=f"HEALTH_CHECK_{time.time()}", sampling=SamplingConfig(0.0),
            max_new_tokens=1, ignore_eos=True,
        )  # fmt: skip
        try:
            job = engine.submit(params)
            await asyncio.wait_for(engine.final(job), engine.cfg.health_timeout_s)
        except Exception as exc:
            log.warning("health check failed: %s", exc)
            return Response(status_code=503)
        return Response(status_code=200)

    @r.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        try:
            mode = PauseRequest.model_validate(await _body(request)).mode
        except (ValidationError, BadRequest) as exc:
            return _json_error(400, str(exc), "BadRequest")
        if mode not in ("abort", "in_place", "retract"):
            return _json_error(400, f"Invalid mode: {mode!r}. Expected one of abort, retract, in_place.", "BadRequest")
        aborted = engine.scheduler.pause(abort=mode == "abort")
        log.info("generation paused", extra={"mode": mode, "aborted": aborted})
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @r.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        engine.scheduler.resume()
        log.info("generation continued")
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @r.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        return Response("Cache flushed.\n", status_code=200)  # no cross-request cache here

    return r


async def _stream(engine: Engine, job: Job, render: Any) -> AsyncIterator[bytes]:
    try:
        async for snap in engine.outputs(job):
            yield sse(render(snap))
    except Exception as exc:
        log.warning("stream failed", extra={"rid": job.params.rid, "error": repr(exc)})
        yield sse({"error": {"message": f"{type(exc).__name__}: {exc}"}})
    yield b"data: [DONE]\n\n"
