"""The trainer's memory plan (services/trainer/memory.py, fit.py) against known shapes, a real
model's parameters, autograd's saved tensors, and the decisions it takes — no CUDA needed."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from services.trainer.fit import CHECKPOINTING_ABOVE, layout, model_shape
from services.trainer.memory import (
    DoesNotFit,
    GiB,
    Lora,
    Shape,
    needs,
    plan,
    saved_activation_bytes,
)
from services.trainer.settings import TrainerConfig

VOCAB = 151_936
QWEN3 = {  # the published configs (config.json) of the Qwen3 dense models, and their parameter counts
    "0.6B": ({"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "intermediate_size": 3072, "tie_word_embeddings": True}, 596_049_920),
    "1.7B": ({"hidden_size": 2048, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "intermediate_size": 6144, "tie_word_embeddings": True}, 1_720_574_976),
    "4B": ({"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 9728, "tie_word_embeddings": True}, 4_022_468_096),
    "8B": ({"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 12288, "tie_word_embeddings": False}, 8_190_735_360),
}  # fmt: skip


def qwen3(name: str) -> dict[str, Any]:
    return {**QWEN3[name][0], "vocab_size": VOCAB, "model_type": "qwen3"}


@pytest.mark.parametrize("name", list(QWEN3))
def test_qwen3_parameter_counts(name: str) -> None:
    """The plan's count from the config alone is the real model's (built on the meta device)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = Shape.from_config(qwen3(name))
    assert shape.params() == QWEN3[name][1]
    config = Qwen3Config(**{k: v for k, v in qwen3(name).items() if k != "model_type"})
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == shape.params()
    assert Shape.from_config(config) == shape


def test_bytes_per_parameter_of_each_scheme() -> None:
    """Qwen3-4B: bf16 with fp32 masters is 2 + 2 + (4 + 4) + 8 B per parameter; fp32 is 4 + 4 + 8;
    LoRA r16 is 2 B per base parameter and 16 B per adapter parameter."""
    s, n = Shape.from_config(qwen3("4B")), QWEN3["4B"][1]
    bf16 = plan(s, e=2, tokens=8192, master_weights=True)
    assert (bf16.weights, bf16.grads, bf16.master, bf16.optimizer) == (2 * n, 2 * n, 8 * n, 8 * n)
    assert bf16.weights + bf16.master // 2 + bf16.optimizer == 14 * n  # between steps
    assert bf16.weights + bf16.grads + bf16.master // 2 + bf16.optimizer == 16 * n  # the brief's scheme
    assert bf16.step_temporaries == 4 * n  # foreach AdamW
    fp32 = plan(s, e=4, tokens=8192)
    assert (fp32.weights, fp32.grads, fp32.master, fp32.optimizer) == (4 * n, 4 * n, 0, 8 * n)
    lora = plan(s, e=2, tokens=8192, lora=Lora(16))
    adapters = 36 * 16 * ((2560 + 4096) + 2 * (2560 + 1024) + (4096 + 2560) + 2 * (2560 + 9728) + (9728 + 2560))
    assert lora.trainable == adapters == Lora(16).params(s)
    assert lora.weights == 2 * n + 4 * adapters and lora.optimizer == 8 * adapters and lora.master == 0


def test_logits_and_reference_terms() -> None:
    s, n = Shape.from_config(qwen3("4B")), QWEN3["4B"][1]
    chunked = plan(s, e=2, tokens=8192)
    plain = plan(s, e=2, tokens=8192, chunked=False)
    assert chunked.logits == 2 * 2 * 8192 * VOCAB + 3 * 32 * 2**20  # bf16 logits + gradient + 3 fp32 chunks
    assert plain.logits - chunked.logits == 3 * 4 * 8192 * VOCAB - 3 * 32 * 2**20
    assert plan(s, e=2, tokens=8192, reference="device").reference_bytes == 2 * n
    streamed = plan(s, e=2, tokens=8192, reference="streamed").reference_bytes
    assert streamed == 2 * (VOCAB * 2560 + 2560 + 2 * s.layer_params()) < 2 * n // 6  # 15 % of resident


def test_the_targets_of_issue_30() -> None:
    """What the plan says of the GPU targets (docs/methods.md#memory): LoRA fits; 4B full
    fine-tuning fits 80 GB only under the 16 B scheme (without the masters' fp32 gradients and
    foreach temporaries that precision.py's AdamW adds)."""
    four, eight = Shape.from_config(qwen3("4B")), Shape.from_config(qwen3("8B"))
    assert plan(eight, e=2, tokens=8192, lora=Lora(16), checkpointing=True).peak < 30 * GiB
    assert plan(four, e=2, tokens=16384, lora=Lora(16), checkpointing=True).peak < 30 * GiB
    full = plan(four, e=2, tokens=8192, checkpointing=True)
    sixteen = full.backward_peak - full.master // 2  # the 16 B scheme: no fp32 master gradient
    assert sixteen < 70 * GiB < 75 * GiB < full.peak
    assert plan(four, e=2, tokens=8192).activations > 45 * GiB  # without checkpointing


def test_the_tiny_models_parameters(tiny_model: Path) -> None:
    """The tests' tiny Llama (tied embeddings) and a LoRA on it: the plan's counts are the real ones."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    shape = model_shape(tiny_model)
    assert shape is not None and shape.tied and not shape.qk_norm
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == shape.params()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                task_type="CAUSAL_LM"))
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert adapters == Lora.of(4, ["q_proj", "v_proj", "down_proj"]).params(shape)


def saved_bytes(model: Any, ids: torch.Tensor) -> int:
    """The bytes autograd keeps for the backward of one forward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_are_what_autograd_keeps(dtype: torch.dtype, lora: bool, checkpointing: bool) -> None:
    """A small Qwen3 (qk-norm, SDPA): the plan's saved activations are at least what autograd
    keeps, and within 10 % of it."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from services.trainer.fit import enable_activation_checkpointing

    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(0)
    model: Any = Qwen3ForCausalLM(config)
    model = model.to(dtype).eval()
    spec = None
    if lora:
        spec = Lora(4)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning)
            model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    if checkpointing:
        enable_activation_checkpointing(model)
    ids = torch.randint(0, 128, (2, 48))
    measured = saved_bytes(model, ids)
    planned = saved_activation_bytes(Shape.from_config(config), dtype.itemsize, ids.numel(), spec, checkpointing)
    assert measured <= planned <= 1.1 * measured, (measured, planned)


def config(**kw: Any) -> TrainerConfig:
    return TrainerConfig(model="/m", **kw)


def test_auto_checkpointing_above_the_size_or_when_it_does_not_fit() -> None:
    four, small = Shape.from_config(qwen3("4B")), Shape.from_config(qwen3("1.7B"))
    assert four.params() > CHECKPOINTING_ABOVE > small.params()
    assert layout(config(), four, torch.bfloat16, None, separate_reference=False).checkpointing
    assert not layout(config(), small, torch.bfloat16, None, separate_reference=False).checkpointing
    roomy = layout(config(), small, torch.bfloat16, 80 * GiB, separate_reference=False)
    assert not roomy.checkpointing and roomy.plan is not None and roomy.plan.peak < 70 * GiB
    assert layout(config(), small, torch.bfloat16, 48 * GiB, separate_reference=False).checkpointing
    assert not layout(config(gradient_checkpointing="false"), four, torch.bfloat16, None, False).checkpointing
    assert layout(config(gradient_checkpointing="true"), small, torch.bfloat16, None, False).checkpointing


def test_the_reference_is_streamed_only_where_a_resident_copy_does_not_fit() -> None:
    small = Shape.from_config(qwen3("1.7B"))
    assert layout(config(), small, torch.bfloat16, None, separate_reference=True).reference == "device"
    assert layout(config(), small, torch.bfloat16, 80 * GiB, separate_reference=True).reference == "device"
    resident = plan(small, e=2, tokens=8192, checkpointing=True, reference="device")
    streamed = plan(small, e=2, tokens=8192, checkpointing=True, reference="streamed")
    free = (needs(resident.peak) + needs(streamed.peak)) // 2  # room for the streamed one only
    tight = layout(config(), small, torch.bfloat16, free, separate_reference=True)
    assert tight.reference == "streamed" and tight.checkpointing and tight.plan == streamed
    assert layout(config(reference_offload="true"), small, torch.bfloat16, None, True).reference == "streamed"
    assert layout(config(lora=True), small, torch.bfloat16, None, separate_reference=False).reference == "none"


def test_a_plan_that_cannot_fit_is_refused_with_advice() -> None:
    four = Shape.from_config(qwen3("4B"))
    with pytest.raises(DoesNotFit) as err:  # 4B full fine-tuning on an 80 GB card, precision.py's scheme
        layout(config(), four, torch.bfloat16, 79 * GiB, separate_reference=True)
    text = str(err.value)
    assert "memory plan needs" in text and "79.0 GiB free" in text and "NEXTSTATE_TRAINER__LORA=true" in text
    small = Shape.from_config(qwen3("0.6B"))
    with pytest.raises(DoesNotFit) as err:  # a long micro-batch on a small card: a shorter one fits
        layout(config(micro_batch_tokens=65536, gradient_checkpointing="false"), small, torch.bfloat16,
               20 * GiB, separate_reference=False)
    assert "NEXTSTATE_TRAINER__MICRO_BATCH_TOKENS=" in str(err.value)
    assert "NEXTSTATE_TRAINER__GRADIENT_CHECKPOINTING=true" in str(err.value)
    fitting = layout(config(), small, torch.bfloat16, 20 * GiB, separate_reference=False)
    assert fitting.plan is not None and needs(fitting.plan.peak) <= 20 * GiB


def test_an_architecture_the_plan_does_not_read_starts_unplanned(tmp_path: Path) -> None:
    """A config without a Llama-style decoder's fields: no plan, the settings as they are."""
    from services.trainer.fit import plan_start

    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_embd": 64, "n_layer": 2}')
    assert model_shape(tmp_path) is None
    chosen = plan_start(TrainerConfig(model=str(tmp_path), gradient_checkpointing="true"), torch.device("cpu"),
                        torch.float32, separate_reference=True)
    assert chosen.plan is None and chosen.checkpointing and chosen.reference == "device"
