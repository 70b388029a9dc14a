"""`VLLMClient`: the same engine interface over vLLM's HTTP server (checked against 0.32).

What it uses, and what it needs from the vLLM deployment (shared/vllm_engine.py starts
vLLM with all of it; `nextstate up --engine vllm` does that):

- generate / stream: `POST /inference/v1/generate` (`--enable-scale-out`): token ids in,
  `output_mode: "text"` out — the sampled `token_ids`, their detokenized `text`, per-token
  log-probs, and `weight_versions`, the version of the weights behind every output token.
  A response therefore names the version that produced it, even when a reload happened
  while it was queued (the version of its first token is reported; with the default
  `/pause?mode=wait` every token of a response comes from one version).
  vLLM's initial version is "default": reported as "0", the base model, as SGLang's
  `--weight-version 0`.
- log-probs: `--logprobs-mode processed_logprobs`, so the log-prob of each sampled token is
  the one of the distribution it was drawn from (after temperature), as the trainer
  recomputes it; vLLM's default is the raw distribution.
- top log-probs: `top_logprobs_num=k` asks for k+1 (`--max-logprobs 21` allows the OpenAI
  maximum of 20): vLLM lists the sampled token first and cuts the list at the number
  asked, so with k+1 the k most likely are always there. `--return-tokens-as-token-ids`
  makes those tokens `token_id:<id>`.
- constrained decoding: `SamplingParams.json_schema` / `.regex` go as
  `structured_outputs: {"json": …}` / `{"regex": …}` in the sampling params.
- max_tokens: pass `SamplingParams.max_tokens` or `default_max_tokens=`.
- score: `POST /v1/completions` with `prompt_logprobs: 0`. vLLM computes prompt log-probs
  from the raw distribution whatever the temperature: temperature 1 (or 0, greedy, whose
  processed log-probs are the raw ones too) is supported; any other raises
  `EngineNotSupported` rather than return the wrong numbers.
- update_weights: `VLLM_SERVER_DEV_MODE=1`: `/pause` → `/collective_rpc` `reload_weights`
  `{weights_path}` → `/reset_prefix_cache` → `/update_weight_version` → `/resume`, resumed
  on every path. A failed `reload_weights` in vLLM 0.32 does not leave it serving the old
  weights: it answers 500, drops the connection (a `/resume` sent on it never arrives: the
  engine stays paused), and its model is left half-reloaded — the next generation kills
  the engine core and the server exits. So only a folder verified in full may be sent
  (the watcher checks files, sizes, sha256 and that the weights fit the running model
  first); after a failure this client reloads the weights it loaded last (or the served
  model's own) before it resumes, retries `/resume`, and raises `EngineDied` when vLLM
  could not be put right. Without dev mode the endpoints answer 404: `EngineNotSupported`.
- weight_version: `GET /weight_info` (dev mode); otherwise the version this client loaded.
- LoRA adapters (`--enable-lora --max-lora-rank R`, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True):
  `load_adapter` is `/v1/load_lora_adapter` then `/update_weight_version` to the adapter's
  name, `unload_adapter` `/v1/unload_lora_adapter` (running requests finish on the adapter);
  with `adapters=True` a request names the adapter as its `model`, and so does `score`.
- auth: `api_key` goes out as `Authorization: Bearer` on every call. vLLM's own
  `--api-key` guards only `/v1`, `/v2`, `/inference`, `/cohere`; `python -m services.vllm`
  (what the stack runs) guards every route but `/health` and `/ping`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from shared.engine_client.base import (
    AdapterAnswer,
    GenerateChunk,
    GenerateResult,
    HTTPEngine,
    SamplingLike,
    TopLogprobs,
    check_score_range,
    split_sampling,
)
from shared.errors import EngineDied, EngineError, EngineNotSupported, EngineUnavailable
from shared.schemas import SamplingParams

GENERATE = "/inference/v1/generate"
INITIAL_VERSION = "default"  # vLLM's weight version before any update_weight_version


def engine_version(reported: Any) -> str:
    """vLLM's weight version as the stack names it: its initial "default" is "0"."""
    if reported is None:
        return ""
    text = str(reported)
    return "0" if text == INITIAL_VERSION else text


def _token_id(token: Any) -> int:
    if not isinstance(token, str) or not token.startswith("token_id:"):
        raise EngineUnavailable(f"vLLM returned token {token!r}: start it with --return-tokens-as-token-ids")
    return int(token.split(":", 1)[1])


def _logprobs(choice: dict[str, Any], n: int) -> list[float]:
    content = (choice.get("logprobs") or {}).get("content") or []
    values = [float(c["logprob"]) for c in content]
    if len(values) != n:
        raise EngineUnavailable(f"{GENERATE}: {len(values)} log-probs for {n} tokens")
    return values


def _top(choice: dict[str, Any], k: int) -> list[TopLogprobs]:
    """The k most likely (id, log-prob) per position (k+1 were asked: see the docstring)."""
    if k <= 0:
        return []
    out: list[TopLogprobs] = []
    for entry in (choice.get("logprobs") or {}).get("content") or []:
        pairs = sorted(((_token_id(t["token"]), float(t["logprob"])) for t in entry.get("top_logprobs") or []),
                       key=lambda p: -p[1])
        out.append(pairs[:k])
    return out


def _version(choice: dict[str, Any]) -> str | None:
    spans = choice.get("weight_versions") or []
    return engine_version(spans[0].get("version")) if spans else None


def _structured(sp: SamplingParams) -> dict[str, Any] | None:
    if sp.json_schema is not None:
        return {"json": json.loads(sp.json_schema)}
    if sp.regex is not None:
        return {"regex": sp.regex}
    return None


class VLLMClient(HTTPEngine):
    def __init__(self, base_url: str, *, model: str | None = None, default_max_tokens: int | None = None, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self.model = model
        self.default_max_tokens = default_max_tokens
        self._version = "0"
        self._loaded: tuple[str, str] | None = None  # (weights path, version) of the last reload

    async def _model(self) -> str:
        if self.model is None:
            data = await self.json("GET", "/v1/models")
            models = data.get("data") or []
            if not models:
                raise EngineUnavailable("vLLM serves no model (/v1/models is empty)")
            self.model = str(models[0]["id"])
        return self.model

    def payload(
        self, input_ids: Sequence[int], sampling: SamplingLike, *, stop_token_ids: Iterable[int] | None,
        stream: bool, top_logprobs_num: int = 0, rid: str | None = None, adapter: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        sp, extra = split_sampling(sampling)
        params: dict[str, Any] = {
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "logprobs": top_logprobs_num + 1 if top_logprobs_num > 0 else 0,
        }
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.default_max_tokens
        if max_tokens is not None:
            params["max_tokens"] = max_tokens
        if sp.stop:
            params["stop"] = list(sp.stop)
        if sp.seed is not None:
            params["seed"] = sp.seed
        if stop_token_ids is not None:
            params["stop_token_ids"] = list(stop_token_ids)
        structured = _structured(sp)
        if structured is not None:
            params["structured_outputs"] = structured
        params.update(extra)
        body: dict[str, Any] = {"token_ids": list(input_ids), "sampling_params": params,
                                "output_mode": "text", "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if rid is not None:
            body["request_id"] = rid
        if adapter is not None:
            body["model"] = adapter  # vLLM runs a request on the LoRA adapter its model names
        return body

    async def _generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingLike,
        *,
        return_logprob: bool,
        stop_token_ids: Iterable[int] | None,
        rid: str | None,
        top_logprobs_num: int,
        adapter: str | None,
    ) -> GenerateResult:
        body = self.payload(input_ids, sampling, stop_token_ids=stop_token_ids, stream=False,
                            top_logprobs_num=top_logprobs_num, rid=rid, adapter=adapter)  # fmt: skip
        out = await self.json("POST", GENERATE, json_body=body)
        choices = out.get("choices") or []
        if not choices:
            raise EngineUnavailable(f"{GENERATE}: vLLM answered without a choice")
        choice = choices[0]
        ids = [int(t) for t in choice.get("token_ids") or []]
        lps = _logprobs(choice, len(ids))
        version = _version(choice)
        if version:
            self._version = version
        usage = out.get("usage") or {}
        return GenerateResult(
            text=str(choice.get("text") or ""),
            output_ids=ids,
            output_logprobs=lps if return_logprob else [],
            finish_reason=str(choice.get("finish_reason") or "abort"),
            prompt_tokens=int(usage.get("prompt_tokens", len(input_ids))),
            completion_tokens=int(usage.get("completion_tokens", len(ids))),
            weight_version=version or self._version,
            matched_stop=choice.get("stop_reason"),
            rid=out.get("request_id"),
            output_top_logprobs=_top(choice, top_logprobs_num),
        )

    async def _stream(
        self,
        input_ids: Sequence[int],
        sampling: SamplingLike,
        *,
        return_logprob: bool,
        stop_token_ids: Iterable[int] | None,
        rid: str | None,
        top_logprobs_num: int,
        adapter: str | None,
    ) -> AsyncIterator[GenerateChunk]:
        body = self.payload(input_ids, sampling, stop_token_ids=stop_token_ids, stream=True,
                            top_logprobs_num=top_logprobs_num, rid=rid, adapter=adapter)  # fmt: skip
        text, total = "", 0
        final: GenerateChunk | None = None
        async for event in self.sse(GENERATE, body):
            if "error" in event:
                raise EngineUnavailable(f"{GENERATE} stream: {self.error_message(json.dumps(event).encode())}")
            choices = event.get("choices") or []
            if not choices:  # the usage-only chunk that ends a stream
                continue
            choice = choices[0]
            ids = [int(t) for t in choice.get("token_ids") or []]
            lps = _logprobs(choice, len(ids))
            piece = str(choice.get("text") or "")
            text += piece
            total += len(ids)
            reason = choice.get("finish_reason")
            version = _version(choice)  # on the final chunk only
            if version:
                self._version = version
            chunk = GenerateChunk(
                new_ids=ids,
                new_logprobs=lps if return_logprob else [],
                new_text=piece,
                text=text,
                finish_reason=str(reason) if reason is not None else None,
                weight_version=version,
                matched_stop=choice.get("stop_reason"),
                prompt_tokens=len(input_ids),
                completion_tokens=total,
                rid=event.get("request_id"),
                new_top_logprobs=_top(choice, top_logprobs_num),
            )
            if chunk.done:
                final = chunk
            yield chunk
        if final is None:
            raise EngineUnavailable(f"{GENERATE} stream ended before its final chunk")

    async def score(self, input_ids: Sequence[int], start: int, *, temperature: float = 1.0) -> list[float]:
        ids = list(input_ids)
        check_score_range(len(ids), start)
        if temperature not in (0.0, 1.0):
            raise EngineNotSupported(
                f"vLLM re-scores prompts with the raw distribution (temperature 1), not at "
                f"temperature {temperature}: score at temperature 1, or use an engine that tempers "
                "prompt log-probs (SGLang, our CPU engine)")
        if start == len(ids):
            return []
        body = {"model": await self.adapter() or await self._model(), "prompt": ids, "max_tokens": 1,
                "prompt_logprobs": 0}
        out = await self.json("POST", "/v1/completions", json_body=body)
        rows = ((out.get("choices") or [{}])[0]).get("prompt_logprobs")
        if not rows or len(rows) != len(ids):
            raise EngineUnavailable("score: vLLM returned no prompt_logprobs for every prompt token")
        values = []
        for j in range(start, len(ids)):
            entry = (rows[j] or {}).get(str(ids[j]))
            if entry is None:
                raise EngineUnavailable(f"score: no log-prob for prompt token {j} ({ids[j]})")
            values.append(float(entry["logprob"] if isinstance(entry, dict) else entry))
        return values

    async def score_topk(
        self, input_ids: Sequence[int], start: int, k: int, *, temperature: float = 1.0
    ) -> tuple[list[float], list[TopLogprobs]]:
        raise EngineNotSupported(
            "teacher top-K scoring is implemented for SGLang (and our engine) only: "
            "set NEXTSTATE_JUDGE__ENGINE_KIND=sglang or NEXTSTATE_JUDGE__TOPK=0"
        )

    # -- weights ------------------------------------------------------------------------------
    async def _dev(self, path: str, what: str, **kwargs: Any) -> Any:
        resp = await self.request("POST", path, ok=(404,), timeout=self.update_timeout, **kwargs)
        if resp.status_code == 404:
            raise EngineNotSupported(
                f"vLLM has no {path} ({what}): start it with VLLM_SERVER_DEV_MODE=1 "
                "(python -m services.vllm via shared/vllm_engine.py does)"
            )
        return resp

    async def update_weights(
        self, model_path: str, weight_version: str, *, abort_all_requests: bool = False
    ) -> tuple[bool, str]:
        """Pause, reload from `model_path`, reset the prefix cache, set the version, resume.

        A reload that fails is put right before the resume: the weights this client loaded
        last (its base model's at first, as version "0") are reloaded, so vLLM serves what it
        did (a half-reloaded vLLM 0.32 dies of its next generation). Resumed on every path,
        retried: vLLM drops the connection of a failed call. (False, why) when vLLM refused
        and serves its weights again; `EngineDied` when it could not be put right, does not
        resume, or is not healthy afterwards (it must be restarted)."""
        await self._dev("/pause", "pause", params={"mode": "abort" if abort_all_requests else "wait"})
        restored = True
        try:
            ok, message = await self._reload(model_path, weight_version)
            if not ok:
                restored, note = await self._restore()
                message += f"; {note}"
        finally:
            not_resumed = await self._resume()
        if not_resumed:
            message += f"; resume failed: {not_resumed}"
        if not_resumed or not restored or (not ok and not await self._still_healthy()):
            raise EngineDied(f"{message}; vLLM is no longer fit to serve: it must be restarted")
        return ok, message

    async def _reload(self, model_path: str, weight_version: str) -> tuple[bool, str]:
        try:
            await self._dev("/collective_rpc", "reload_weights",
                            json_body={"method": "reload_weights", "kwargs": {"weights_path": model_path}})
            await self._dev("/reset_prefix_cache", "reset_prefix_cache")
            await self._dev("/update_weight_version", "update_weight_version",
                            json_body={"new_version": weight_version})
        except EngineNotSupported:
            raise
        except EngineError as exc:
            return False, f"vLLM could not reload {model_path!r}: {exc}"
        self._version = weight_version
        self._loaded = (model_path, weight_version)
        return True, f"reloaded {model_path!r} as version {weight_version}"

    async def _restore(self) -> tuple[bool, str]:
        """Reload what this client loaded last (else the served model's own folder, version
        "0"), after a failed reload; (done, what happened)."""
        try:
            path, version = self._loaded or (str((await self.model_info())["model_path"]), "0")
        except (EngineError, KeyError) as exc:
            return False, f"could not find the weights to restore: {exc}"
        for attempt in range(3):  # the failed call's connection is gone: the first try may meet it
            ok, message = await self._reload(path, version)
            if ok:
                return True, f"restored {path!r} as version {version}"
            await asyncio.sleep(0.2 * (attempt + 1))
        return False, f"could not restore {path!r}: {message}"

    async def _resume(self) -> str:
        """Resume generation; "" when it did, else why not (never raises). Retried: resuming
        twice is harmless, and the first try may meet a connection vLLM dropped."""
        why = ""
        for attempt in range(3):
            try:
                await self._dev("/resume", "resume")
                return ""
            except EngineNotSupported as exc:
                return str(exc)
            except EngineError as exc:
                why = str(exc)
                await asyncio.sleep(0.2 * (attempt + 1))
        return why

    async def _still_healthy(self, checks: int = 3, every_s: float = 0.3) -> bool:
        """`/health` answers 200 `checks` times in a row (a dying vLLM may answer once more)."""
        for i in range(checks):
            if i:
                await asyncio.sleep(every_s)
            if not await self.health():
                return False
        return True

    # -- LoRA adapters ----------------------------------------------------------------------------
    async def load_adapter(self, name: str, path: str) -> AdapterAnswer:
        """`/v1/load_lora_adapter` (vLLM started with --enable-lora and
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), then `/update_weight_version` to `name`. vLLM
        answers a load that fails with an error and keeps serving (checked against 0.32: a
        truncated adapter is a 500 and the server stays healthy)."""
        ok, message = await self._lora("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if not ok and "already been loaded" in message:
            ok, message = True, f"{name!r} was loaded already"
        if ok:
            await self._dev("/update_weight_version", "update_weight_version", json_body={"new_version": name})
            self._version = name
            self.forget_adapter()
        return AdapterAnswer(ok, message, await self._adapters())

    async def unload_adapter(self, name: str) -> AdapterAnswer:
        """`/v1/unload_lora_adapter`: new requests can no longer name it; those running finish on it."""
        ok, message = await self._lora("/v1/unload_lora_adapter", {"lora_name": name})
        return AdapterAnswer(ok, message, await self._adapters())

    async def _lora(self, path: str, body: dict[str, Any]) -> tuple[bool, str]:
        resp = await self.request("POST", path, json_body=body, timeout=self.update_timeout, ok=(400, 404, 500))
        if resp.status_code < 300:
            return True, resp.text
        message = self.error_message(resp.content)
        if resp.status_code == 404 and message == "Not Found":
            raise EngineNotSupported(f"vLLM has no {path}: start it with --enable-lora --max-lora-rank R "
                                     "and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (shared/vllm_engine.py does "
                                     "with NEXTSTATE_ENGINE__LORA_RANK)")
        return False, message

    async def _adapters(self) -> tuple[str, ...]:
        """The LoRA adapters vLLM lists in /v1/models (those with a parent)."""
        data = await self.json("GET", "/v1/models")
        return tuple(str(m["id"]) for m in data.get("data") or [] if m.get("parent"))

    async def model_info(self) -> dict[str, Any]:
        data = await self.json("GET", "/v1/models")
        card = (data.get("data") or [{}])[0]
        root = card.get("root", card.get("id"))
        return {
            "model_path": root,
            "tokenizer_path": root,
            "served_model_name": card.get("id"),
            "is_generation": True,
            "weight_version": await self.weight_version(),
            "max_model_len": card.get("max_model_len"),
        }

    async def weight_version(self) -> str:
        resp = await self.request("GET", "/weight_info", ok=(404,))
        if resp.status_code == 404:
            return self._version
        try:
            reported = resp.json().get("weight_version")
        except ValueError as exc:
            raise EngineUnavailable("/weight_info: the engine answered with invalid JSON") from exc
        return engine_version(reported) or self._version

    async def health(self) -> bool:
        try:
            resp = await self.request("GET", "/health", timeout=min(self.timeout, 10.0), ok=(503,))
        except Exception:
            return False
        return resp.status_code == 200

    async def pause(self) -> None:
        await self._dev("/pause", "pause", params={"mode": "keep"})

    async def resume(self) -> None:
        await self._dev("/resume", "resume")
