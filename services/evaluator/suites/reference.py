"""Drift's reference: continuations sampled from the base model once, with their log-probs.

The base model is loaded with transformers on CPU in float32 (as our engine computes
log-probs), never through the evaluation engine, which serves the candidate. For each
prompt the continuation is sampled at temperature 1 from the FULL distribution (no
top-k, top-p or repetition penalty, whatever the model's generation_config says), so the
tokens are draws from p_base as the KL estimator needs; it stops after `max_new_tokens`
or at a stop token (kept: it was sampled too). Each sample has its own seeded
`torch.Generator`, so a reference depends only on (base weights, prompt ids, seed,
max_new_tokens). The log-probs of the continuation are then computed teacher-forced,
in one forward pass over prompt + continuation, the same way the engine scores them.

A reference is cached as JSON in `<local_dir>/drift-reference/<key>.json`, the key a
hash of the base model's fingerprint (shared/runs.py), the prompt ids, the seed and the
length, and written atomically (temp file, rename): computed once per base model and
setting, whoever asks. A file that does not parse or does not match its key is
recomputed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from shared.cpus import default_threads
from shared.runs import IDENTITY_FILES, WEIGHT_SUFFIXES, model_fingerprint

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what a reference holds or how it is sampled changes
FOLDER = "drift-reference"

_lock = threading.Lock()  # one computation at a time per process (they are CPU-bound)
_fingerprints: dict[tuple[Any, ...], str] = {}


class RefSample(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: int  # index into the suite's prompt list
    ids: list[int]  # prompt ids + the sampled continuation
    start: int  # where the continuation begins
    logprobs: list[float]  # log p_base of ids[start:], teacher-forced


class Reference(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: int = FORMAT
    key: str
    base_model: str
    fingerprint: str
    seed: int
    max_new_tokens: int
    samples: list[RefSample]


def fingerprint(model: str) -> str:
    """`model_fingerprint`, remembered while the folder's files keep their size and mtime
    (hashing a large model's weights takes a while)."""
    folder = Path(model)
    if not folder.is_dir():
        return model_fingerprint(model)
    stamp = tuple(
        (p.name, st.st_size, st.st_mtime_ns)
        for p in sorted(folder.iterdir())
        if p.is_file() and (p.name in IDENTITY_FILES or p.suffix in WEIGHT_SUFFIXES)
        for st in [p.stat()]
    )
    memo_key = (str(folder.resolve()), stamp)
    if memo_key not in _fingerprints:
        _fingerprints[memo_key] = model_fingerprint(folder)
    return _fingerprints[memo_key]


def reference_key(fp: str, prompts: Sequence[Sequence[int]], seed: int, max_new_tokens: int) -> str:
    spec = {"format": FORMAT, "fingerprint": fp, "prompts": [list(p) for p in prompts],
            "seed": seed, "max_new_tokens": max_new_tokens}  # fmt: skip
    return hashlib.sha256(json.dumps(spec, separators=(",", ":")).encode()).hexdigest()[:32]


def sample_seed(seed: int, i: int) -> int:
    """The generator seed of sample `i` of a run seeded `seed`."""
    digest = hashlib.sha256(f"drift:{seed}:{i}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def load_or_compute(
    base_model: str,
    prompts: Sequence[Sequence[int]],
    *,
    seed: int,
    max_new_tokens: int,
    stop_ids: Sequence[int],
    cache_dir: Path,
) -> tuple[Reference, bool]:
    """The reference for these prompts (sample i continues prompts[i]) and whether it
    came from the cache. Blocking (run it in a thread): it may load the base model."""
    with _lock:
        fp = fingerprint(base_model)
        key = reference_key(fp, prompts, seed, max_new_tokens)
        path = cache_dir / FOLDER / f"{key}.json"
        cached = _read(path, key)
        if cached is not None:
            return cached, True
        log.info("computing the drift reference", extra={"base_model": base_model, "key": key})
        samples = compute(base_model, prompts, seed=seed, max_new_tokens=max_new_tokens, stop_ids=stop_ids)
        ref = Reference(key=key, base_model=base_model, fingerprint=fp, seed=seed,
                        max_new_tokens=max_new_tokens, samples=samples)  # fmt: skip
        _write(path, ref)
        return ref, False


def _read(path: Path, key: str) -> Reference | None:
    try:
        ref = Reference.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValidationError) as exc:
        log.warning("drift reference %s unreadable, recomputing: %s", path, exc)
        return None
    if ref.key != key or ref.format != FORMAT:
        log.warning("drift reference %s is not for key %s, recomputing", path, key)
        return None
    return ref


def _write(path: Path, ref: Reference) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(ref.model_dump_json().encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def compute(
    base_model: str,
    prompts: Sequence[Sequence[int]],
    *,
    seed: int,
    max_new_tokens: int,
    stop_ids: Sequence[int],
) -> list[RefSample]:
    """Sample one continuation per prompt from the base model and score it (see the module)."""
    import inspect

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    if torch.get_num_threads() > default_threads():
        torch.set_num_threads(default_threads())  # share the machine (shared/cpus.py)
    local = Path(base_model).is_dir()
    model: Any = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32, local_files_only=local)
    model.eval()
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    stops = set(stop_ids)

    def new_cache() -> Any:
        try:
            return DynamicCache(config=model.config)
        except TypeError:  # older transformers
            return DynamicCache()

    out: list[RefSample] = []
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            gen = torch.Generator().manual_seed(sample_seed(seed, i))
            cache = new_cache()
            step = list(prompt)
            sampled: list[int] = []
            for _ in range(max_new_tokens):
                x = torch.tensor([step], dtype=torch.long)
                logits = model(input_ids=x, use_cache=True, **{cache_arg: cache}).logits[0, -1].float()
                token = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).item())
                sampled.append(token)
                if token in stops:
                    break
                step = [token]
            ids = [*prompt, *sampled]
            logprobs = teacher_logprobs(model, ids, len(prompt))
            out.append(RefSample(prompt=i, ids=ids, start=len(prompt), logprobs=logprobs))
    return out


def teacher_logprobs(model: Any, ids: Sequence[int], start: int) -> list[float]:
    """log p(ids[t] | ids[:t]) for t in [start, len(ids)), one forward pass, float32."""
    import torch

    x = torch.tensor([list(ids)], dtype=torch.long)
    logits = model(input_ids=x).logits[0, start - 1 : -1].float()  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)
    target = x[0, start:].unsqueeze(-1)  # (T, 1)
    return [float(v) for v in logp.gather(-1, target).squeeze(-1)]
