"""Request bodies of the native (SGLang) API, validated into `GenParams`, and responses.

Field names and defaults are SGLang's (`GenerateReqInput`, `SamplingParams`); an
unknown sampling parameter is an error as it is there. `lora_path` names the loaded LoRA
adapter a request runs with, as in SGLang (without it: the default, the newest loaded). `seed` is accepted as an alias
of SGLang's `sampling_seed`. Grammars — `json_schema` (`"$$ANY$$"`: any JSON) or
`ebnf`, at most one — become a `GrammarSpec`, compiled by the HTTP layer off the event
loop (`grammar.compile_grammar`) before the request is submitted. Features this engine
does not implement (penalties, `regex`, `structural_tag`, `stop_regex`, `logit_bias`,
n > 1, multimodal inputs, batches) are refused with a 400 that names them, rather than
silently ignored. (`regex` compiles like the others — grammar.py supports it — but stays
refused while tests/integration/test_engine.py pins it as unsupported; adding it to
`GRAMMAR_KINDS` enables it.)
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from services.engine.grammar import GrammarKind, GrammarSpec
from services.engine.request import GenParams, Snapshot
from services.engine.sampling import SamplingConfig
from shared.errors import MalformedMessage
from shared.schemas import describe

# Top-level GenerateReqInput fields we cannot honour: refused when set to anything truthy.
_UNSUPPORTED_TOP = (
    "image_data", "video_data", "audio_data", "input_embeds", "lora_id",
    "session_params", "return_hidden_states", "custom_logit_processor", "token_ids_logprob",
    "return_routed_experts", "bootstrap_host", "data_parallel_rank",
)  # fmt: skip


class BadRequest(MalformedMessage):
    """The request body is wrong; the message says which field and why (HTTP 400)."""


class SGLangSampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    seed: int | None = None  # alias of sampling_seed


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SGLangSampling | None = None
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: str | None = None  # SGLang's name for the LoRA adapter a request runs with


def _unsupported(sp: SGLangSampling) -> list[str]:
    bad = []
    for name, neutral in (
        ("min_p", 0.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0),
        ("repetition_penalty", 1.0), ("min_new_tokens", 0), ("n", 1),
    ):  # fmt: skip
        value = getattr(sp, name)
        if value is not None and value != neutral:
            bad.append(f"{name}={value}")
    for name in ("regex", "stop_regex", "structural_tag", "logit_bias"):
        if getattr(sp, name):
            bad.append(name)
    return bad


GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "ebnf")


def _grammar(sp: SGLangSampling) -> GrammarSpec | None:
    given = [(kind, getattr(sp, kind)) for kind in GRAMMAR_KINDS if getattr(sp, kind) is not None]
    if len(given) > 1:
        raise BadRequest(f"send at most one of {', '.join(GRAMMAR_KINDS)} (got {', '.join(k for k, _ in given)})")
    if not given:
        return None
    kind, source = given[0]
    if not source.strip():
        raise BadRequest(f"{kind} must not be empty")
    return GrammarSpec(kind, source)


def sampling_to_params(
    sp: SGLangSampling,
    *,
    input_ids: list[int],
    rid: str,
    default_max_new_tokens: int,
    vocab_size: int,
) -> GenParams:
    """Check SGLang sampling params and build the engine's `GenParams` (raises BadRequest)."""
    bad = _unsupported(sp)
    if bad:
        raise BadRequest(f"sampling_params not supported by this engine: {', '.join(bad)}")
    temperature = 1.0 if sp.temperature is None else sp.temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise BadRequest(f"temperature must be a non-negative finite number, got {temperature}")
    top_p = 1.0 if sp.top_p is None else sp.top_p
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}")
    top_k = -1 if sp.top_k is None else sp.top_k
    if top_k != -1 and top_k < 1:
        raise BadRequest(f"top_k must be -1 (disabled) or at least 1, got {top_k}")
    if "max_new_tokens" in sp.model_fields_set:
        max_new = sp.max_new_tokens
    else:
        max_new = default_max_new_tokens
    if max_new is not None and max_new < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {max_new}")
    stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
    if any(s == "" for s in stop):
        raise BadRequest("stop strings must not be empty")
    stop_ids = sp.stop_token_ids or []
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise BadRequest(f"stop_token_ids must be in [0, {vocab_size})")
    if sp.seed is not None and sp.sampling_seed is not None and sp.seed != sp.sampling_seed:
        raise BadRequest("seed and sampling_seed disagree; send one of them")
    interval = sp.stream_interval or 1
    if interval < 1:
        raise BadRequest("stream_interval must be at least 1")
    return GenParams(
        input_ids=input_ids,
        rid=rid,
        sampling=SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k),
        max_new_tokens=max_new,
        stop=stop,
        stop_token_ids=frozenset(stop_ids),
        ignore_eos=bool(sp.ignore_eos),
        skip_special_tokens=True if sp.skip_special_tokens is None else sp.skip_special_tokens,
        no_stop_trim=bool(sp.no_stop_trim),
        seed=sp.sampling_seed if sp.sampling_seed is not None else sp.seed,
        stream_interval=interval,
        grammar_spec=_grammar(sp),
    )


def parse_generate(
    body: Any, *, tokenizer: Any, vocab_size: int, context_length: int, default_max_new_tokens: int
) -> tuple[GenParams, bool]:
    """Validate a /generate body; return the params and `return_text_in_logprobs`."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    for key in ("text", "input_ids", "rid", "return_logprob", "logprob_start_len", "sampling_params"):
        value = body.get(key)
        if isinstance(value, list) and value and isinstance(value[0], list | str | dict):
            raise BadRequest(f"batched requests are not supported ({key} is a list): send one per prompt")
        if key == "sampling_params" and isinstance(value, list):
            raise BadRequest("batched requests are not supported (sampling_params is a list)")
    try:
        req = GenerateRequest.model_validate(body)
    except ValidationError as exc:
        raise BadRequest(describe(exc)) from None
    extra = req.model_extra or {}
    bad = [k for k in _UNSUPPORTED_TOP if extra.get(k)]
    if bad:
        raise BadRequest(f"not supported by this engine: {', '.join(bad)}")
    if (req.text is None) == (req.input_ids is None):
        raise BadRequest("send exactly one of text or input_ids")
    if req.input_ids is not None:
        ids = req.input_ids
        bad_ids = [t for t in ids if not 0 <= t < vocab_size]
        if bad_ids:
            raise BadRequest(f"input_ids must be in [0, {vocab_size}); got {bad_ids[:5]}")
    else:
        ids = list(tokenizer(req.text)["input_ids"])
    if not ids:
        raise BadRequest("the prompt is empty")
    if len(ids) >= context_length:
        raise BadRequest(
            f"the prompt has {len(ids)} tokens; the context length is {context_length}"
        )
    if req.logprob_start_len < -1:
        raise BadRequest("logprob_start_len must be -1 (output only) or at least 0")
    if req.top_logprobs_num < 0:
        raise BadRequest("top_logprobs_num must be at least 0")
    params = sampling_to_params(
        req.sampling_params or SGLangSampling(),
        input_ids=ids,
        rid=req.rid or uuid.uuid4().hex,
        default_max_new_tokens=default_max_new_tokens,
        vocab_size=vocab_size,
    )
    params.return_logprob = req.return_logprob
    params.logprob_start_len = req.logprob_start_len
    params.top_logprobs_num = req.top_logprobs_num if req.return_logprob else 0
    params.stream = req.stream
    params.adapter = req.lora_path or None
    return params, req.return_text_in_logprobs


def _triples(
    pairs: list[tuple[float, int]] | list[tuple[float | None, int]], token_text: Any
) -> list[list[Any]]:
    return [[lp, tid, token_text(tid)] for lp, tid in pairs]


def sglang_output(
    snap: Snapshot, params: GenParams, *, tokenizer: Any, text_in_logprobs: bool
) -> dict[str, Any]:
    """A snapshot as SGLang's /generate returns it: text, output_ids, meta_info."""

    def token_text(tid: int) -> str | None:
        return str(tokenizer.decode([tid])) if text_in_logprobs else None

    meta: dict[str, Any] = {
        "id": snap.rid,
        "finish_reason": snap.finish,
        "prompt_tokens": snap.prompt_tokens,
        "weight_version": snap.weight_version,
    }
    if params.return_logprob:
        meta["input_token_logprobs"] = _triples(snap.input_logprobs, token_text)
        meta["output_token_logprobs"] = _triples(snap.output_logprobs, token_text)
        if params.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [
                None if row is None else _triples(row, token_text) for row in snap.input_top
            ]
            meta["output_top_logprobs"] = [_triples(row, token_text) for row in snap.output_top]
    meta["completion_tokens"] = len(snap.output_ids)
    meta["cached_tokens"] = 0
    if snap.e2e_latency is not None:
        meta["e2e_latency"] = snap.e2e_latency
    return {"text": snap.text, "output_ids": snap.output_ids, "meta_info": meta}


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    """SGLang's native error shape."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}
