"""The Ray backend's pure parts: the token-balanced split, gradient buckets, its settings."""

from __future__ import annotations

import random

import pytest
import torch

from services.trainer.ray_step import buckets, shard
from services.trainer.settings import TrainerSettings
from shared.errors import SettingsError
from shared.settings import load_settings


def test_shard_covers_every_sample_once_and_balances_tokens() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(10, 2000) for _ in range(37)]
    for world in (1, 2, 3, 8):
        split = shard(lengths, world)
        assert len(split) == world
        assert sorted(i for group in split for i in group) == list(range(len(lengths)))
        loads = [sum(lengths[i] for i in group) for group in split]
        # Longest-first onto the lightest rank: ranks differ by at most the longest sample.
        assert max(loads) - min(loads) <= max(lengths)
    assert shard([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]  # ties: deterministic on every rank
    assert shard([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]


def test_shard_of_a_batch_smaller_than_the_group_leaves_ranks_empty() -> None:
    assert shard([7], 3) == [[0], [], []]
    assert shard([], 2) == [[], []]


def test_buckets_respect_the_limit_dtype_and_order() -> None:
    a, b, c = torch.zeros(10), torch.zeros(10), torch.zeros(30)  # 40, 40, 120 bytes
    half = torch.zeros(10, dtype=torch.float16)
    assert [len(g) for g in buckets([a, b, c], 80)] == [2, 1]  # c alone: larger than the limit
    assert [len(g) for g in buckets([a, half, b], 1 << 20)] == [1, 1, 1]  # dtypes never mix
    flat = [t for g in buckets([a, b, c, half], 100) for t in g]
    assert all(x is y for x, y in zip(flat, [a, b, c, half], strict=True))


def test_ray_settings_parse_and_default_to_local(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEXTSTATE_TRAINER__MODEL", "/m")
    cfg = load_settings(TrainerSettings).trainer
    assert (cfg.backend, cfg.num_workers, cfg.use_gpu, cfg.ray_address) == ("local", 2, False, None)
    monkeypatch.setenv("NEXTSTATE_TRAINER__BACKEND", "ray")
    monkeypatch.setenv("NEXTSTATE_TRAINER__NUM_WORKERS", "4")
    monkeypatch.setenv("NEXTSTATE_TRAINER__USE_GPU", "true")
    monkeypatch.setenv("NEXTSTATE_TRAINER__RAY_ADDRESS", "ray://head:10001")
    cfg = load_settings(TrainerSettings).trainer
    assert (cfg.backend, cfg.num_workers, cfg.use_gpu, cfg.ray_address) == ("ray", 4, True, "ray://head:10001")


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"NEXTSTATE_TRAINER__BACKEND": "slurm"}, "NEXTSTATE_TRAINER__BACKEND"),
        ({"NEXTSTATE_TRAINER__NUM_WORKERS": "0"}, "NEXTSTATE_TRAINER__NUM_WORKERS"),
        ({"NEXTSTATE_TRAINER__BACKEND": "ray", "NEXTSTATE_TRAINER__USE_GPU": "true",
          "NEXTSTATE_TRAINER__DEVICE": "cpu"}, "use_gpu decides"),
        ({"NEXTSTATE_TRAINER__HEARTBEAT_S": "60", "NEXTSTATE_TRAINER__COLLECTIVE_TIMEOUT_S": "30"},
         "heartbeat_s must be shorter"),
    ],
)
def test_invalid_ray_settings_are_refused(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], names: str
) -> None:
    monkeypatch.setenv("NEXTSTATE_TRAINER__MODEL", "/m")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SettingsError, match=names):
        load_settings(TrainerSettings)
