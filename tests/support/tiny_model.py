"""A tiny random causal LM with a freshly trained tokenizer and a ChatML chat template.

No downloads: the tokenizer is a byte-level BPE trained on a small built-in corpus, the
model a 2-layer Llama with random weights (fixed seed). The chat template follows the
Qwen/Hermes conventions (tools in the system turn, `<tool_call>{json}</tool_call>`,
tool results as `<tool_response>`), so every code path of the templating is exercised.
"""

from __future__ import annotations

import json
import random
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}\n\n"
    "# Tools\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{% if message.content %}{{ message.content }}{% endif %}"
    "{% if message.tool_calls %}{% for tc in message.tool_calls %}"
    "<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}{% else %}{{ tc.function.arguments | tojson }}{% endif %}}"
    "\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

_WORDS = (
    "the a an is are was be to of and in that have it for not on with he as you do at this but "
    "his by from they we say her she or will my one all would there their what so up out if about "
    "who get which go me when make can like time no just him know take people into year your good "
    "some could them see other than then now look only come its over think also back after use two "
    "how our work first well way even new want because any these give day most us yes thanks great "
    "perfect wrong again retry error please city weather paris london tokyo sunny rain degrees "
    "function name arguments call tool result answer question hello hi sure okay done fix file"
).split()


def _corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
        line = " ".join(words)
        if rng.random() < 0.3:
            line = line.capitalize() + rng.choice([".", "!", "?", ","])
        if rng.random() < 0.2:
            line = json.dumps({"name": rng.choice(_WORDS), "arguments": {"city": rng.choice(_WORDS)}})
        lines.append(line)
    lines += ["0123456789", "{}[]():;'\"\n\t-_=+*/\\<>|@#$%^&~`"]
    return lines


def build_tokenizer(
    path: Path, vocab_size: int = 512, seed: int = 0, special_markers: Sequence[str] = (),
    texts: Sequence[str] = (),
) -> None:  # fmt: skip
    """`special_markers` (of MARKERS, or new ones such as "[TOOL_CALLS]") are added as
    special tokens, which a decode that skips special tokens drops, as Mistral's
    `[TOOL_CALLS]` or Llama 3's `<|python_tag|>` are. `texts`: more training text for the
    BPE (with a larger `vocab_size`, prompts like them take a real model's token count)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*_corpus(3000, seed), *texts], trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    if special_markers:
        extra = [m for m in special_markers if m not in MARKERS]
        fast.add_tokens([
            AddedToken(m, special=m in special_markers, normalized=m not in special_markers)
            for m in [*MARKERS, *extra]
        ])  # fmt: skip
    else:
        fast.add_tokens(MARKERS)  # plain added tokens: atomic, yet kept in decoded text
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def build_tiny_model(
    path: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2,
    special_markers: Sequence[str] = (), vocab_size: int = 512, texts: Sequence[str] = (),
    max_position_embeddings: int = 2048, sliding_window: int | None = None,
) -> Path:  # fmt: skip
    """Write a tokenizer + random Llama to `path` (an HF folder) and return it; with
    `sliding_window`, a Mistral (each token attends to the last `sliding_window` ones)."""
    import torch
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, vocab_size, seed=seed, special_markers=special_markers, texts=texts)
    tok = AutoTokenizer.from_pretrained(str(path))
    kind: Any = LlamaConfig if sliding_window is None else MistralConfig
    extra: dict[str, Any] = {} if sliding_window is None else {"sliding_window": sliding_window}
    config = kind(
        **extra,
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = (LlamaForCausalLM if sliding_window is None else MistralForCausalLM)(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(str(path))
    return path


def build_tiny_adapter(model: str | Path, path: str | Path, seed: int = 1, rank: int = 4, std: float = 0.3) -> Path:
    """A PEFT LoRA adapter folder for `model` (every linear layer), with random A and B so
    that it changes the model's outputs (a fresh adapter's B is zero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = Path(path)
    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    with warnings.catch_warnings():  # peft probes an attribute transformers 5 deprecates
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                                     task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    peft_model.save_pretrained(str(path))
    return path


def build_tiny_classifier(model: str | Path, path: str | Path, seed: int = 0) -> Path:
    """A 2-label sequence classifier with `model`'s tokenizer and config (a tiny model
    folder) and a random head blown up so that p spreads between texts: a reward model
    for NEXTSTATE_JUDGE__TYPE=classifier. Returns `path`."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    path = Path(path)
    tok = AutoTokenizer.from_pretrained(str(model))
    config = AutoConfig.from_pretrained(str(model), num_labels=2)
    config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    torch.manual_seed(seed)
    classifier = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        classifier.score.weight.mul_(50.0)
    classifier.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path
