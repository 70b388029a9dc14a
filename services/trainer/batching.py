"""From `TrainSample`s to padded tensors: micro-batches by token budget, aligned per token.

A micro-batch is right-padded to its longest sample. Only a *window* of logits is
computed: positions from the earliest response's predecessor to the end, so long shared
prompts cost a forward but no vocabulary projection. Every per-token tensor (targets,
loss mask, behaviour and teacher log-probs) is laid out in window coordinates, where
column w holds the prediction made at position `start + w` of token `start + w + 1`.

Right padding needs no attention mask: attention is causal, so no real token ever sees
the pad tokens after it, and position ids are the same as without padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.schemas import Mode, TrainSample


@dataclass(frozen=True)
class MicroBatch:
    input_ids: torch.Tensor  # (B, L) long, right-padded
    keep: torch.Tensor  # (W,) long: positions whose logits are computed
    targets: torch.Tensor  # (B, W) long: the token each kept position predicts
    mask: torch.Tensor  # (B, W) float 0/1: response tokens that train
    old_logprobs: torch.Tensor  # (B, W) float: behaviour log-probs (0 where has_old is False)
    has_old: torch.Tensor  # (B,) bool: the sample carried rollout log-probs
    teacher_logprobs: torch.Tensor  # (B, W) float (0 where has_teacher is False)
    has_teacher: torch.Tensor  # (B,) bool
    rewards: torch.Tensor  # (B,) float
    temperature: torch.Tensor  # (B,) float
    real_tokens: int  # unpadded tokens the forward reads
    policy_version: torch.Tensor | None = None  # (B,) long: the version that sampled each sample
    # The teacher's top-K (opd_topk); None when no sample has one. Rows of samples without
    # one, padding, and K narrower than the widest: id 0, log-prob -inf (not in the set).
    teacher_topk_ids: torch.Tensor | None = None  # (B, W, K) long
    teacher_topk_logprobs: torch.Tensor | None = None  # (B, W, K) float
    has_topk: torch.Tensor | None = None  # (B,) bool


def trains(sample: TrainSample, mode: Mode) -> bool:
    """Whether a sample can train under `mode` (OPD needs teacher log-probs)."""
    return mode != "opd" or sample.teacher_logprobs is not None


def trainable_tokens(sample: TrainSample, mode: Mode) -> int:
    """Loss-masked response tokens that have a predecessor (a response at position 0 has none)."""
    if not trains(sample, mode):
        return 0
    first = 1 if sample.prompt_length == 0 else 0
    return sum(sample.loss_mask[first:])


def pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group sample indices so that each group's padded size (count × longest) fits `budget`.

    Longest first, so similar lengths share a group and padding stays small; a sample
    longer than the budget gets a group of its own. Every index appears exactly once.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = lengths[i]
        if current and (len(current) + 1) * max(longest, n) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


def collate(
    samples: Sequence[TrainSample], mode: Mode, device: torch.device | str = "cpu"
) -> MicroBatch | None:
    """Tensors for one micro-batch; None when nothing in it can train (no window)."""
    lengths = [len(s.tokens) for s in samples]
    longest = max(lengths)
    start = max(0, min(s.prompt_length for s in samples) - 1)
    width = longest - 1 - start
    if width <= 0:
        return None
    b = len(samples)
    input_ids = torch.zeros(b, longest, dtype=torch.long)
    targets = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width)
    old = torch.zeros(b, width)
    teacher = torch.zeros(b, width)
    for i, s in enumerate(samples):
        toks = torch.tensor(s.tokens, dtype=torch.long)
        input_ids[i, : len(toks)] = toks
        nxt = toks[start + 1 :]  # the tokens kept positions predict
        targets[i, : len(nxt)] = nxt
        # response token j sits at position p + j and is predicted at window column p + j - 1 - start
        p, n = s.prompt_length, s.response_length
        skip = 1 if p == 0 else 0  # the very first token of a sequence has no prediction
        lo, hi = p + skip - 1 - start, p + n - 1 - start
        if not trains(s, mode):
            continue
        mask[i, lo:hi] = torch.tensor(s.loss_mask[skip:], dtype=torch.float32)
        if s.rollout_logprobs is not None:
            old[i, lo:hi] = torch.tensor(s.rollout_logprobs[skip:], dtype=torch.float32)
        if s.teacher_logprobs is not None:
            teacher[i, lo:hi] = torch.tensor(s.teacher_logprobs[skip:], dtype=torch.float32)
    dev = torch.device(device)
    topk_ids, topk_lp, has_topk = collate_topk(samples, mode, start, width)
    return MicroBatch(
        input_ids=input_ids.to(dev),
        keep=torch.arange(start, longest - 1, device=dev),
        targets=targets.to(dev),
        mask=mask.to(dev),
        old_logprobs=old.to(dev),
        has_old=torch.tensor([s.rollout_logprobs is not None for s in samples], device=dev),
        teacher_logprobs=teacher.to(dev),
        has_teacher=torch.tensor([s.teacher_logprobs is not None for s in samples], device=dev),
        rewards=torch.tensor([float(s.reward) for s in samples], device=dev),
        temperature=torch.tensor([float(s.temperature) for s in samples], device=dev),
        real_tokens=sum(lengths),
        policy_version=torch.tensor([int(s.policy_version) for s in samples], device=dev),
        teacher_topk_ids=None if topk_ids is None else topk_ids.to(dev),
        teacher_topk_logprobs=None if topk_lp is None else topk_lp.to(dev),
        has_topk=None if has_topk is None else has_topk.to(dev),
    )


def collate_topk(
    samples: Sequence[TrainSample], mode: Mode, start: int, width: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The teacher's top-K in window coordinates: ids (B, W, K), log-probs (B, W, K), has (B,)."""
    ks = [len(s.teacher_topk_ids[0]) for s in samples if s.teacher_topk_ids]
    if not ks:
        return None, None, None
    k = max(ks)
    ids = torch.zeros(len(samples), width, k, dtype=torch.long)
    lps = torch.full((len(samples), width, k), float("-inf"))
    for i, s in enumerate(samples):
        if not s.teacher_topk_ids or s.teacher_topk_logprobs is None or not trains(s, mode):
            continue
        p = s.prompt_length
        skip = 1 if p == 0 else 0
        lo, hi = p + skip - 1 - start, p + s.response_length - 1 - start
        kk = len(s.teacher_topk_ids[0])
        ids[i, lo:hi, :kk] = torch.tensor(s.teacher_topk_ids[skip:], dtype=torch.long)
        lps[i, lo:hi, :kk] = torch.tensor(s.teacher_topk_logprobs[skip:], dtype=torch.float32)
    has = torch.tensor([bool(s.teacher_topk_ids) for s in samples])
    return ids, lps, has
