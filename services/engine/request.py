"""One generation request inside the engine: its parameters, its state, and one step of it.

`GenParams` is a validated request (built by `protocol.py` from SGLang's or OpenAI's
JSON). `Job` holds everything that request accumulates — its KV cache, sampled tokens
and log-probs, its generator — and `Job.step` advances it by exactly one forward pass
and one sampled token (`Job.take` is the sampling half, for a step the decode batch
ran for it). A job is bound to the weights it was admitted with, and to the LoRA adapter it
was submitted with (`Job.adapter`, which it keeps even when that adapter is unloaded
meanwhile): it never sees two sets of weights. A request with a grammar (`GenParams.grammar`, compiled by
`grammar.py` before it is submitted) samples every token through its `Constraint`'s
mask, in whichever path computed the logits; the log-probs it records stay unmasked.

Finish reasons follow SGLang's shapes: {"type": "length", "length": n},
{"type": "stop", "matched": token_id | "stop string"}, {"type": "abort", "message": …}.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from services.engine import text as textmod
from services.engine.grammar import CompiledGrammar, Constraint, GrammarSpec
from services.engine.model import LoadedModel
from services.engine.sampling import (
    SamplingConfig,
    new_generator,
    sample_token,
    scaled_logprobs,
    top_logprobs,
)

FinishReason = dict[str, Any]
TopList = list[tuple[float, int]]


@dataclass
class GenParams:
    input_ids: list[int]
    rid: str
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_new_tokens: int | None = 128  # None: until the context length
    stop: list[str] = field(default_factory=list)
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output log-probs only
    top_logprobs_num: int = 0
    stream: bool = False
    stream_interval: int = 1
    grammar_spec: GrammarSpec | None = None  # what the request asked for
    grammar: CompiledGrammar | None = None  # compiled from it before submission
    adapter: str | None = None  # the LoRA adapter it names (SGLang's lora_path); None: the default


@dataclass
class Snapshot:
    """What a request has produced so far; `finish` is set on the last one."""

    rid: str
    output_ids: list[int]
    text: str
    output_logprobs: list[tuple[float, int]]
    output_top: list[TopList]
    input_logprobs: list[tuple[float | None, int]]
    input_top: list[TopList | None]
    finish: FinishReason | None
    prompt_tokens: int
    weight_version: str
    e2e_latency: float | None = None


class Job:
    """A request's life in the engine (owned by the scheduler thread once admitted)."""

    def __init__(self, params: GenParams, loop: asyncio.AbstractEventLoop | None) -> None:
        self.params = params
        self.loop = loop
        self.queue: asyncio.Queue[Snapshot | BaseException] = asyncio.Queue()
        self.created = time.monotonic()
        self.model: LoadedModel | None = None
        self.adapter: Any = None  # the LoRA Adapter it runs with (set at submission), or None
        self.weight_version = ""
        self.eos: frozenset[int] = frozenset()
        self.context_length = 0
        self.tokenizer: Any = None
        self.cache: Any = None
        self.generator = new_generator(params.seed)
        self.output_ids: list[int] = []
        self.output_logprobs: list[tuple[float, int]] = []
        self.output_top: list[TopList] = []
        self.input_logprobs: list[tuple[float | None, int]] = []
        self.input_top: list[TopList | None] = []
        self.finish: FinishReason | None = None
        self.abort_reason: str | None = None
        self.emitted_text = ""
        self.sent_tokens = 0
        self.prefilled = False
        self.constraint: Constraint | None = None

    # -- binding and delivery -------------------------------------------------------

    def bind(self, model: LoadedModel, version: str, tokenizer: Any, eos: frozenset[int], ctx: int) -> None:
        """Admit the job on `model`: it reports `version`, or the name of its adapter."""
        self.model, self.tokenizer = model, tokenizer
        self.weight_version = self.adapter.name if self.adapter is not None else version
        self.eos, self.context_length = eos, ctx
        self.cache = model.new_cache()
        if self.params.grammar is not None and self.constraint is None:
            self.constraint = Constraint(self.params.grammar, eos | self.params.stop_token_ids)

    def deliver(self, item: Snapshot | BaseException) -> None:
        """Hand an output to the waiting coroutine (safe from any thread)."""
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone: nobody is waiting any more
            pass

    # -- one step -------------------------------------------------------------------

    def step(self) -> None:
        """One forward pass and one sampled token (the first step also runs the prompt)."""
        assert self.model is not None
        p = self.params
        if not self.prefilled:
            logits = self._prefill()
            if p.max_new_tokens == 0:
                self.finish = {"type": "length", "length": 0}
                return
        else:
            logits = self.model.forward([self.output_ids[-1]], self.cache, 1, self.adapter)[-1]
        self.take(logits)

    def take(self, logits: torch.Tensor) -> None:
        """Sample the next token from this step's next-token logits (V,), and record it.
        (A decode step of the batch computes the logits for every member at once.)"""
        p = self.params
        c = self.constraint
        allowed = c.allowed(int(logits.shape[-1])) if c is not None else None
        token, lp = sample_token(logits, p.sampling, self.generator, allowed)
        if c is not None:
            c.accept(token)
        self.output_ids.append(token)
        if p.return_logprob:
            self.output_logprobs.append((lp, token))
            if p.top_logprobs_num > 0:
                scaled = scaled_logprobs(logits, p.sampling.temperature)
                self.output_top.append(top_logprobs(scaled, p.top_logprobs_num))
        self._check_finished()
        if self.finish is None and c is not None and c.terminated:
            self.finish = {"type": "stop", "matched": token}  # the grammar ended (ignore_eos too)

    def _prefill(self) -> torch.Tensor:
        assert self.model is not None
        p = self.params
        ids = p.input_ids
        want_input = p.return_logprob and p.logprob_start_len >= 0
        start = min(p.logprob_start_len, len(ids) - 1) if want_input else len(ids) - 1
        logits = self.model.forward(ids, self.cache, len(ids) - start, self.adapter)  # positions start..L-1
        self.prefilled = True
        if p.return_logprob:
            # SGLang's layout: from `start` on, the first entry has no log-prob (None).
            self.input_logprobs = [(None, ids[start])]
            self.input_top = [None]
            if len(ids) - start > 1:
                scaled = scaled_logprobs(logits[:-1], p.sampling.temperature)  # predicts start+1..L-1
                targets = torch.tensor(ids[start + 1 :], dtype=torch.long)
                picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()
                self.input_logprobs += list(zip(picked, ids[start + 1 :], strict=True))
                if p.top_logprobs_num > 0:
                    self.input_top += [top_logprobs(row, p.top_logprobs_num) for row in scaled]
        return logits[-1]

    def _check_finished(self) -> None:
        """SGLang's order: length, then a stop/EOS token, then a stop string, then context."""
        p = self.params
        n = len(self.output_ids)
        if p.max_new_tokens is not None and n >= p.max_new_tokens:
            self.finish = {"type": "length", "length": p.max_new_tokens}
            return
        last = self.output_ids[-1]
        if not p.ignore_eos and (last in p.stop_token_ids or last in self.eos):
            self.finish = {"type": "stop", "matched": last}
            return
        if p.stop:
            decoded = textmod.decode(self.tokenizer, self.output_ids, p.skip_special_tokens)
            matched = textmod.find_stop(decoded, p.stop)
            if matched is not None:
                self.finish = {"type": "stop", "matched": matched}
                return
        if len(p.input_ids) + n >= self.context_length:
            self.finish = {"type": "length", "length": n}

    # -- outputs --------------------------------------------------------------------

    def final_text(self) -> str:
        ids = self.output_ids
        matched = (self.finish or {}).get("matched")
        if isinstance(matched, int) and not self.params.no_stop_trim and ids:
            ids = ids[:-1]
        out = textmod.decode(self.tokenizer, ids, self.params.skip_special_tokens)
        if isinstance(matched, str) and not self.params.no_stop_trim:
            out = textmod.trim_at_stop(out, matched)
        return out

    def due(self) -> bool:
        """Whether a streamed chunk is due now (every `stream_interval` tokens, and at the end)."""
        if self.finish is not None:
            return True
        return self.params.stream and len(self.output_ids) - self.sent_tokens >= self.params.stream_interval

    def snapshot(self) -> Snapshot:
        if self.finish is not None:
            text = self.final_text()
        else:
            full = textmod.decode(self.tokenizer, self.output_ids, self.params.skip_special_tokens)
            text = textmod.stable_text(full, self.params.stop, self.emitted_text)
        self.emitted_text = text
        self.sent_tokens = len(self.output_ids)
        done = self.finish is not None
        return Snapshot(
            rid=self.params.rid,
            output_ids=list(self.output_ids),
            text=text,
            output_logprobs=list(self.output_logprobs),
            output_top=list(self.output_top),
            input_logprobs=self.input_logprobs,
            input_top=self.input_top,
            finish=self.finish,
            prompt_tokens=len(self.params.input_ids),
            weight_version=self.weight_version,
            e2e_latency=round(time.monotonic() - self.created, 6) if done else None,
        )
