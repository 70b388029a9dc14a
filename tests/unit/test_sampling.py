"""The engine's sampling math: what may be sampled, and the log-probs reported for it."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from services.engine.sampling import (
    NoAllowedToken,
    SamplingConfig,
    keep_mask,
    new_generator,
    sample_token,
    scaled_logprobs,
    top_logprobs,
)
from services.engine.text import find_stop, pending_stop_prefix, stable_text, trim_at_stop


def logits_row(seed: int = 0, vocab: int = 50) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * 3


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.5])
def test_reported_logprob_is_log_softmax_of_logits_over_temperature(temperature: float) -> None:
    logits = logits_row(1)
    expected = torch.log_softmax(logits.double() / temperature, dim=-1)
    cfg = SamplingConfig(temperature=temperature, top_p=0.8, top_k=10)
    gen = new_generator(5)
    for _ in range(50):
        token, lp = sample_token(logits, cfg, gen)
        # top-k/top-p restrict the choice, never the reported value
        assert lp == pytest.approx(float(expected[token]), abs=1e-5)


def test_greedy_takes_the_argmax_and_reports_temperature_one() -> None:
    logits = logits_row(2)
    token, lp = sample_token(logits, SamplingConfig(temperature=0.0), new_generator(None))
    assert token == int(torch.argmax(logits))
    assert lp == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-6)
    assert SamplingConfig(temperature=0.0).logprob_temperature == 1.0


def test_top_k_one_is_greedy_but_reports_the_requested_temperature() -> None:
    logits = logits_row(3)
    token, lp = sample_token(logits, SamplingConfig(temperature=0.5, top_k=1), new_generator(1))
    assert token == int(torch.argmax(logits))
    assert lp == pytest.approx(float(torch.log_softmax(logits / 0.5, -1)[token]), abs=1e-5)


def test_top_k_keeps_exactly_the_k_most_likely() -> None:
    logits = logits_row(4)
    keep = keep_mask(scaled_logprobs(logits, 1.0), top_k=5, top_p=1.0)
    assert int(keep.sum()) == 5
    assert set(torch.nonzero(keep).squeeze(-1).tolist()) == set(torch.topk(logits, 5).indices.tolist())


def test_top_k_breaks_ties_deterministically() -> None:
    logits = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0])
    keep = keep_mask(scaled_logprobs(logits, 1.0), top_k=2, top_p=1.0)
    assert keep.tolist() == [False, True, True, False, False]


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    lp = probs.log()
    assert keep_mask(lp, -1, 0.5).tolist() == [True, False, False, False]
    assert keep_mask(lp, -1, 0.51).tolist() == [True, True, False, False]
    assert keep_mask(lp, -1, 0.8).tolist() == [True, True, False, False]
    assert keep_mask(lp, -1, 0.81).tolist() == [True, True, True, False]
    assert keep_mask(lp, -1, 0.01).tolist() == [True, False, False, False]


def test_top_p_is_measured_after_top_k() -> None:
    lp = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # Within the top 2 the mass is renormalised to 4/7 and 3/7: p=0.5 needs only the first.
    assert keep_mask(lp, 2, 0.5).tolist() == [True, False, False, False]
    assert keep_mask(lp, 2, 0.6).tolist() == [True, True, False, False]


def test_sampled_tokens_stay_inside_top_k_and_top_p() -> None:
    logits = logits_row(5)
    cfg = SamplingConfig(temperature=1.3, top_k=8, top_p=0.7)
    allowed = keep_mask(scaled_logprobs(logits, 1.3), 8, 0.7)
    gen = new_generator(11)
    seen = {sample_token(logits, cfg, gen)[0] for _ in range(300)}
    assert seen <= set(torch.nonzero(allowed).squeeze(-1).tolist())
    assert len(seen) > 1


def test_sampling_frequencies_follow_the_tempered_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    cfg = SamplingConfig(temperature=2.0)
    gen = new_generator(123)
    n = 20000
    counts = torch.zeros(4)
    for _ in range(n):
        counts[sample_token(logits, cfg, gen)[0]] += 1
    expected = torch.softmax(logits / 2.0, -1)
    assert torch.allclose(counts / n, expected, atol=0.015)


def test_seeded_sampling_is_reproducible_and_seeds_differ() -> None:
    logits = logits_row(6)
    cfg = SamplingConfig(temperature=1.0)

    def run(seed: int) -> list[int]:
        gen = new_generator(seed)
        return [sample_token(logits, cfg, gen)[0] for _ in range(40)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_unseeded_generators_are_independent() -> None:
    logits = logits_row(7)
    cfg = SamplingConfig(temperature=1.0)
    a, b = new_generator(None), new_generator(None)
    assert [sample_token(logits, cfg, a)[0] for _ in range(40)] != [
        sample_token(logits, cfg, b)[0] for _ in range(40)
    ]


def test_top_logprobs_are_sorted_and_consistent() -> None:
    lp = scaled_logprobs(logits_row(8), 0.9)
    top = top_logprobs(lp, 3)
    assert [t for _, t in top] == torch.topk(lp, 3).indices.tolist()
    assert all(a[0] >= b[0] for a, b in itertools.pairwise(top))
    assert math.isclose(sum(math.exp(v) for v, _ in top_logprobs(lp, 1000)), 1.0, rel_tol=1e-5)


# -- a grammar's mask: sample inside it, report the full-vocabulary log-prob ------------------


def allowed_ids(vocab: int, ids: list[int]) -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[ids] = True
    return mask


@pytest.mark.parametrize("cfg", [SamplingConfig(0.8), SamplingConfig(1.2, top_p=0.5, top_k=3),
                                 SamplingConfig(0.0), SamplingConfig(0.7, top_k=1)])  # fmt: skip
def test_masked_sampling_stays_inside_and_reports_unmasked_logprobs(cfg: SamplingConfig) -> None:
    logits = logits_row(9)
    allowed = allowed_ids(50, [3, 17, 41])  # not the argmax, most likely
    full = torch.log_softmax(logits.double() / cfg.logprob_temperature, dim=-1)
    gen = new_generator(4)
    for _ in range(60):
        token, lp = sample_token(logits, cfg, gen, allowed)
        assert token in (3, 17, 41)
        assert lp == pytest.approx(float(full[token]), abs=1e-5)  # what the trainer recomputes


def test_masked_greedy_takes_the_best_allowed_token() -> None:
    logits = logits_row(10)
    ids = [5, 6, 7, 30]
    token, _ = sample_token(logits, SamplingConfig(0.0), None, allowed_ids(50, ids))
    assert token == max(ids, key=lambda i: float(logits[i]))


def test_masked_frequencies_follow_the_renormalised_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 3.0])
    allowed = allowed_ids(5, [1, 2, 3])
    gen = new_generator(77)
    n = 20000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[sample_token(logits, SamplingConfig(1.0), gen, allowed)[0]] += 1
    expected = torch.zeros(5)
    expected[1:4] = torch.softmax(logits[1:4], -1)
    assert torch.allclose(counts / n, expected, atol=0.015)


def test_top_k_is_measured_inside_the_mask() -> None:
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    allowed = allowed_ids(6, [2, 4, 5])
    gen = new_generator(3)
    # top_k=2 within the allowed tokens keeps 2 and 4, even though 0 and 1 are likelier overall
    seen = {sample_token(logits, SamplingConfig(1.0, top_k=2), gen, allowed)[0] for _ in range(300)}
    assert seen == {2, 4}
    # fewer allowed tokens than k: every allowed token stays possible, nothing else
    seen = {sample_token(logits, SamplingConfig(3.0, top_k=5), gen, allowed)[0] for _ in range(500)}
    assert seen == {2, 4, 5}


def test_an_all_false_mask_is_an_error_not_a_random_token() -> None:
    with pytest.raises(NoAllowedToken):
        sample_token(logits_row(1), SamplingConfig(1.0), None, torch.zeros(50, dtype=torch.bool))


def test_an_all_true_mask_samples_what_no_mask_samples() -> None:
    logits = logits_row(12)
    cfg = SamplingConfig(0.9, top_p=0.9, top_k=20)
    a, b = new_generator(8), new_generator(8)
    everything = torch.ones(50, dtype=torch.bool)
    assert [sample_token(logits, cfg, a)[0] for _ in range(50)] == [
        sample_token(logits, cfg, b, everything)[0] for _ in range(50)
    ]


# -- stop strings and streamed text -------------------------------------------------------


def test_stop_strings_first_in_request_order_and_trim() -> None:
    assert find_stop("hello world. bye", ["bye", "."]) == "bye"
    assert find_stop("hello", ["x"]) is None
    assert trim_at_stop("answer: 42\nEND more", "\nEND") == "answer: 42"


def test_streamed_text_holds_back_possible_stop_prefixes_and_partial_chars() -> None:
    assert pending_stop_prefix("the end", ["end."]) == 3
    assert pending_stop_prefix("abc", ["xyz"]) == 0
    assert stable_text("answer E", ["END"], "") == "answer "
    assert stable_text("caf\ufffd", [], "") == "caf"
    # never shrinks what was already sent
    assert stable_text("ab", [], "abc") == "abc"
    assert stable_text("abcd", [], "abc") == "abcd"
