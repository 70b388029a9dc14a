"""Decoding many requests in one forward pass: a left-padded KV cache shared by the batch.

Each request runs its prompt alone (prefill, batch size 1: exact input log-probs, no
padding in the long pass) and samples its first token; then it joins the batch. A
decode step feeds every member's last token at once: the members' caches are stacked
along the batch dimension, left-padded to the longest, with a 0/1 mask of the real
positions passed as `attention_mask` and each row's own next position as
`position_ids`. Padded positions get no attention weight, so a member computes what
it would alone up to floating-point reassociation in the batched matmuls (~1e-7 on
log-probs in float32): sampled tokens agree except in the rarest ties.

Joining copies the batch's cache once (re-padding to the new longest); leaving drops
rows and the columns that became padding for every remaining row. A step costs one
forward of B rows instead of B forwards of one: on CPU the weights are read once per
step instead of once per request, which is where the throughput comes from.

Only plain dynamic caches are batched (`transformers.cache_utils.DynamicLayer` in every
layer: full attention, no sliding window); `supports` says so, and the scheduler
interleaves requests one by one otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from services.engine.model import LoadedModel


def _dynamic_layer() -> type | None:
    try:  # transformers >= 4.56 keeps a cache as layers of key/value tensors
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # pragma: no cover - older transformers: requests step alone
        return None
    return DynamicLayer


_DYNAMIC_LAYER = _dynamic_layer()


def supports(cache: Any) -> bool:
    """Whether a prefilled request's cache can join a batch."""
    layers = getattr(cache, "layers", None)
    if _DYNAMIC_LAYER is None or not layers:
        return False
    for layer in layers:
        if type(layer) is not _DYNAMIC_LAYER or not getattr(layer, "is_initialized", False):
            return False
        keys = getattr(layer, "keys", None)
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or keys.shape[0] != 1:
            return False
    return True


def _pad_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, n + L, D), zeros in front."""
    if n == 0:
        return x
    return torch.cat([x.new_zeros(x.shape[0], x.shape[1], n, x.shape[3]), x], dim=2)


def _pad_mask(mask: torch.Tensor, n: int) -> torch.Tensor:
    if n == 0:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], n), mask], dim=1)


class DecodeBatch:
    """The requests decoding together on one set of weights, in row order."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self.members: list[Any] = []  # Jobs, one per row
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # (B, L) long: 1 = a real position

    def __len__(self) -> int:
        return len(self.members)

    def __contains__(self, job: object) -> bool:
        return any(m is job for m in self.members)

    @property
    def length(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def add(self, job: Any) -> None:
        """Take over a prefilled job's cache as a new last row."""
        cache = job.cache
        n = int(cache.layers[0].keys.shape[-2])
        ones = torch.ones(1, n, dtype=torch.long, device=self.model.device)
        if self.cache is None or self.mask is None:
            self.cache, self.mask = cache, ones
        else:
            have = self.length
            width = max(have, n)
            for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
                mine.keys = torch.cat([_pad_left(mine.keys, width - have), _pad_left(theirs.keys, width - n)])
                mine.values = torch.cat(
                    [_pad_left(mine.values, width - have), _pad_left(theirs.values, width - n)]
                )
            self.mask = torch.cat([_pad_mask(self.mask, width - have), _pad_mask(ones, width - n)])
        self.members.append(job)
        job.cache = None  # the batch owns it now

    def keep(self, jobs: list[Any]) -> None:
        """Drop every row whose job is not in `jobs` (finished, aborted, gone)."""
        wanted = {id(j) for j in jobs}
        rows = [i for i, m in enumerate(self.members) if id(m) in wanted]
        if len(rows) == len(self.members):
            return
        if not rows:
            self.clear()
            return
        assert self.mask is not None
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        # columns that are padding in every remaining row go too
        first = int((mask.cumsum(dim=1) == 0).sum(dim=1).min())
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, first:, :].contiguous()
            layer.values = layer.values.index_select(0, index)[:, :, first:, :].contiguous()
        self.mask = mask[:, first:].contiguous()
        self.members = [self.members[i] for i in rows]

    def clear(self) -> None:
        self.members, self.cache, self.mask = [], None, None

    def step(self) -> torch.Tensor:
        """One forward over every row's last sampled token: next-token logits (B, V), f32 cpu."""
        assert self.mask is not None and self.members
        device = self.model.device
        ids = torch.tensor([[m.output_ids[-1]] for m in self.members], dtype=torch.long, device=device)
        positions = self.mask.sum(dim=1, keepdim=True)  # each row's own next position
        mask = torch.cat([self.mask, self.mask.new_ones(len(self.members), 1)], dim=1)
        kwargs: dict[str, Any] = {
            self.model.cache_arg: self.cache,
            "use_cache": True,
            "attention_mask": mask,
            "position_ids": positions,
        }
        if self.model.logits_to_keep:
            kwargs["logits_to_keep"] = 1
        rows = [getattr(m, "adapter", None) for m in self.members]  # each row's LoRA adapter
        with torch.inference_mode(), self.model.adapters(rows if any(a is not None for a in rows) else ()):
            out = self.model.model(input_ids=ids, **kwargs)
        self.mask = mask
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits.float().cpu()
