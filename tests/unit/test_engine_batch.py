"""The decode batch in-process on the tiny Llama: rows of different lengths join and
leave, and every row's logits equal that request decoded alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.batch import DecodeBatch, supports
from services.engine.model import LoadedModel, load_model


class Row:
    """The parts of a Job the batch touches: its cache and its sampled tokens."""

    def __init__(self, model: LoadedModel, prompt: list[int]) -> None:
        self.cache: Any = model.new_cache()
        self.logits = model.forward(prompt, self.cache, 1)[-1]
        self.output_ids = [int(self.logits.argmax())]


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> LoadedModel:
    torch.manual_seed(0)
    return load_model(str(tiny_model), torch.device("cpu"), "float32")


def alone(model: LoadedModel, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """Greedy decoding at batch size 1: the next-token logits of each step."""
    row = Row(model, prompt)
    out = []
    for _ in range(steps):
        logits = model.forward([row.output_ids[-1]], row.cache, 1)[-1]
        out.append(logits)
        row.output_ids.append(int(logits.argmax()))
    return out


def test_rows_joining_and_leaving_decode_as_if_alone(model: LoadedModel) -> None:
    prompts = [[5, 9, 13], list(range(20, 31)), [7] * 6]
    want = [alone(model, p, 8) for p in prompts]
    batch = DecodeBatch(model)
    rows = [Row(model, p) for p in prompts]
    assert all(supports(r.cache) for r in rows)
    got: list[list[torch.Tensor]] = [[], [], []]

    def step(members: list[int]) -> None:
        logits = batch.step()
        assert logits.shape[0] == len(members)
        for i, k in enumerate(members):
            got[k].append(logits[i])
            rows[k].output_ids.append(int(logits[i].argmax()))

    batch.add(rows[0])  # alone in the batch for two steps
    step([0])
    step([0])
    batch.add(rows[1])  # longer: the first row is padded on the left
    assert batch.length == 11 and batch.mask is not None  # 3 + 2 cached vs 11
    assert batch.mask[0].tolist() == [0] * 6 + [1] * 5 and batch.mask[1].tolist() == [1] * 11
    for _ in range(3):
        step([0, 1])
    batch.add(rows[2])
    for _ in range(3):
        step([0, 1, 2])
    batch.keep([rows[1], rows[2]])  # the first leaves after 8 steps
    assert len(batch) == 2 and rows[0] not in batch
    for _ in range(5):
        step([1, 2])
    for k in range(3):
        assert len(got[k]) >= 8
        for a, b in zip(got[k][:8], want[k], strict=False):
            assert torch.allclose(a, b, atol=1e-5), (k, (a - b).abs().max())
    batch.keep([])
    assert len(batch) == 0 and batch.cache is None and batch.length == 0


def test_leaving_trims_columns_no_remaining_row_uses(model: LoadedModel) -> None:
    batch = DecodeBatch(model)
    short, long = Row(model, [3, 4]), Row(model, list(range(40, 60)))
    batch.add(short)
    batch.add(long)
    assert batch.length == 20
    batch.keep([short])
    assert batch.length == 2 and batch.mask is not None and batch.mask.tolist() == [[1, 1]]
    assert batch.cache.layers[0].keys.shape[-2] == 2
