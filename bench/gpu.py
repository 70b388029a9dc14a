"""The trainer on a GPU (or a CPU): speed, memory, whether a step moves the weights, the
train/inference mismatch at step 0, and what a version costs — for given model shapes.

Each shape is a randomly initialised Qwen3 (transformers' `Qwen3Config`: the published 0.6B,
1.7B, 4B and 8B shapes, and `tiny` / `small` ones that run in seconds / about a minute on 2
CPU cores) whose final norm weight is scaled ×10, so its logits have a trained model's
scale. Per shape, with the trainer's own code (`Trainer.step`, `make_optimizer(..., "auto")`:
fp32 master weights for a bf16 model, services/trainer/precision.py):

1. rollouts: `--batch` samples of `--seq` tokens, the first half a random prompt, the
   second half sampled from the model (temperature 1, KV cache) in the engine's dtype
   (`--engine-dtype`, bf16), then scored once per sample in that dtype under no_grad
   (`window_logprobs` on a `collate`d micro-batch): the behaviour log-probs; rewards ±1.
2. β = 0 (`LossConfig(kl_beta=0.0)`, lr 1e-6): `--steps` steps on that batch (step i at
   version i; the samples are version 0). Step 0 warms up and gives
   - the mismatch: the trainer's `mismatch_abs_log_ratio` (mean |log ρ|),
     `mismatch_ratio_min` / `_max` and `mismatch_outside_frac` (outside [0.8, 1.28]);
   - the fraction of weight elements the step changed: of what the optimizer steps (the
     fp32 masters, or the fp32 parameters themselves) and of the model's parameters in the
     compute dtype, matrices and vectors (norms) apart.
   The other steps are timed (median) and their peak memory taken:
   - CUDA: `torch.cuda.max_memory_allocated` (absolute: weights, state, activations);
   - CPU: the process's peak RSS (VmHWM in /proc/self/status, reset through
     /proc/self/clear_refs before the timed steps) above its RSS before the model was built.
   Beside it, the trainer's memory plan (services/trainer/memory.py) for the same run.
3. a version: `export_state_dict` + `save_hf_folder` into a temporary folder in
   `--publish-dtype` (with `--lora`: `adapter_state` + `save_adapter_folder`, the default
   LORA_PUBLISH=adapter): seconds and bytes on disk.
4. β = `--kl-beta` (the service's default 0.02) with a fresh optimizer: full fine-tuning
   gets a frozen, resident copy of the base (LoRA: the base with adapters off): s/step as a
   ratio to β = 0's in the same run, and its peak.

Model FLOPs per step (model FLOPs, not hardware FLOPs: the KL reference's forward and the
recomputation of activation checkpointing are not counted):

    F = c · (N_layers · T + V · h · T_resp) + 6 · L · d_q · Σ_i s_i²

N_layers: the decoder layers' matrix parameters; T: tokens read; V · h: the LM head, applied
to the T_resp response positions only (the trainer's logits window); the attention term is
causal (QKᵀ and AV, forward + backward) over samples of s_i tokens, L layers, d_q = heads ×
head_dim; c = 6 (forward 2 + backward 4), 4 with LoRA (frozen matrices get no weight
gradient). Utilisation = F / s per step / the device's dense bf16 peak (`PEAK_BF16`; an
unknown device or a compute dtype other than bf16/fp16: not reported).

Usage:
    python bench/gpu.py                                   # CPU: tiny,small; CUDA: qwen3-0.6b,1.7b,4b
    python bench/gpu.py --shapes tiny,small --threads 2 --json cpu.json
    python bench/gpu.py --shapes qwen3-0.6b,qwen3-1.7b,qwen3-4b --json gpu.json   # on a GPU
    python bench/gpu.py --shapes qwen3-8b --lora 16
Needs the project's Python packages (torch, transformers, peft, pydantic, safetensors); no
network: every model is built from its config.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch

from services.trainer.batching import collate, pack
from services.trainer.fit import CHECKPOINTING_ABOVE, enable_activation_checkpointing
from services.trainer.memory import GiB, Lora, Shape, plan
from services.trainer.model import (
    LoraSpec,
    adapter_state,
    add_lora,
    export_state_dict,
    freeze,
    resolve_device,
    resolve_dtype,
    save_adapter_folder,
    save_hf_folder,
    trainable_parameters,
    window_logprobs,
)
from services.trainer.precision import needs_masters
from services.trainer.step import LossConfig, OptimConfig, Trainer, make_optimizer
from shared.schemas import TrainSample

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=2048, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
    # the published Qwen3 configs
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}  # fmt: skip
SHARPEN = 10.0  # final norm weight ×10: logits of a trained model's scale
# Dense bf16 tensor-core peaks (NVIDIA datasheets), by a substring of the device's name; the
# first match wins (H100 PCIe before H100 SXM).
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


def device_peak(name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16 if key in name), None)


def build_model(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """A random Qwen3 of shape `name` on `device`, final norm ×SHARPEN, in eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM, Qwen3Config

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]

    config = Qwen3Config(**SHAPES[name], max_position_embeddings=40960, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    with device:
        model: Any = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        model.model.norm.weight.mul_(SHARPEN)
    model.eval()  # as load_causal_lm: no dropout
    return model


@torch.no_grad()
def sample_responses(model: Any, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """n tokens per prompt sampled at temperature 1 with a KV cache, as an engine decodes.  (B, n)"""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)  # filled in place; passed 4th, whose name
    logits = model(prompts, None, None, cache, use_cache=True, logits_to_keep=1).logits  # changed in 5.x
    picked = []
    for i in range(n):
        picked.append(torch.multinomial(torch.softmax(logits[:, -1].float(), dim=-1), 1))
        if i + 1 < n:
            logits = model(picked[-1], None, None, cache, use_cache=True).logits
    return torch.cat(picked, dim=1)


@torch.no_grad()
def rollouts(engine: Any, batch: int, seq: int, vocab: int, device: torch.device, seed: int) -> list[TrainSample]:
    """`batch` samples: a random prompt of seq/2 tokens, a sampled response of the rest, its
    behaviour log-probs scored by `engine` one sample at a time; rewards ±1."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    p = seq // 2
    prompts = torch.tensor([[rng.randrange(vocab) for _ in range(p)] for _ in range(batch)], device=device)
    responses = sample_responses(engine, prompts, seq - p)
    samples = []
    for prompt, response in zip(prompts.tolist(), responses.tolist(), strict=True):
        s = TrainSample(session_id="bench", tokens=prompt + response, response_length=len(response),
                        loss_mask=[1] * len(response), reward=rng.choice([1.0, -1.0]), temperature=1.0)
        mb = collate([s], "rl", device)
        assert mb is not None
        lp = window_logprobs(engine, mb)[0][mb.mask[0].bool()]
        samples.append(s.model_copy(update={"rollout_logprobs": lp.float().tolist()}))
    return samples


class PeakMemory:
    """Peak memory of a stretch of work: on CUDA `max_memory_allocated` (absolute); on a CPU
    the peak RSS (VmHWM, reset through /proc/self/clear_refs) above the RSS at `__init__`."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.base = 0 if self.cuda else self._status("VmRSS")

    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(field)

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated()) if self.cuda else self._status("VmHWM") - self.base


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def changed_fraction(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> float | None:
    """The fraction of elements that differ (None: no tensors)."""
    total = sum(b.numel() for b in before)
    if total == 0:
        return None
    diff = sum(int((a.detach() != b.to(a.device)).sum()) for a, b in zip(after, before, strict=True))
    return diff / total


def model_flops(model: Any, samples: list[TrainSample], lora: bool) -> float:
    """F = c·(N_layers·T + V·h·T_resp) + 6·L·d_q·Σ s² (the module docstring)."""
    cfg = model.config
    layers = [p for n, p in model.named_parameters()
              if p.dim() == 2 and ".layers." in n and "lora_" not in n]  # fmt: skip
    n_layers = sum(p.numel() for p in layers)
    tokens = sum(len(s.tokens) for s in samples)
    responses = sum(s.response_length for s in samples)
    c = 4 if lora else 6
    d_q = cfg.num_attention_heads * cfg.head_dim
    attention = 6 * cfg.num_hidden_layers * d_q * sum(len(s.tokens) ** 2 for s in samples)
    return float(c * (n_layers * tokens + cfg.vocab_size * cfg.hidden_size * responses) + attention)


def memory_plan(model: Any, dtype: torch.dtype, tokens: int, lora: int, reference: str, ckpt: bool) -> float:
    """The trainer's own plan (services/trainer/memory.py) for this run, in GiB."""
    e = torch.empty((), dtype=dtype).element_size()
    config = model.get_base_model().config if lora else model.config
    p = plan(Shape.from_config(config), e=e, tokens=tokens, lora=Lora(lora) if lora else None,
             master_weights=e < 4, checkpointing=ckpt, reference=reference)
    return p.peak / GiB


def run_steps(trainer: Trainer, samples: list[TrainSample], steps: int, device: torch.device,
              meter: PeakMemory, first: Any = None) -> dict[str, Any]:  # fmt: skip
    """`steps` steps (step i at version i); `first(metrics)` runs after step 0. The peak and
    median time are over the steps after the first (over the first when there is one)."""
    times, res = [], {}
    meter.reset()
    for i in range(steps):
        sync(device)
        t = time.perf_counter()
        metrics = trainer.step(samples, version=i)
        sync(device)
        times.append(time.perf_counter() - t)
        if i == 0:
            res["first_step_s"] = times[0]
            if first is not None:
                res.update(first(metrics))
            if steps > 1:
                meter.reset()
    timed = times[1:] or times
    res.update(step_s=statistics.median(timed), peak_bytes=meter.peak(), steps_timed=len(timed))
    return res


def publish(model: Any, lora: int, dtype: torch.dtype | None) -> dict[str, Any]:
    """One version as the trainer writes it, into a temporary folder: seconds and bytes."""
    with tempfile.TemporaryDirectory(prefix="nextstate-bench-") as tmp:
        dest = Path(tmp) / "v1"
        t = time.perf_counter()
        if lora:
            save_adapter_folder(model, adapter_state(model), dest, base_model="bench", dtype=dtype)
        else:
            save_hf_folder(model, export_state_dict(model), dest, None, dtype=dtype)
        seconds = time.perf_counter() - t
        size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    return {"version_s": seconds, "version_bytes": size, "version_format": "adapter" if lora else "full"}


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_shape(
    name: str, device: torch.device, dtype: torch.dtype, *, batch: int = 8, seq: int = 2048,
    lora: int = 0, steps: int = 3, lr: float = 1e-6, kl_beta: float = 0.02,
    engine_dtype: torch.dtype = torch.bfloat16, publish_dtype: torch.dtype | None = torch.bfloat16,
    checkpointing: str = "auto", micro_batch_tokens: int = 8192, seed: int = 0,
) -> dict[str, Any]:
    """Every figure of the module docstring for one shape, as a dict (seconds, bytes, fractions)."""
    meter = PeakMemory(device)
    model = build_model(name, device, dtype, seed)
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    res: dict[str, Any] = {"shape": name, "params": params, "device": str(device), "dtype": str(dtype)[6:],
                           "engine_dtype": str(engine_dtype)[6:], "batch": batch, "seq": seq, "lora": lora,
                           "lr": lr, "micro_batch_tokens": micro_batch_tokens}  # fmt: skip
    t = time.perf_counter()
    engine = model if engine_dtype == dtype else build_model(name, device, engine_dtype, seed)
    samples = rollouts(engine, batch, seq, cfg.vocab_size, device, seed)
    res["rollout_s"] = time.perf_counter() - t
    del engine
    free(device)
    if lora:
        model = add_lora(model, LoraSpec(rank=lora, alpha=2 * lora))
    ckpt = checkpointing == "true" or (checkpointing == "auto" and params > CHECKPOINTING_ABOVE)
    if ckpt:
        enable_activation_checkpointing(model)
    res["checkpointing"] = ckpt
    mb_tokens = max(len(g) * seq for g in pack([len(s.tokens) for s in samples], micro_batch_tokens))
    flops = model_flops(model, samples, bool(lora))
    optim = OptimConfig(lr=lr)

    # -- β = 0: the weight change and the mismatch at step 0, then speed and memory
    optimizer = make_optimizer(model, optim, "auto")
    trainer = Trainer(model, optimizer, LossConfig(kl_beta=0.0), optim,
                      micro_batch_tokens=micro_batch_tokens, device=device)
    res["master_weights"] = needs_masters(trainable_parameters(model), "auto")
    stepped = list(trainer.params)  # the fp32 masters, or the model's own parameters
    weights = trainable_parameters(model)
    before_stepped = [p.detach().to("cpu", copy=True) for p in stepped]
    same = all(a is b for a, b in zip(stepped, weights, strict=True))
    before_weights = before_stepped if same else [p.detach().to("cpu", copy=True) for p in weights]

    def first(metrics: dict[str, float]) -> dict[str, Any]:
        mats = [i for i, p in enumerate(weights) if p.dim() >= 2]
        vecs = [i for i, p in enumerate(weights) if p.dim() < 2]
        out = {
            "changed_stepped": changed_fraction(before_stepped, stepped),
            "changed_weights_matrices": changed_fraction([before_weights[i] for i in mats], [weights[i] for i in mats]),
            "changed_weights_vectors": changed_fraction([before_weights[i] for i in vecs], [weights[i] for i in vecs]),
        }  # fmt: skip
        before_stepped.clear()
        before_weights.clear()
        for key in ("mismatch_tokens", "mismatch_abs_log_ratio", "mismatch_ratio_min", "mismatch_ratio_max",
                    "mismatch_outside_frac", "grad_norm"):  # fmt: skip
            out[key] = metrics.get(key)
        return out

    res.update(run_steps(trainer, samples, steps, device, meter, first))
    res["tokens_per_s"] = batch * seq / res["step_s"]
    res["model_flops_per_step"] = flops
    res["model_flops_per_s"] = flops / res["step_s"]
    peak = device_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    low = dtype in (torch.bfloat16, torch.float16)
    res["device_peak_flops"] = peak if low else None
    res["utilisation"] = res["model_flops_per_s"] / peak if peak and low else None
    res["plan_bytes"] = memory_plan(model, dtype, mb_tokens, lora, "none", ckpt) * GiB
    res.update(publish(model, lora, publish_dtype))
    trainer = optimizer = None  # type: ignore[assignment]
    free(device)

    # -- β > 0: a fresh optimizer; the reference a resident frozen base (LoRA: adapters off)
    if kl_beta > 0:
        reference = "none" if lora else "device"
        res.update(kl_beta=kl_beta, kl_plan_bytes=memory_plan(model, dtype, mb_tokens, lora, reference, ckpt) * GiB)
        try:
            kl = kl_variant(model, name, dtype, seed, bool(lora), kl_beta, optim, samples, steps, micro_batch_tokens,
                            device, meter)  # fmt: skip
            res.update(kl_step_s=kl["step_s"], kl_peak_bytes=kl["peak_bytes"], kl_vs_beta0=kl["step_s"] / res["step_s"])
        except torch.OutOfMemoryError as exc:  # β = 0's figures stand
            res["kl_error"] = f"out of memory: {str(exc).splitlines()[0]}"
    model = None
    free(device)
    return res


def kl_variant(model: Any, name: str, dtype: torch.dtype, seed: int, lora: bool, kl_beta: float,
               optim: OptimConfig, samples: list[TrainSample], steps: int, micro_batch_tokens: int,
               device: torch.device, meter: PeakMemory) -> dict[str, Any]:  # fmt: skip
    """The steps again with β > 0, a fresh optimizer and the trainer's reference."""
    reference = None if lora else freeze(build_model(name, device, dtype, seed))
    trainer = Trainer(model, make_optimizer(model, optim, "auto"), LossConfig(kl_beta=kl_beta), optim,
                      reference=reference, micro_batch_tokens=micro_batch_tokens, device=device)  # fmt: skip
    return run_steps(trainer, samples, steps, device, meter)


def fmt(x: Any, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x / scale, spec)


def print_tables(rows: list[dict[str, Any]]) -> None:
    print("\nspeed and memory (peak: CUDA max_memory_allocated; CPU peak RSS above the RSS before the model)")
    print(f"{'shape':<12}{'params':>9}{'dtype':>10}{'s/step':>9}{'tok/s':>9}{'TFLOP/s':>9}{'util':>7}"
          f"{'peak GiB':>10}{'plan GiB':>10}{'KL s/step':>11}{'KL/β=0':>8}{'KL peak':>9}{'KL plan':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<12} {r['error']}")
            continue
        ratio = fmt(r.get("kl_vs_beta0"), ".2f") + ("x" if r.get("kl_vs_beta0") else "")
        print(f"{r['shape']:<12}{r['params'] / 1e6:>8.1f}M{r['dtype']:>10}{r['step_s']:>9.3f}{r['tokens_per_s']:>9.0f}"
              f"{fmt(r['model_flops_per_s'], '.3f', 1e12):>9}{fmt(r['utilisation'], '.1%'):>7}"
              f"{fmt(r['peak_bytes'], '.2f', GiB):>10}{fmt(r['plan_bytes'], '.2f', GiB):>10}"
              f"{fmt(r.get('kl_step_s'), '.3f'):>11}{ratio:>8}"
              f"{fmt(r.get('kl_peak_bytes'), '.2f', GiB):>9}{fmt(r.get('kl_plan_bytes'), '.2f', GiB):>9}")
        if "kl_error" in r:
            print(f"{'':<12} KL variant: {r['kl_error']}")
    print("\none step at lr {} (changed: stepped = what AdamW steps; weights = the model's, matrices / vectors);"
          " step-0 ratio ρ = π_trainer / π_engine; a version".format(rows[0].get("lr") if rows else ""))
    print(f"{'shape':<12}{'stepped':>9}{'matrices':>10}{'vectors':>9}{'|log ρ|':>9}{'ρ min':>8}{'ρ max':>8}"
          f"{'outside':>9}{'version':>10}{'MB':>10}{'s':>8}")
    for r in rows:
        if "error" in r:
            continue
        print(f"{r['shape']:<12}{fmt(r['changed_stepped'], '.2%'):>9}{fmt(r['changed_weights_matrices'], '.2%'):>10}"
              f"{fmt(r['changed_weights_vectors'], '.2%'):>9}{fmt(r['mismatch_abs_log_ratio'], '.4f'):>9}"
              f"{fmt(r['mismatch_ratio_min'], '.3f'):>8}{fmt(r['mismatch_ratio_max'], '.3f'):>8}"
              f"{fmt(r['mismatch_outside_frac'], '.2%'):>9}{r['version_format']:>10}"
              f"{r['version_bytes'] / 1e6:>10.1f}{r['version_s']:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="", help=f"comma-separated, of {', '.join(SHAPES)} "
                    "(default: tiny,small on a CPU; qwen3-0.6b,qwen3-1.7b,qwen3-4b on CUDA)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="the trainer's compute dtype (auto: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--engine-dtype", default="bfloat16", help="the dtype the rollouts are sampled and scored in")
    ap.add_argument("--publish-dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=8, help="samples per step")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sample (default: 2048 on CUDA, 512 on CPU)")
    ap.add_argument("--lora", type=int, default=0, metavar="R", help="LoRA rank (0: full fine-tuning)")
    ap.add_argument("--steps", type=int, default=3, help="steps per variant; the first warms up")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--kl-beta", type=float, default=0.02, help="the KL variant's β (0: skip it)")
    ap.add_argument("--checkpointing", choices=("auto", "true", "false"), default="auto",
                    help="activation checkpointing (auto: above 3B parameters, as the trainer)")
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2, help="torch threads on a CPU")
    ap.add_argument("--json", type=Path, default=None, help="write every figure here (after each shape)")
    args = ap.parse_args()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(args.threads)
    shapes = (args.shapes or ("qwen3-0.6b,qwen3-1.7b,qwen3-4b" if cuda else "tiny,small")).split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}: choose from {', '.join(SHAPES)}")
    seq = args.seq or (2048 if cuda else 512)
    where = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {where}; torch {torch.__version__}; {args.batch} samples x {seq} tokens; "
          f"{'LoRA r' + str(args.lora) if args.lora else 'full fine-tuning'}, lr {args.lr}, {args.steps} steps")
    rows: list[dict[str, Any]] = []
    for name in shapes:
        try:
            r = bench_shape(name, device, dtype, batch=args.batch, seq=seq, lora=args.lora, steps=args.steps,
                            lr=args.lr, kl_beta=args.kl_beta, engine_dtype=resolve_dtype(args.engine_dtype, device),
                            publish_dtype=resolve_dtype(args.publish_dtype, device), checkpointing=args.checkpointing,
                            micro_batch_tokens=args.micro_batch_tokens)  # fmt: skip
        except torch.OutOfMemoryError as exc:  # the next shape may still fit
            r = {"shape": name, "error": f"out of memory: {str(exc).splitlines()[0]}"}
        free(device)  # after the except block: its traceback no longer holds the tensors
        rows.append(r)
        print(f"{name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
              flush=True)
        if args.json:
            args.json.write_text(json.dumps({"device": where, "torch": torch.__version__, "rows": rows}, indent=1))
    print_tables(rows)


if __name__ == "__main__":
    main()
