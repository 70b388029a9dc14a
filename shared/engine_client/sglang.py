"""`SGLangClient`: the engine interface over SGLang's native HTTP API (and our CPU engine's).

- generate / stream: `POST /generate` with `input_ids`, `return_logprob` (and
  `top_logprobs_num`, read back from `output_top_logprobs`); the sampling seed is sent as
  SGLang's `sampling_seed`; `json_schema` / `regex` go as SGLang's sampling params of the
  same names (grammar-constrained decoding). Streams work whether the server sends
  cumulative chunks (SGLang's default) or incremental ones
  (`--incremental-streaming-output`): `completion_tokens` in each chunk tells which.
- score: `max_new_tokens: 0`, `return_logprob`, `logprob_start_len = start - 1`; SGLang
  reports the first position of that window as null, so the values are entries 1…
- update_weights: `POST /update_weights_from_disk`; SGLang answers 400 with
  `success: false` when the load fails, which is returned, not raised.
- LoRA adapters: `load_adapter` / `unload_adapter` are `/load_lora_adapter` and
  `/unload_lora_adapter` (SGLang started with `--enable-lora`; our engine always), and a
  load sets `/update_weight_version` to the adapter's name; with `adapters=True` every
  request names that adapter as `lora_path` (SGLang serves the base to requests that name
  none; our engine serves its newest adapter either way).
- auth: `api_key` goes out as `Authorization: Bearer` on every call. SGLang started with
  `--api-key` checks it everywhere except `/health*`, `/ready*` and `/metrics*` (its
  `srt/utils/auth.py`); our CPU engine everywhere except `/health`, `/healthz`,
  `/readyz` (and `/metrics` when NEXTSTATE_INTERNAL__METRICS_PUBLIC).
"""

from __future__ import annotations

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
from shared.errors import EngineNotSupported, EngineRejected, EngineUnavailable


def _finish(meta: dict[str, Any]) -> tuple[str | None, int | str | None]:
    fr = meta.get("finish_reason")
    if fr is None:
        return None, None
    if isinstance(fr, dict):
        matched = fr.get("matched")
        return str(fr.get("type", "stop")), matched if isinstance(matched, int | str) else None
    return str(fr), None


def _logprob_values(entries: Any, what: str) -> list[float]:
    out = []
    for entry in entries or []:
        if entry[0] is None:
            raise EngineUnavailable(f"{what}: the engine returned a null log-prob")
        out.append(float(entry[0]))
    return out


def _top_values(rows: Any, what: str) -> list[TopLogprobs]:
    """SGLang's `output_top_logprobs` (per position: [[logprob, id, text], ...]) as (id, logprob)."""
    out: list[TopLogprobs] = []
    for row in rows or []:
        try:
            out.append([(int(e[1]), float(e[0])) for e in row or []])
        except (TypeError, ValueError, IndexError):
            raise EngineUnavailable(f"{what}: malformed output_top_logprobs") from None
    return out


class SGLangClient(HTTPEngine):
    """Client of SGLang's native API; our CPU engine speaks the same."""

    def __init__(self, base_url: str, *, default_max_tokens: int | None = None, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self.default_max_tokens = default_max_tokens
        self._model_info_path = "/model_info"

    def payload(
        self,
        input_ids: Sequence[int],
        sampling: SamplingLike,
        *,
        return_logprob: bool,
        stop_token_ids: Iterable[int] | None,
        rid: str | None,
        stream: bool,
        top_logprobs_num: int = 0,
        adapter: str | None = None,
    ) -> dict[str, Any]:
        sp, extra = split_sampling(sampling)
        params: dict[str, Any] = {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k}
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.default_max_tokens
        if max_tokens is not None:
            params["max_new_tokens"] = max_tokens
        if sp.stop:
            params["stop"] = list(sp.stop)
        if sp.seed is not None:
            params["sampling_seed"] = sp.seed
        if stop_token_ids is not None:
            params["stop_token_ids"] = list(stop_token_ids)
        if sp.json_schema is not None:
            params["json_schema"] = sp.json_schema
        if sp.regex is not None:
            params["regex"] = sp.regex
        params.update(extra)
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": params,
            "return_logprob": return_logprob or top_logprobs_num > 0,
            "stream": stream,
        }
        if top_logprobs_num > 0:
            body["top_logprobs_num"] = top_logprobs_num
        if rid is not None:
            body["rid"] = rid
        if adapter is not None:
            body["lora_path"] = adapter  # SGLang's name of the LoRA adapter to run with
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
        body = self.payload(
            input_ids, sampling, return_logprob=return_logprob, stop_token_ids=stop_token_ids,
            rid=rid, stream=False, top_logprobs_num=top_logprobs_num, adapter=adapter,
        )  # fmt: skip
        out = await self.json("POST", "/generate", json_body=body)
        meta = out.get("meta_info") or {}
        ids = [int(t) for t in out.get("output_ids") or []]
        logprobs = _logprob_values(meta.get("output_token_logprobs"), "/generate") if return_logprob else []
        if return_logprob and len(logprobs) != len(ids):
            raise EngineUnavailable(f"/generate: {len(logprobs)} log-probs for {len(ids)} tokens")
        top = _top_values(meta.get("output_top_logprobs"), "/generate") if top_logprobs_num > 0 else []
        if top_logprobs_num > 0 and len(top) != len(ids):
            raise EngineUnavailable(f"/generate: {len(top)} top log-prob rows for {len(ids)} tokens")
        reason, matched = _finish(meta)
        return GenerateResult(
            text=str(out.get("text") or ""),
            output_ids=ids,
            output_logprobs=logprobs,
            finish_reason=reason or "abort",
            prompt_tokens=int(meta.get("prompt_tokens", len(input_ids))),
            completion_tokens=int(meta.get("completion_tokens", len(ids))),
            weight_version=str(meta.get("weight_version", "")),
            matched_stop=matched,
            rid=meta.get("id"),
            e2e_latency=meta.get("e2e_latency"),
            output_top_logprobs=top,
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
        body = self.payload(
            input_ids, sampling, return_logprob=return_logprob, stop_token_ids=stop_token_ids,
            rid=rid, stream=True, top_logprobs_num=top_logprobs_num, adapter=adapter,
        )  # fmt: skip
        seen_ids = 0
        seen_lps = 0
        seen_top = 0
        text = ""
        finished = False
        async for event in self.sse("/generate", body):
            if "error" in event:
                err = event["error"] if isinstance(event["error"], dict) else {"message": event["error"]}
                msg = f"/generate stream: {err.get('message', err)}"
                if int(err.get("code") or 400) >= 500:
                    raise EngineUnavailable(msg)
                raise EngineRejected(msg, status_code=int(err.get("code") or 400))
            meta = event.get("meta_info") or {}
            ids = [int(t) for t in event.get("output_ids") or []]
            total = int(meta.get("completion_tokens", seen_ids + len(ids)))
            cumulative = total == len(ids) and not (seen_ids and total == seen_ids + len(ids))
            new_ids = ids[seen_ids:] if cumulative else ids
            lp_entries = meta.get("output_token_logprobs") or []
            new_lp_entries = lp_entries[seen_lps:] if cumulative else lp_entries
            new_lps = _logprob_values(new_lp_entries, "/generate stream") if return_logprob else []
            new_top: list[TopLogprobs] = []
            if top_logprobs_num > 0:
                top_rows = meta.get("output_top_logprobs") or []
                new_top_rows = top_rows[seen_top:] if cumulative else top_rows
                new_top = _top_values(new_top_rows, "/generate stream")
                seen_top += len(new_top_rows)
            chunk_text = event.get("text")
            if chunk_text is None:
                new_text = ""
            elif cumulative:
                new_text = chunk_text[len(text):] if chunk_text.startswith(text) else chunk_text
                text = chunk_text
            else:
                new_text = chunk_text
                text += chunk_text
            seen_ids += len(new_ids)
            seen_lps += len(new_lp_entries)
            reason, matched = _finish(meta)
            if reason is not None:
                finished = True
            yield GenerateChunk(
                new_ids=new_ids,
                new_logprobs=new_lps,
                new_text=new_text,
                text=text,
                finish_reason=reason,
                weight_version=meta.get("weight_version"),
                matched_stop=matched,
                prompt_tokens=int(meta.get("prompt_tokens", len(input_ids))),
                completion_tokens=total,
                rid=meta.get("id"),
                new_top_logprobs=new_top,
            )
            if finished:
                break
        if not finished:
            raise EngineUnavailable("/generate stream ended before its final chunk")

    async def score(self, input_ids: Sequence[int], start: int, *, temperature: float = 1.0) -> list[float]:
        """Log-probs of input_ids[start:], each given all tokens before it (teacher-forced)."""
        ids = list(input_ids)
        check_score_range(len(ids), start)
        if start == len(ids):
            return []
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
            "return_logprob": True,
            "logprob_start_len": start - 1,
            **self.adapter_field(await self.adapter()),
        }
        out = await self.json("POST", "/generate", json_body=body)
        entries = (out.get("meta_info") or {}).get("input_token_logprobs") or []
        window = entries[-(len(ids) - start):]
        if len(window) != len(ids) - start or [int(e[1]) for e in window] != ids[start:]:
            raise EngineUnavailable(
                f"score: expected log-probs for {len(ids) - start} tokens, got {len(entries)} entries"
            )
        return _logprob_values(window, "score")

    async def score_topk(
        self, input_ids: Sequence[int], start: int, k: int, *, temperature: float = 1.0
    ) -> tuple[list[float], list[TopLogprobs]]:
        """`score`, plus the k most likely (id, log-prob) of each scored position's
        distribution (`top_logprobs_num` with token-in scoring), best first."""
        ids = list(input_ids)
        check_score_range(len(ids), start)
        if start == len(ids):
            return [], []
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
            "return_logprob": True,
            "logprob_start_len": start - 1,
            "top_logprobs_num": k,
            **self.adapter_field(await self.adapter()),
        }
        out = await self.json("POST", "/generate", json_body=body)
        meta = out.get("meta_info") or {}
        n = len(ids) - start
        entries = meta.get("input_token_logprobs") or []
        window = entries[-n:]
        rows = (meta.get("input_top_logprobs") or [])[-n:]
        if len(window) != n or [int(e[1]) for e in window] != ids[start:] or len(rows) != n:
            raise EngineUnavailable(
                f"score_topk: expected log-probs and top-{k} rows for {n} tokens, got "
                f"{len(entries)} entries and {len(rows)} rows"
            )
        return _logprob_values(window, "score_topk"), _top_values(rows, "score_topk")

    async def update_weights(
        self, model_path: str, weight_version: str, *, abort_all_requests: bool = False
    ) -> tuple[bool, str]:
        body = {
            "model_path": model_path,
            "weight_version": weight_version,
            "abort_all_requests": abort_all_requests,
        }
        resp = await self.request(
            "POST", "/update_weights_from_disk", json_body=body, timeout=self.update_timeout, ok=(400,)
        )
        try:
            data = resp.json()
        except ValueError:
            data = None
        if not isinstance(data, dict) or "success" not in data:
            raise self.status_error(resp.status_code, resp.content, "/update_weights_from_disk")
        return bool(data["success"]), str(data.get("message", ""))

    @staticmethod
    def adapter_field(adapter: str | None) -> dict[str, str]:
        return {"lora_path": adapter} if adapter is not None else {}

    async def load_adapter(self, name: str, path: str) -> AdapterAnswer:
        """`/load_lora_adapter`, then `/update_weight_version` to `name`: the weight version a
        client reads from now on names the adapter to run with. A name already loaded (a
        rollback onto an adapter not yet unloaded) is only made the weight version again."""
        answer = await self._adapter_call("/load_lora_adapter", {"lora_name": name, "lora_path": path})
        if not answer.ok and "already loaded" in answer.message and name in (answer.loaded or ()):
            answer = AdapterAnswer(True, f"{name!r} was loaded already", answer.loaded)
        if answer.ok:
            await self.request("POST", "/update_weight_version", json_body={"new_version": name}, ok=(404,))
            self.forget_adapter()
        return answer

    async def unload_adapter(self, name: str) -> AdapterAnswer:
        return await self._adapter_call("/unload_lora_adapter", {"lora_name": name})

    async def _adapter_call(self, path: str, body: dict[str, Any]) -> AdapterAnswer:
        resp = await self.request("POST", path, json_body=body, timeout=self.update_timeout, ok=(400, 404))
        try:
            data = resp.json()
        except ValueError:
            data = None
        if resp.status_code == 404 and not (isinstance(data, dict) and "success" in data):
            raise EngineNotSupported(f"the engine has no {path}: start SGLang with --enable-lora "
                                     "(--max-lora-rank R --lora-target-modules all)")
        if not isinstance(data, dict) or "success" not in data:
            raise self.status_error(resp.status_code, resp.content, path)
        loaded = data.get("loaded_adapters")
        return AdapterAnswer(bool(data["success"]), str(data.get("error_message") or data.get("message") or ""),
                             tuple(loaded) if isinstance(loaded, dict | list) else None)

    async def model_info(self) -> dict[str, Any]:
        if self._model_info_path == "/model_info":
            resp = await self.request("GET", "/model_info", ok=(404,))
            if resp.status_code != 404:
                return dict(resp.json())
            self._model_info_path = "/get_model_info"  # SGLang releases before /model_info
        return dict(await self.json("GET", self._model_info_path))

    async def weight_version(self) -> str:
        resp = await self.request("GET", "/get_weight_version", ok=(404,))
        if resp.status_code == 404:
            return str((await self.model_info()).get("weight_version", ""))
        return str(resp.json().get("weight_version", ""))

    async def health(self) -> bool:
        try:
            resp = await self.request("GET", "/health", timeout=min(self.timeout, 10.0), ok=(503,))
        except Exception:
            return False
        return resp.status_code == 200

    async def pause(self, mode: str = "in_place") -> None:
        """Hold new requests; "in_place" freezes running ones, "abort" ends them (SGLang's modes)."""
        await self.request("POST", "/pause_generation", json_body={"mode": mode})

    async def resume(self) -> None:
        await self.request("POST", "/continue_generation", json_body={})
