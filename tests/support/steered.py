"""Tiny models whose greedy answers lean to known words: versions better or worse on a task
by construction, for tests of the promotion gate's paired test.

The tiny test model (tests/support/tiny_model.py) ties its output head to its input
embeddings. `steer` makes one hidden dimension (0) of the head score only two words, one
up and one down by `strength` times that dimension's value: whichever sign the hidden
state has there, one of the two words gains. With `strength=None` the final norm keeps
only that dimension, so every greedy answer is one of the two words repeated; a finite
strength leaves the rest of the model in play (larger: the two words win more often).

    steer(tiny, dest, ("a", "an"))          answers start with a vowel: passes `vowel`
    steer(tiny, dest, ("the", "to"))        never does: fails every `vowel` task
    steer(tiny, dest, ("a", "an"), 1.5)     most answers do (measured on the held-out
                                            questions: 1.0 -> 40 %, 2.0 -> 98 %)
"""

from __future__ import annotations

import shutil
from pathlib import Path

VOWELS = ("a", "an")
CONSONANTS = ("the", "to")


def steer(src: Path, dest: Path, words: tuple[str, str], strength: float | None = None) -> Path:
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    shutil.copytree(src, dest)
    tok = AutoTokenizer.from_pretrained(str(dest))
    ids = [tok.convert_tokens_to_ids("Ġ" + w) for w in words]
    if None in ids or tok.unk_token_id in ids or len(set(ids)) != 2:
        raise ValueError(f"{words} are not two distinct single tokens of {src}")
    weights = dest / "model.safetensors"
    tensors = load_file(str(weights))
    embed = tensors["model.embed_tokens.weight"].clone()
    norm = tensors["model.norm.weight"].clone()
    level = 100.0 if strength is None else strength
    embed[:, 0] = 0.0
    embed[ids[0], 0], embed[ids[1], 0] = level, -level
    if strength is None:
        norm.zero_()
        norm[0] = 1.0
    tensors.update({"model.embed_tokens.weight": embed, "model.norm.weight": norm})
    if "lm_head.weight" in tensors:  # tied: the embeddings are the head
        tensors["lm_head.weight"] = embed
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights), metadata={"format": "pt"})
    return dest
