"""Trainer step overhead: the full policy-gradient step against a bare forward + backward.

Both sides see the same batches, split into the same micro-batches (same token counts,
same logits window), on the same randomly initialised Llama built from a config:

- bare:     forward → masked cross-entropy → backward, per micro-batch, on tensors
            collated beforehand (no optimizer, no clipping, nothing else)
- trainer:  `Trainer.step` as the service runs it: packing and collating the samples,
            forward, temperature log-probs, PPO ratio against the behaviour log-probs,
            asymmetric clip, (β > 0) the frozen reference's forward and k3 KL,
            backward with whole-batch normalisation, gradient clipping, AdamW, metrics

overhead = trainer seconds per batch / bare seconds per batch (same tokens), reported
for β = 0 (target ≤ 1.15×) and β = 0.02, where the reference forward is extra work by
design (about one more forward: roughly +1/3 of a forward + backward).
Runs are interleaved and the median of --repeat batches is taken.

Usage: python bench/trainer.py [--hidden 384] [--layers 4] [--vocab 8192] [--batch 16] [--repeat 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from services.trainer.batching import MicroBatch, collate, pack
from services.trainer.model import freeze
from services.trainer.step import LossConfig, OptimConfig, Trainer, make_optimizer
from shared.schemas import TrainSample


def build_model(hidden: int, layers: int, vocab: int, seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128), max_position_embeddings=1024,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(config)
    model.eval()  # no dropout, as the trainer runs it
    return model


def make_batch(rng: random.Random, n: int, vocab: int) -> list[TrainSample]:
    out = []
    for _ in range(n):
        p, r = rng.randint(96, 192), rng.randint(32, 96)
        out.append(TrainSample(
            session_id="bench", tokens=[rng.randrange(vocab) for _ in range(p + r)],
            response_length=r, loss_mask=[1] * r, reward=rng.choice([1.0, -1.0]),
            rollout_logprobs=[-rng.uniform(5, 12) for _ in range(r)], temperature=0.8,
        ))  # fmt: skip
    return out


def bare_step(model: Any, mbs: list[MicroBatch]) -> None:
    """Forward + masked cross-entropy + backward over prepared micro-batches: the floor."""
    total = sum(float(mb.mask.sum()) for mb in mbs)
    for mb in mbs:
        logits = model(input_ids=mb.input_ids, use_cache=False, logits_to_keep=mb.keep).logits
        nll = F.cross_entropy(logits.flatten(0, 1), mb.targets.flatten(), reduction="none")
        loss = (nll * mb.mask.flatten()).sum() / total
        loss.backward()  # type: ignore[no-untyped-call]
    model.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16, help="samples per batch")
    ap.add_argument("--micro-batch-tokens", type=int, default=1536)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model = build_model(args.hidden, args.layers, args.vocab)
    reference = freeze(build_model(args.hidden, args.layers, args.vocab))
    params = sum(p.numel() for p in model.parameters())
    rng = random.Random(0)
    batches = [make_batch(rng, args.batch, args.vocab) for _ in range(args.repeat + 1)]
    tokens = [sum(len(s.tokens) for s in b) for b in batches]
    optim = OptimConfig(lr=1e-6)
    trainers = {
        beta: Trainer(model, make_optimizer(model, optim), LossConfig(kl_beta=beta), optim,
                      reference=reference if beta else None,
                      micro_batch_tokens=args.micro_batch_tokens)
        for beta in (0.0, 0.02)
    }  # fmt: skip
    groups = [pack([len(s.tokens) for s in b], args.micro_batch_tokens) for b in batches]
    prepared = [
        [mb for g in gs if (mb := collate([b[i] for i in g], "rl")) is not None]
        for b, gs in zip(batches, groups, strict=True)
    ]
    print(f"model: Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab} "
          f"params={params / 1e6:.1f}M fp32, {args.threads} threads")
    print(f"batch: {args.batch} samples, {statistics.mean(tokens):.0f} tokens, "
          f"{statistics.mean(len(g) for g in groups):.1f} micro-batches of <= {args.micro_batch_tokens} padded tokens")

    times: dict[str, list[float]] = {"bare": [], "beta=0": [], "beta=0.02": []}
    for i, batch in enumerate(batches):  # batch 0 warms up every path
        t0 = time.perf_counter()
        bare_step(model, prepared[i])
        t1 = time.perf_counter()
        trainers[0.0].step(batch)
        t2 = time.perf_counter()
        trainers[0.02].step(batch)
        t3 = time.perf_counter()
        if i > 0:
            times["bare"].append(t1 - t0)
            times["beta=0"].append(t2 - t1)
            times["beta=0.02"].append(t3 - t2)

    mean_tokens = statistics.mean(tokens[1:])
    bare = statistics.median(times["bare"])
    print(f"{'':<12}{'s/batch':>9}{'tokens/s':>10}{'overhead':>10}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<12}{med:>9.3f}{mean_tokens / med:>10.0f}{med / bare:>9.2f}x")
    ratio = statistics.median(times["beta=0"]) / bare
    verdict = "ok" if ratio <= 1.15 else "ABOVE TARGET"
    print(f"trainer overhead at beta=0: {ratio:.2f}x (target <= 1.15x: {verdict}); "
          f"beta=0.02 adds the reference forward")


if __name__ == "__main__":
    main()
