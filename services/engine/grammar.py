"""Grammar-constrained decoding for the CPU engine: JSON Schema, regex and EBNF via xgrammar.

A /generate request whose sampling params carry SGLang's `json_schema` or `ebnf` (and
`regex`, which this module compiles but protocol.py still refuses) is compiled once, off
the event loop, into an xgrammar `CompiledGrammar`
(`compile_grammar`); its job then holds a `Constraint` (one `GrammarMatcher`) that, at
every decoding step — prefill, one-by-one decode, or a row of the batched decode, all of
which sample through `Job.take` — gives the tokens the grammar allows next, and is
advanced by the token sampled. When the grammar is complete only the stop tokens (EOS
and the request's `stop_token_ids`) are allowed, so a grammar whose language is finite
forces the generation to end; the request also ends as soon as the matcher terminates,
even with `ignore_eos`. `json_schema: "$$ANY$$"` means any JSON value (SGLang's
convention); JSON whitespace is free but at most `MAX_WHITESPACE` characters per gap, so
a small model cannot wander off in whitespace forever; length-bounded strings are
compiled as patterns that keep control characters out (`_bounded_strings`).

**Log-probs under a grammar (the choice, and why).** The token is drawn from the masked
distribution (the grammar's tokens, renormalised), but the log-prob the engine reports
— and the collector records in the `Turn` for training — is the *unmasked*
full-vocabulary `log_softmax(logits / T)[token]`, the same value as without a grammar.
That is what the trainer recomputes (it has no grammar), so the PPO ratio starts at
exactly 1 and the behaviour log-probs mean the same thing for every sample. The masked
log-prob (what was literally sampled from) would exceed the trainer's value by the log
of the allowed mass at each step and make the ratio wrong from the first step. The
price is that a constrained sample is off-policy with respect to the unmasked policy;
the `Turn`'s `sampling.json_schema` / `.regex` record that it was constrained, so a
consumer can weigh or exclude such samples. Top log-probs are the unmasked ones too.

Library: xgrammar (what SGLang and vLLM use by default). Measured on this machine (one
thread) against outlines-core with a 3-field schema: SmolLM2's 49k vocabulary — 15 ms to
compile (outlines-core: 196 ms to build its index), 0.1–0.3 ms per step to fill the mask
(outlines-core: ~7 ms to turn its allowed-id list into a mask), and a whole constrained
step here (mask + masked sampling, median) 0.49 ms against 0.28 ms unconstrained — noise
beside a forward pass; the 518-token test tokenizer — ~1 ms to compile, 0.06 ms per
step. Importing xgrammar takes 1–2.5 s and building its tokenizer tables ~0.2 s (49k
vocabulary): both happen once, on the first constrained request, in a worker thread.
xgrammar is imported lazily so the engine runs without it; a constrained request then
gets a 400 saying what to install.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Literal

import torch

GrammarKind = Literal["json_schema", "regex", "ebnf"]
ANY_JSON = "$$ANY$$"  # SGLang: json_schema for any JSON value
MAX_WHITESPACE = 16  # characters of whitespace allowed in one gap of a JSON document


class GrammarError(ValueError):
    """The grammar cannot be used: invalid, or xgrammar is missing (HTTP 400)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request asked for, before compiling."""

    kind: GrammarKind
    source: str


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled grammar for one tokenizer; shareable across requests and threads."""

    spec: GrammarSpec
    compiled: Any  # xgrammar.CompiledGrammar
    vocab_size: int


class _Compiler:
    """One xgrammar compiler per (tokenizer, vocabulary size), with its own tokenizer copy
    (fast tokenizers are not shared across threads in this engine)."""

    def __init__(self, tokenizer_path: str, vocab_size: int) -> None:
        try:
            import xgrammar as xgr
        except ImportError:
            raise GrammarError(
                "constrained decoding (json_schema, regex, ebnf) needs xgrammar in the engine: "
                "pip install 'nextstate[engine]'"
            ) from None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        c = self._compiler
        with self._lock:
            try:
                if spec.kind == "json_schema":
                    if spec.source == ANY_JSON:
                        compiled = c.compile_builtin_json_grammar()
                    else:
                        schema = json.loads(spec.source)
                        if not isinstance(schema, dict):
                            raise GrammarError("json_schema must be a JSON object (a JSON Schema)")
                        compiled = c.compile_json_schema(
                            json.dumps(_bounded_strings(schema)), any_whitespace=True,
                            max_whitespace_cnt=MAX_WHITESPACE,
                        )  # fmt: skip
                elif spec.kind == "regex":
                    compiled = c.compile_regex(spec.source)
                else:
                    compiled = c.compile_grammar(spec.source)
            except GrammarError:
                raise
            except ValueError as exc:  # json.JSONDecodeError included
                raise GrammarError(f"{spec.kind} is invalid: {exc}") from None
            except RuntimeError as exc:  # xgrammar reports parse errors as RuntimeError
                raise GrammarError(f"{spec.kind} is invalid: {_first_line(exc)}") from None
        return CompiledGrammar(spec, compiled, self.vocab_size)


_LITERAL_KEYS = frozenset({"enum", "const", "default", "examples"})  # values, not schemas


def _bounded_strings(node: Any) -> Any:
    """A copy of a schema whose length-bounded strings (minLength / maxLength, no pattern or
    format) become the equivalent pattern over JSON-safe characters.

    xgrammar (0.2.9) compiles a length-bounded string to a character class that admits raw
    control characters (U+0000–U+001F), which JSON forbids inside strings: strict parsers
    (Python's json, JavaScript's JSON.parse) then reject the answer. Its unbounded strings
    exclude them already. The pattern keeps the bounds and leaves out control characters,
    quotes and backslashes (the bounded class already had no escapes).
    """
    if isinstance(node, list):
        return [_bounded_strings(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in _LITERAL_KEYS else _bounded_strings(v)) for k, v in node.items()}
    lo, hi = out.get("minLength"), out.get("maxLength")
    if (
        out.get("type") == "string"
        and (lo is not None or hi is not None)
        and not any(k in out for k in ("pattern", "format", "enum", "const"))
        and all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) for v in (lo, hi))
    ):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{lo or 0},{"" if hi is None else hi}}}$'
    return out


_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[15:50:50] /project/cpp/x.cc:94: "


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return _CPP_PREFIX.sub("", text[0])[:500] if text else type(exc).__name__


_COMPILERS: dict[tuple[str, int], _Compiler] = {}
_COMPILERS_LOCK = threading.Lock()


def compile_grammar(spec: GrammarSpec, tokenizer_path: str, vocab_size: int) -> CompiledGrammar:
    """Compile `spec` for the model's tokenizer (blocking: call it in a worker thread)."""
    key = (tokenizer_path, vocab_size)
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(key)
        if compiler is None:
            compiler = _COMPILERS[key] = _Compiler(tokenizer_path, vocab_size)
    return compiler.compile(spec)


class Constraint:
    """One request's position in its grammar (used by the model thread only)."""

    def __init__(self, grammar: CompiledGrammar, stop_token_ids: frozenset[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        stops = sorted(t for t in stop_token_ids if 0 <= t < grammar.vocab_size)
        self._matcher = xgr.GrammarMatcher(grammar.compiled, override_stop_tokens=stops or None)
        self._bitmask = xgr.allocate_token_bitmask(1, grammar.vocab_size)
        self._shifts = torch.arange(32, dtype=torch.int32)
        self.vocab_size = grammar.vocab_size

    def allowed(self, vocab: int) -> torch.Tensor:
        """The tokens the grammar allows next, as a (vocab,) bool mask (ids past the
        tokenizer's vocabulary, e.g. padded embedding rows, are never allowed)."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        bits = (self._bitmask[0].unsqueeze(-1) >> self._shifts) & 1  # (ceil(V/32), 32)
        mask = bits.to(torch.bool).flatten()[: self.vocab_size]
        if vocab > self.vocab_size:
            mask = torch.cat([mask, mask.new_zeros(vocab - self.vocab_size)])
        return mask[:vocab]

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise GrammarError(f"the grammar rejected token {token}, which its mask allowed")

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the request ends."""
        return bool(self._matcher.is_terminated())
