"""The trainer's memory plan: what a step holds on the device, from the model's config alone.

Before a weight is loaded, the trainer reads the model folder's config.json and adds up
(docs/methods.md#memory):

    weights      every parameter in the compute dtype (e B: 2 in bf16, 4 in fp32)
    grads        a gradient per trainable parameter in the compute dtype, during a backward
    master       fp32 masters of low-precision trainable parameters (services/trainer/precision.py)
                 and their accumulated fp32 gradients: 4 + 4 B
    optimizer    AdamW's m and v: 8 B per trainable parameter (fp32 masters), 2e B without them
    step         the optimizer step's temporaries: foreach AdamW (torch's default on CUDA) makes
                 one fp32 tensor per parameter (4 B); the step runs after the backward, so the
                 peak is the larger of the two moments
    reference    the frozen KL reference: the whole model in e B on the device, or, streamed
                 from the CPU (services/trainer/reference.py), what lies outside the decoder
                 layers plus two layers; none with LoRA (the base with adapters off) or β = 0
    activations  what autograd keeps for the backward, per token and layer, for a Llama/Qwen
                 decoder layer with SDPA attention (the terms below were read off
                 `saved_tensors_hooks` on CPU and match it but for the rotary tables, which
                 they count per token; tests/unit/test_memory_plan.py); with activation
                 checkpointing, each layer's input (e·h) instead; plus one layer's worth
                 for the backward of the layer being recomputed or differentiated
    logits       (tokens × V) logits in e B and their gradient, plus the chunked log-probs'
                 fp32 chunks (services/trainer/logprobs.py); unchunked, 12 B × tokens × V more

So full fine-tuning costs 16 B per parameter between steps in fp32 (4 weight + 4 grad + 8
AdamW) and in bf16 with fp32 masters (2 + 2 + 4 + 8, plus the masters' 4 B gradient while a
batch accumulates: 20); LoRA costs e B per base parameter plus 16 B per adapter parameter.
The plan is meant to err high: `tokens` is the micro-batch's padded token budget and the
logits are counted over all of them. Not counted: the CUDA
context (outside what the device reports free), the allocator's fragmentation (`needs`
covers it), and architectures other than Llama-style decoders (MoE, other attention).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.trainer.logprobs import CHUNK_BYTES
from shared.errors import NextstateError

GiB = 2**30
FP32 = 4
CHUNK_FP32_COPIES = 3  # fp32 chunk-sized temporaries alive at once in the chunked log-probs
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Beyond the plan: cuBLAS workspaces, allocator rounding and fragmentation, and the plan's own
# error (it came within -3 %..+12 % of the peaks issue 30 measured on an H200: docs/methods.md#memory).
RESERVE = 1 * GiB
RESERVE_FRACTION = 0.05


def needs(peak: int) -> int:
    """The free bytes a plan of `peak` bytes asks for: the peak plus the reserve."""
    return peak + RESERVE + int(RESERVE_FRACTION * peak)


class DoesNotFit(NextstateError):
    """The memory plan needs more than the device has free; the message says what would fit."""


@dataclass(frozen=True)
class Shape:
    """A Llama-style decoder (Llama, Mistral, Qwen2, Qwen3) as its config describes it."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    qk_norm: bool = False  # Qwen3: RMSNorm on each head's q and k
    qkv_bias: bool = False  # Qwen2: biases on q, k and v

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> Shape:
        """From an HF config (a `PretrainedConfig` or its config.json as a dict)."""
        c = config if isinstance(config, Mapping) else config.to_dict()
        heads = int(c["num_attention_heads"])
        kind = str(c.get("model_type", ""))
        return cls(
            vocab=int(c["vocab_size"]), hidden=int(c["hidden_size"]), layers=int(c["num_hidden_layers"]),
            heads=heads, kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
            intermediate=int(c["intermediate_size"]), tied=bool(c.get("tie_word_embeddings", False)),
            qk_norm=kind.startswith("qwen3"), qkv_bias=bool(c.get("attention_bias", kind == "qwen2")),
        )  # fmt: skip

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection of a layer."""
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, self.q), "k_proj": (h, self.kv), "v_proj": (h, self.kv), "o_proj": (self.q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}  # fmt: skip

    def layer_params(self) -> int:
        matrices = sum(a * b for a, b in self.linears().values())
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return matrices + norms + (self.q + 2 * self.kv if self.qkv_bias else 0)

    def outside_layers(self) -> int:
        """Embeddings, the LM head when untied, the final norm."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.outside_layers()


@dataclass(frozen=True)
class Lora:
    """LoRA adapters of `rank` on the `targets` projections of every layer."""

    rank: int
    targets: tuple[str, ...] = LORA_TARGETS

    @classmethod
    def of(cls, rank: int, spec: list[str] | str) -> Lora:
        """From the LORA_RANK and LORA_TARGETS settings (all-linear: every projection, not the head)."""
        return cls(rank, LORA_TARGETS if spec == "all-linear" else tuple(t for t in LORA_TARGETS if t in spec))

    def params(self, s: Shape) -> int:
        """Adapter parameters: r·(in + out) per adapted projection and layer."""
        return s.layers * sum(self.rank * (a + b) for name, (a, b) in s.linears().items() if name in self.targets)


def layer_activation_bytes(s: Shape, e: int, lora: Lora | None = None) -> int:
    """Bytes autograd saves per token in one decoder layer; e: bytes of the compute dtype;
    with `lora` the base is frozen and the adapters are fp32 (as peft makes them)."""
    h, q, kv, i = s.hidden, s.q, s.kv, s.intermediate
    lse = FP32 * s.heads  # SDPA's logsumexp
    qk_norm = FP32 * (q + kv + s.heads + s.kv_heads) if s.qk_norm else 0  # fp32 inputs, rsqrt
    if lora is None:
        norms = 2 * ((FP32 + 2 * e) * h + FP32)  # fp32 input, rsqrt, normed, normed × weight
        attention = 2 * e * (q + kv) + (e * (q + kv) if s.qk_norm else 0) + qk_norm + lse
        return norms + attention + 4 * e * i  # MLP: gate, silu(gate), up, their product
    adapted = lora.targets
    norms = 2 * (FP32 * h + FP32)  # a frozen norm weight needs nothing more
    attention = 2 * e * (q + kv) + qk_norm + lse  # rotated q and k, v, the output
    mlp = 3 * e * i + (FP32 * i if "down_proj" in adapted else 0)  # down's adapter keeps its input
    if e != FP32:  # peft casts each adapter's input to fp32: one copy per projection
        inputs = {"q_proj": h, "k_proj": h, "v_proj": h, "o_proj": q, "gate_proj": h, "up_proj": h}
        copies = sum(FP32 * n for name, n in inputs.items() if name in adapted)
    else:  # in fp32 the projections of one input share it, and o_proj's is SDPA's output
        attn_in = any(t in adapted for t in ("q_proj", "k_proj", "v_proj"))
        mlp_in = any(t in adapted for t in ("gate_proj", "up_proj"))
        copies = FP32 * h * (attn_in + mlp_in)
    return norms + attention + mlp + copies + FP32 * lora.rank * len(adapted)  # + A's outputs


def outside_activation_bytes(s: Shape, e: int, lora: Lora | None = None, checkpointing: bool = False) -> int:
    """Per token, outside the layers: the final norm and the input ids, and the rotary cos
    and sin the layers' attention keeps (a checkpointed layer keeps none)."""
    final = FP32 * s.hidden + FP32 if lora is not None else (FP32 + 2 * e) * s.hidden + FP32 + 8
    return final + (0 if checkpointing else 2 * e * s.head_dim)


def saved_activation_bytes(s: Shape, e: int, tokens: int, lora: Lora | None = None,
                           checkpointing: bool = False) -> int:  # fmt: skip
    """What the forward of `tokens` tokens leaves for the backward: every layer's saved
    tensors, or with checkpointing each layer's input only; plus the part outside the layers."""
    per_layer = e * s.hidden if checkpointing else layer_activation_bytes(s, e, lora)
    return tokens * (s.layers * per_layer + outside_activation_bytes(s, e, lora, checkpointing))


@dataclass(frozen=True)
class Scheme:
    """Bytes per trainable parameter, by role (the precision scheme of services/trainer/precision.py)."""

    weight: int  # the model's parameter, in the compute dtype
    grad: int  # its gradient during a backward
    master: int  # fp32 master copy + its accumulated fp32 gradient (0: its own master)
    optimizer: int  # AdamW's m and v
    step: int  # the optimizer step's temporaries (foreach AdamW: one state-sized tensor)

    @classmethod
    def of(cls, e: int, master_weights: bool) -> Scheme:
        if e == FP32 or not master_weights:
            return cls(weight=e, grad=e, master=0, optimizer=2 * e, step=e)
        return cls(weight=e, grad=e, master=2 * FP32, optimizer=2 * FP32, step=FP32)


FP32_SCHEME = Scheme.of(FP32, master_weights=False)  # LoRA adapters: fp32 parameters


@dataclass(frozen=True)
class Plan:
    """Bytes on the device for one micro-batch of `tokens`; `peak` is what must fit."""

    params: int
    trainable: int
    tokens: int
    checkpointing: bool
    reference: str  # none | device | streamed
    chunked: bool
    weights: int
    grads: int
    master: int
    optimizer: int
    step_temporaries: int
    reference_bytes: int
    activations: int
    logits: int

    @property
    def resident(self) -> int:
        """Held through the whole step: weights, masters, optimizer state, the reference."""
        return self.weights + self.master + self.optimizer + self.reference_bytes

    @property
    def backward_peak(self) -> int:
        return self.resident + self.grads + self.activations + self.logits

    @property
    def step_peak(self) -> int:
        return self.resident + self.step_temporaries

    @property
    def peak(self) -> int:
        return max(self.backward_peak, self.step_peak)

    def describe(self) -> str:
        """One line for the log: every term in GiB."""
        def g(n: int) -> str:
            return f"{n / GiB:.2f}"
        return (f"{self.params / 1e9:.3f}B params ({self.trainable / 1e9:.3f}B trainable), "
                f"{self.tokens} tokens per micro-batch, checkpointing {'on' if self.checkpointing else 'off'}, "
                f"reference {self.reference}: weights {g(self.weights)} + grads {g(self.grads)} + master "
                f"{g(self.master)} + optimizer {g(self.optimizer)} + reference {g(self.reference_bytes)} + "
                f"activations {g(self.activations)} + logits {g(self.logits)} GiB = {g(self.backward_peak)} "
                f"GiB in the backward, {g(self.step_peak)} GiB in the optimizer step: peak {g(self.peak)} GiB")


def plan(
    s: Shape, *, e: int, tokens: int, lora: Lora | None = None, master_weights: bool = True,
    checkpointing: bool = False, reference: str = "none", chunked: bool = True, chunk_bytes: int = CHUNK_BYTES,
) -> Plan:
    """The plan for a model of shape `s` in a compute dtype of `e` bytes, micro-batches of
    `tokens` padded tokens; `reference`: none, device (a resident frozen copy) or streamed."""
    params = s.params()
    if lora is None:
        trainable, scheme = params, Scheme.of(e, master_weights)
        weights = params * scheme.weight
    else:
        trainable, scheme = lora.params(s), FP32_SCHEME
        weights = params * e + trainable * scheme.weight
    workspace = tokens * layer_activation_bytes(s, e, lora)  # the layer being recomputed / differentiated
    activations = saved_activation_bytes(s, e, tokens, lora, checkpointing) + workspace
    chunks = CHUNK_FP32_COPIES * min(chunk_bytes, FP32 * s.vocab * tokens) if chunked else 3 * FP32 * s.vocab * tokens
    logits = 2 * e * s.vocab * tokens + chunks  # logits and their gradient, + the fp32 work
    ref = {"none": 0, "device": params * e, "streamed": (s.outside_layers() + 2 * s.layer_params()) * e}[reference]
    return Plan(
        params=params, trainable=trainable, tokens=tokens, checkpointing=checkpointing, reference=reference,
        chunked=chunked, weights=weights, grads=trainable * scheme.grad, master=trainable * scheme.master,
        optimizer=trainable * scheme.optimizer, step_temporaries=trainable * scheme.step,
        reference_bytes=ref, activations=activations, logits=logits,
    )  # fmt: skip


def advice(p: Plan, free: int, alternatives: Mapping[str, Plan]) -> str:
    """Why `p` does not fit `free` bytes, and which settings would (`alternatives`: a setting
    to write -> the plan with it)."""
    fits = [f"{setting} (peak {a.peak / GiB:.1f} GiB)" for setting, a in alternatives.items()
            if needs(a.peak) <= free]  # fmt: skip
    reserve = (needs(p.peak) - p.peak) / GiB
    head = (f"the trainer's memory plan needs {p.peak / GiB:.1f} GiB (+{reserve:.1f} GiB reserve) and the "
            f"device has {free / GiB:.1f} GiB free ({p.describe()})")
    if fits:
        return f"{head}; it would fit with " + ", or ".join(fits)
    return (f"{head}; nothing the trainer can switch fits this device: train with LoRA on a larger "
            "device, or shard the model across several (docs/methods.md#memory)")
