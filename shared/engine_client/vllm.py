"""`VLLMClient`: the same engine interface over vLLM's OpenAI-compatible server.

What it uses, and what it needs from the vLLM deployment:

- generate / stream: `POST /v1/completions` with `prompt` as a list of token ids,
  `logprobs: 0` (the sampled token's log-prob) and `return_tokens_as_token_ids: true`
  (tokens come back as "token_id:<id>"); `return_token_ids: true` is also sent and
  its `token_ids` preferred when the server has it. Works on any recent vLLM.
- top log-probs: `top_logprobs_num=k` sends `logprobs: k`; vLLM's per-position
  `top_logprobs` maps ("token_id:<id>") to log-probs and may also hold the sampled token,
  so the k best are kept.
- constrained decoding: `SamplingParams.json_schema` / `.regex` go as
  `structured_outputs: {"json": …}` / `{"regex": …}` (vLLM >= 0.10.2; the older
  `guided_json` / `guided_regex` fields were removed in 0.12; an older vLLM ignores the
  field, so check the version before relying on it).
- max_tokens: vLLM's completions default is 16 when none is sent; pass
  `SamplingParams.max_tokens` or `default_max_tokens=` (SGLang's default is 128).
- score: `max_tokens: 1` with `prompt_logprobs: 0`; `choices[0].prompt_logprobs[j]`
  maps the prompt token id (as a string) to its log-prob.
- Log-prob semantics differ from our engine's by default: vLLM reports log-probs of
  the raw model distribution (before temperature) unless it is started with
  `--logprobs-mode processed_logprobs`. Start it that way for PPO ratios.
- update_weights: vLLM has no stock "reload from this folder" endpoint outside its
  development mode. With `VLLM_SERVER_DEV_MODE=1` this client drives
  `/pause` → `/collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": …}}`
  → `/reset_prefix_cache` → `/update_weight_version` (when present) → `/resume`.
  Without dev mode those endpoints answer 404 and `EngineNotSupported` is raised.
- weight_version: `GET /weight_info` (dev mode); otherwise the version this client
  last loaded (initially "0"), since vLLM responses carry no version.
- pause / resume: `POST /pause?mode=keep` and `POST /resume` (dev mode).
- auth: `api_key` goes out as `Authorization: Bearer` on every call. vLLM's `--api-key`
  (or `VLLM_API_KEY`) protects only `/v1/*`: the dev-mode control endpoints above
  (`/pause`, `/collective_rpc`, `/resume`, …) stay open, so keep a vLLM engine's port
  reachable by the stack only.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from shared.engine_client.base import (
    GenerateChunk,
    GenerateResult,
    HTTPEngine,
    SamplingLike,
    TopLogprobs,
    check_score_range,
    split_sampling,
)
from shared.errors import EngineError, EngineNotSupported, EngineUnavailable
from shared.schemas import SamplingParams


def _token_ids(choice: dict[str, Any]) -> list[int] | None:
    if choice.get("token_ids") is not None:
        return [int(t) for t in choice["token_ids"]]
    lp = choice.get("logprobs") or {}
    tokens = lp.get("tokens")
    if tokens is None:
        return None
    out = []
    for tok in tokens:
        if not isinstance(tok, str) or not tok.startswith("token_id:"):
            raise EngineUnavailable(f"vLLM returned token {tok!r}: is return_tokens_as_token_ids supported?")
        out.append(int(tok.split(":", 1)[1]))
    return out


def _logprobs(choice: dict[str, Any]) -> list[float]:
    values = (choice.get("logprobs") or {}).get("token_logprobs") or []
    return [float(v) for v in values]


def _top(choice: dict[str, Any], k: int) -> list[TopLogprobs]:
    """The k most likely (id, log-prob) per position from `logprobs.top_logprobs`."""
    if k <= 0:
        return []
    rows = (choice.get("logprobs") or {}).get("top_logprobs") or []
    out: list[TopLogprobs] = []
    for row in rows:
        pairs = []
        for tok, lp in (row or {}).items():
            if not isinstance(tok, str) or not tok.startswith("token_id:"):
                raise EngineUnavailable(f"vLLM returned top token {tok!r}: is return_tokens_as_token_ids supported?")
            pairs.append((int(tok.split(":", 1)[1]), float(lp)))
        pairs.sort(key=lambda p: -p[1])
        out.append(pairs[:k])
    return out


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

    async def _model(self) -> str:
        if self.model is None:
            data = await self.json("GET", "/v1/models")
            models = data.get("data") or []
            if not models:
                raise EngineUnavailable("vLLM serves no model (/v1/models is empty)")
            self.model = str(models[0]["id"])
        return self.model

    async def payload(
        self, input_ids: Sequence[int], sampling: SamplingLike, *, stop_token_ids: Iterable[int] | None,
        stream: bool, top_logprobs_num: int = 0,
    ) -> dict[str, Any]:  # fmt: skip
        sp, extra = split_sampling(sampling)
        body: dict[str, Any] = {
            "model": await self._model(),
            "prompt": list(input_ids),
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "top_k": sp.top_k,
            "logprobs": max(0, top_logprobs_num),
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "stream": stream,
        }
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.default_max_tokens
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if sp.stop:
            body["stop"] = list(sp.stop)
        if sp.seed is not None:
            body["seed"] = sp.seed
        if stop_token_ids is not None:
            body["stop_token_ids"] = list(stop_token_ids)
        if stream:
            body["stream_options"] = {"include_usage": True}
        structured = _structured(sp)
        if structured is not None:
            body["structured_outputs"] = structured
        body.update(extra)
        return body

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling: SamplingLike,
        *,
        return_logprob: bool = True,
        stop_token_ids: Iterable[int] | None = None,
        rid: str | None = None,
        top_logprobs_num: int = 0,
    ) -> GenerateResult:
        body = await self.payload(input_ids, sampling, stop_token_ids=stop_token_ids, stream=False,
                                  top_logprobs_num=top_logprobs_num)  # fmt: skip
        out = await self.json("POST", "/v1/completions", json_body=body)
        choice = (out.get("choices") or [{}])[0]
        ids = _token_ids(choice) or []
        lps = _logprobs(choice)
        if len(lps) != len(ids):
            raise EngineUnavailable(f"/v1/completions: {len(lps)} log-probs for {len(ids)} tokens")
        usage = out.get("usage") or {}
        return GenerateResult(
            text=str(choice.get("text") or ""),
            output_ids=ids,
            output_logprobs=lps if return_logprob else [],
            finish_reason=str(choice.get("finish_reason") or "abort"),
            prompt_tokens=int(usage.get("prompt_tokens", len(input_ids))),
            completion_tokens=int(usage.get("completion_tokens", len(ids))),
            weight_version=self._version,
            matched_stop=choice.get("stop_reason"),
            rid=out.get("id"),
            output_top_logprobs=_top(choice, top_logprobs_num),
        )

    async def stream(
        self,
        input_ids: Sequence[int],
        sampling: SamplingLike,
        *,
        return_logprob: bool = True,
        stop_token_ids: Iterable[int] | None = None,
        rid: str | None = None,
        top_logprobs_num: int = 0,
    ) -> AsyncIterator[GenerateChunk]:
        body = await self.payload(input_ids, sampling, stop_token_ids=stop_token_ids, stream=True,
                                  top_logprobs_num=top_logprobs_num)  # fmt: skip
        text, total = "", 0
        final: GenerateChunk | None = None
        async for event in self.sse("/v1/completions", body):
            if "error" in event:
                raise EngineUnavailable(f"/v1/completions stream: {event['error']}")
            choices = event.get("choices") or []
            if not choices:  # the usage-only chunk that ends a stream
                continue
            choice = choices[0]
            ids = _token_ids(choice) or []
            lps = _logprobs(choice)
            text += str(choice.get("text") or "")
            total += len(ids)
            reason = choice.get("finish_reason")
            chunk = GenerateChunk(
                new_ids=ids,
                new_logprobs=lps if return_logprob else [],
                new_text=str(choice.get("text") or ""),
                text=text,
                finish_reason=str(reason) if reason is not None else None,
                weight_version=self._version,
                matched_stop=choice.get("stop_reason"),
                prompt_tokens=len(input_ids),
                completion_tokens=total,
                rid=event.get("id"),
                new_top_logprobs=_top(choice, top_logprobs_num),
            )
            if chunk.done:
                final = chunk
            yield chunk
        if final is None:
            raise EngineUnavailable("/v1/completions stream ended before its final chunk")

    async def score(self, input_ids: Sequence[int], start: int, *, temperature: float = 1.0) -> list[float]:
        ids = list(input_ids)
        check_score_range(len(ids), start)
        if start == len(ids):
            return []
        body = {
            "model": await self._model(),
            "prompt": ids,
            "max_tokens": 1,
            "temperature": temperature,
            "prompt_logprobs": 0,
        }
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

    async def _dev(self, path: str, what: str, **kwargs: Any) -> Any:
        resp = await self.request("POST", path, ok=(404,), timeout=self.update_timeout, **kwargs)
        if resp.status_code == 404:
            raise EngineNotSupported(
                f"vLLM has no {path} ({what}): start it with VLLM_SERVER_DEV_MODE=1 on a vLLM "
                "release that has the RLHF endpoints"
            )
        return resp

    async def update_weights(
        self, model_path: str, weight_version: str, *, abort_all_requests: bool = False
    ) -> tuple[bool, str]:
        await self._dev("/pause", "pause", params={"mode": "abort" if abort_all_requests else "wait"})
        try:
            try:
                await self._dev(
                    "/collective_rpc",
                    "reload_weights",
                    json_body={"method": "reload_weights", "kwargs": {"weights_path": model_path}},
                )
            except EngineError as exc:
                if isinstance(exc, EngineNotSupported):
                    raise
                return False, f"vLLM could not reload {model_path!r}: {exc}"
            await self.request("POST", "/reset_prefix_cache", ok=(404,))
            resp = await self.request(
                "POST", "/update_weight_version", json_body={"new_version": weight_version}, ok=(404,)
            )
            self._version = weight_version
            note = "" if resp.status_code != 404 else " (version tracked by this client only)"
            return True, f"reloaded {model_path!r} as version {weight_version}{note}"
        finally:
            await self.request("POST", "/resume", ok=(404,))

    async def model_info(self) -> dict[str, Any]:
        data = await self.json("GET", "/v1/models")
        card = (data.get("data") or [{}])[0]
        return {
            "model_path": card.get("root", card.get("id")),
            "served_model_name": card.get("id"),
            "is_generation": True,
            "weight_version": await self.weight_version(),
            "max_model_len": card.get("max_model_len"),
        }

    async def weight_version(self) -> str:
        resp = await self.request("GET", "/weight_info", ok=(404,))
        if resp.status_code == 404:
            return self._version
        return str(resp.json().get("weight_version") or self._version)

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
