"""The data-parallel step: each rank trains its shard of the batch, gradients are summed.

Every rank holds the whole `TrainBatch` (rank 0 broadcasts it, services/trainer/ray_group.py)
and the same split of it, balanced by token count. Equivalence with the single-process
step (services/trainer/step.py), which the Ray test checks:

- each rank normalises its loss by the *whole batch's* trainable-token count, so the
  sum of the ranks' gradients is the gradient of the batch's token-mean, and the sum of
  their metrics is the batch's metrics;
- after the sum every rank holds the same gradient, clips by the same global norm and
  takes the same AdamW step: weights stay identical without being sent again. A
  parameter no rank touched keeps `grad = None` (AdamW skips it), exactly as locally.

Why not the `DistributedDataParallel` wrapper: its reducer all-reduces inside a backward
and needs every rank to run the same number of synchronised backwards. Token-balanced
shards pack into different numbers of micro-batches (a batch smaller than the group
leaves a rank nothing at all), so each rank accumulates locally and the gradient is
summed once per optimizer step, in buckets — what DDP does under `no_sync()` over an
accumulation, without putting the micro-batches in lockstep.

A failure on any rank (a bad sample, out of memory) is agreed on in the same small
collective that sums the metrics: every rank drops the step and raises, and none is left
waiting in a gradient all-reduce that would never come.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from services.trainer import offpolicy
from services.trainer.step import Trainer, TrainerBroken, batch_tokens
from shared.errors import NextstateError
from shared.schemas import TrainSample

log = logging.getLogger(__name__)

# The per-micro-batch sums `Trainer.accumulate` reports (all normalised by the batch's tokens).
# The off-policy counts and mismatch sums add up too (their extremes, min and max, are
# rank 0's alone: a sum of extremes means nothing).
METRIC_KEYS = ("loss", "pg_loss", "kl", "clip_frac", "ratio_mean", "adv_mean", "tokens",
               *offpolicy.COUNT_KEYS, *offpolicy.SUM_KEYS[:3])
BUCKET_BYTES = 64 << 20  # gradient all-reduce granularity


class StepFailed(NextstateError):
    """Another rank of the data-parallel group failed this step; its log says why."""


class GroupBroken(TrainerBroken):
    """A collective failed (a rank died, timed out or disagreed): the group must restart."""


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Turn a failure inside a collective into `GroupBroken` (fatal, unlike a failed step)."""
    try:
        yield
    except GroupBroken:
        raise
    except Exception as exc:
        raise GroupBroken(f"{what} failed ({type(exc).__name__}: {exc}); the group must restart") from exc


def shard(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Sample indices per rank, balanced by tokens: longest first onto the lightest rank.

    Deterministic (ties go to the lower index and rank), so every rank computes the same
    split from the same batch; each index appears exactly once; ranks may get none.
    """
    loads = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        out[rank].append(i)
        loads[rank] += lengths[i]
    return [sorted(group) for group in out]


def buckets(tensors: Sequence[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, at most `limit` bytes a group (a larger
    tensor gets a group of its own)."""
    groups: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = groups[-1] if groups else None
        if last is None or size + nbytes > limit or (t.dtype, t.device) != (last[0].dtype, last[0].device):
            groups.append([t])
            size = nbytes
        else:
            last.append(t)
            size += nbytes
    return groups


def all_reduce_sum(tensors: Sequence[torch.Tensor], limit: int = BUCKET_BYTES) -> None:
    """Sum each tensor across the group, in place, one flattened all-reduce per bucket."""
    for group in buckets(tensors, limit):
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.all_reduce(flat)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def agree(
    metrics: dict[str, float], failed: bool, used: Sequence[bool], device: torch.device
) -> tuple[dict[str, float], int, list[bool]]:
    """One all-reduce: the summed metrics, how many ranks failed, which parameters any rank used.

    A metric is reported when at least one rank produced it (as the local step reports
    only what some micro-batch produced).
    """
    values = [1.0 if failed else 0.0]
    for key in METRIC_KEYS:
        values += [1.0 if key in metrics else 0.0, float(metrics.get(key, 0.0))]
    values += [1.0 if u else 0.0 for u in used]
    summed = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(summed)
    out = summed.tolist()
    reduced = {k: out[2 + 2 * i] for i, k in enumerate(METRIC_KEYS) if out[1 + 2 * i] > 0}
    base = 1 + 2 * len(METRIC_KEYS)
    return reduced, round(out[0]), [v > 0 for v in out[base:]]


class ShardedTrainer(Trainer):
    """A `Trainer` whose batch gradient comes from every rank of the default process group."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(
            trainer.model, trainer.optimizer, trainer.loss, trainer.optim,
            reference=trainer.reference, micro_batch_tokens=trainer.micro_batch_tokens,
            device=trainer.device,
        )  # fmt: skip

    def accumulate(
        self, samples: Sequence[TrainSample], num_tokens: float | None = None, version: int | None = None
    ) -> dict[str, float]:
        """This rank's shard forward + backward, then the group's sum of gradients and metrics."""
        world, rank = dist.get_world_size(), dist.get_rank()
        total = batch_tokens(samples, self.loss.mode) if num_tokens is None else num_tokens
        mine = [samples[i] for i in shard([len(s.tokens) for s in samples], world)[rank]]
        failure: Exception | None = None
        local: dict[str, float] = {}
        try:
            local = super().accumulate(mine, total, version)
        except Exception as exc:  # told to the others below, then raised
            failure = exc
        used = [p.grad is not None for p in self.params]
        with collective("agreeing on the step"):
            metrics, failed, used_anywhere = agree(local, failure is not None, used, self.device)
        if failed:
            self.optimizer.zero_grad(set_to_none=True)
            if failure is not None:
                raise failure
            raise StepFailed(f"the step failed on {failed} other rank(s) of {world}; see their logs")
        grads = []
        for p, anywhere in zip(self.params, used_anywhere, strict=True):
            if anywhere:
                if p.grad is None:  # this rank's shard did not reach it; others did
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        try:
            with collective("summing gradients"):
                all_reduce_sum(grads)
        except GroupBroken:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        metrics["train_tokens"] = total
        log.debug("rank step", extra={"rank": rank, "samples": len(mine), "tokens": local.get("tokens")})
        return metrics


def sync_state(trainer: Trainer, src: int = 0) -> None:
    """Give every rank `src`'s weights and optimizer state (rank 0 resumed from the bucket).

    Every rank built the same model structure; tensors are sent in `state_dict` order,
    tied tensors once.
    """
    seen: set[tuple[int, torch.dtype, tuple[int, ...]]] = set()
    with torch.no_grad(), collective("sending rank 0's state"):
        for t in trainer.model.state_dict().values():
            key = (t.data_ptr(), t.dtype, tuple(t.shape))
            if key not in seen:
                seen.add(key)
                dist.broadcast(t, src=src)
    box: list[Any] = [_to_cpu(trainer.optimizer.state_dict()) if dist.get_rank() == src else None]
    with collective("sending rank 0's optimizer state"):
        dist.broadcast_object_list(box, src=src)
    if dist.get_rank() != src and box[0]["state"]:
        trainer.optimizer.load_state_dict(box[0])


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
