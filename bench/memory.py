"""Memory that fits: the chunked log-probs' peak against the plain form's, and the memory plan.

1. `losses.token_logprobs` over (tokens × vocab) bf16 logits, forward + backward, chunked
   (services/trainer/logprobs.py) and plain (two fp32 copies of the logits, one kept for
   the backward). Each variant runs in a fresh process; its peak is the process's peak
   resident memory (ru_maxrss) minus what it held once the logits and their inputs were
   allocated, so the figure is the extra memory the log-probs need (the logits' bf16
   gradient included: every variant makes it). glibc's mmap threshold is pinned at 64 KiB
   (MALLOC_MMAP_THRESHOLD_) so that every freed tensor goes back to the system and the
   peak is the real high-water mark, not the heap's leftovers.
2. The memory plan (services/trainer/memory.py) of the Qwen3 shapes at 8 × 2,048 tokens
   (micro-batch 8,192): full fine-tuning in bf16 with fp32 masters, and LoRA r16; with
   and without activation checkpointing.
3. Instead, with `--reference SHAPE` (a Qwen3 shape, random bf16 weights; `tiny` on a CPU): the KL
   reference's no-grad forward over `--ref-tokens` tokens, resident on the device and
   streamed from the CPU (services/trainer/reference.py): seconds per forward, the
   device's peak memory (CUDA), and whether the log-probs agree to the bit.

Usage: python bench/memory.py [--tokens 2048] [--vocab 50000] [--repeat 3]
       python bench/memory.py --reference qwen3-1.7b [--ref-tokens 8192]   (on a GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from services.trainer.logprobs import CHUNK_BYTES

QWEN3 = {  # config.json of the Qwen3 dense models (vocabulary 151,936); tiny: a CPU stand-in
    "tiny": (256, 4, 4, 2, 768, True),
    "Qwen3-0.6B": (1024, 28, 16, 8, 3072, True),
    "Qwen3-1.7B": (2048, 28, 16, 8, 6144, True),
    "Qwen3-4B": (2560, 36, 32, 8, 9728, True),
    "Qwen3-8B": (4096, 36, 32, 8, 12288, False),
}


def one_run(variant: str, tokens: int, vocab: int, chunk_mib: int) -> dict[str, float]:
    """In this process: allocate the logits, then time and measure one forward + backward."""
    import torch

    from services.trainer.logprobs import chunk_rows, chunked_token_logprobs, plain_token_logprobs

    torch.set_num_threads(1)
    torch.manual_seed(0)
    logits = torch.randn(1, tokens, vocab, dtype=torch.bfloat16).mul_(3).requires_grad_()  # no fp32 detour
    targets = torch.randint(0, vocab, (1, tokens))
    temps, weights = torch.full((1,), 0.8), torch.randn(1, tokens)
    rows = chunk_rows(vocab, chunk_mib * 2**20)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.perf_counter()
    if variant == "chunked":
        logp = chunked_token_logprobs(logits, targets, temps, rows)
    else:
        logp = plain_token_logprobs(logits, targets, temps)
    (logp * weights).sum().backward()  # type: ignore[no-untyped-call]
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"extra_bytes": float(peak - base), "seconds": seconds, "logits_bytes": float(logits.nbytes)}


def measure(variant: str, tokens: int, vocab: int, chunk_mib: int) -> dict[str, float]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", variant, "--tokens", str(tokens), "--vocab", str(vocab),
         "--chunk-mib", str(chunk_mib)],
        check=True, capture_output=True, text=True, env=env,
    )  # fmt: skip
    result: dict[str, float] = json.loads(out.stdout)
    return result


def logprobs_table(tokens: int, vocab: int, repeat: int) -> None:
    print(f"token_logprobs, forward + backward, {tokens} tokens x {vocab} vocabulary, bf16 logits "
          f"({tokens * vocab * 2 / 2**20:.0f} MiB; their bf16 gradient is as much again in every variant); "
          f"median of {repeat} fresh processes")
    for variant, mib in (("plain", 0), ("chunked", CHUNK_BYTES // 2**20), ("chunked", 128), ("chunked", 4)):
        runs = [measure(variant, tokens, vocab, mib) for _ in range(repeat)]
        extra = statistics.median(r["extra_bytes"] for r in runs)
        secs = statistics.median(r["seconds"] for r in runs)
        label = variant if variant == "plain" else f"{variant} ({mib} MiB chunks)"
        print(f"  {label:26s} peak extra {extra / 2**20:6.0f} MiB ({extra / runs[0]['logits_bytes']:.2f}x the "
              f"logits)   {secs:.2f} s")


def plan_table() -> None:
    from services.trainer.memory import GiB, Lora, Shape, plan

    print("\nmemory plan, bf16 compute, micro-batch 8,192 tokens (GiB; peak = the larger of the backward and "
          "the optimizer step)")
    print(f"  {'model':12s} {'params':>7s} {'full':>7s} {'full+ckpt':>9s} {'16B+ckpt':>9s} {'lora16':>7s} "
          f"{'lora16+ckpt':>11s} {'lora 16k+ckpt':>13s}")
    for name, (h, layers, heads, kv, inter, tied) in QWEN3.items():
        if name == "tiny":
            continue
        s = Shape(vocab=151_936, hidden=h, layers=layers, heads=heads, kv_heads=kv, head_dim=128,
                  intermediate=inter, tied=tied, qk_norm=True)
        full = plan(s, e=2, tokens=8192)
        ckpt = plan(s, e=2, tokens=8192, checkpointing=True)
        sixteen = ckpt.backward_peak - ckpt.master // 2  # without the masters' fp32 gradient
        lora = plan(s, e=2, tokens=8192, lora=Lora(16))
        lora_ckpt = plan(s, e=2, tokens=8192, lora=Lora(16), checkpointing=True)
        long = plan(s, e=2, tokens=16384, lora=Lora(16), checkpointing=True)
        print(f"  {name:12s} {s.params() / 1e9:6.2f}B {full.peak / GiB:7.1f} {ckpt.peak / GiB:9.1f} "
              f"{sixteen / GiB:9.1f} {lora.peak / GiB:7.1f} {lora_ckpt.peak / GiB:11.1f} {long.peak / GiB:13.1f}")


def reference_table(name: str, tokens: int, repeat: int) -> None:
    import copy

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from services.trainer.losses import token_logprobs
    from services.trainer.model import freeze
    from services.trainer.reference import stream_layers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    h, layers, heads, kv, inter, tied = next(v for k, v in QWEN3.items() if k.lower() == name.lower())
    config = Qwen3Config(vocab_size=151_936, hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=128, intermediate_size=inter, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model: Any = Qwen3ForCausalLM(config)
    base = freeze(model.to(torch.bfloat16))
    ids = torch.randint(0, 151_936, (1, tokens + 1), device=device)
    temps = torch.ones(1, device=device)

    def forward(model: object) -> tuple[torch.Tensor, float, int]:
        times, peak, out = [], 0, torch.empty(0)
        for _ in range(repeat):
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            started = time.perf_counter()
            with torch.no_grad():
                logits = model(input_ids=ids[:, :-1], use_cache=False).logits  # type: ignore[operator]
                out = token_logprobs(logits, ids[:, 1:], temps)
                del logits
            if device.type == "cuda":
                torch.cuda.synchronize()
                peak = max(peak, torch.cuda.max_memory_allocated() - before)
            times.append(time.perf_counter() - started)
        return out, statistics.median(times[1:] or times), peak

    resident = copy.deepcopy(base).to(device)
    resident_bytes = sum(p.numel() * p.element_size() for p in resident.parameters())
    want, t_resident, p_resident = forward(resident)
    del resident
    stream_layers(base, device)
    on_device = sum(p.numel() * p.element_size() for p in base.parameters() if p.device.type == device.type)
    got, t_streamed, p_streamed = forward(base)
    print(f"\nKL reference forward, {name} ({sum(p.numel() for p in base.parameters()) / 1e9:.2f}B, bf16), "
          f"{tokens} tokens, {device.type}; median of {repeat} (the first excluded)")
    print(f"  resident  weights on the device {resident_bytes / 2**30:6.2f} GiB, forward peak above them "
          f"{p_resident / 2**30:6.2f} GiB, {t_resident:.3f} s")
    print(f"  streamed  weights on the device {on_device / 2**30:6.2f} GiB (+2 layers in flight), forward peak "
          f"{p_streamed / 2**30:6.2f} GiB, {t_streamed:.3f} s; log-probs identical: {torch.equal(got, want)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=50_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--reference", help="instead: time the KL reference resident vs streamed for this shape "
                    "(qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, tiny)")
    ap.add_argument("--ref-tokens", type=int, default=8192)
    ap.add_argument("--child", choices=["plain", "chunked"], help=argparse.SUPPRESS)
    ap.add_argument("--chunk-mib", type=int, default=CHUNK_BYTES // 2**20, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_run(args.child, args.tokens, args.vocab, args.chunk_mib)))
        return
    if args.reference:  # the reference alone (a GPU session's check)
        reference_table(args.reference, args.ref_tokens, args.repeat)
        return
    logprobs_table(args.tokens, args.vocab, args.repeat)
    plan_table()


if __name__ == "__main__":
    main()
