"""`drift`: how far the candidate moved from the base model — KL(base ‖ candidate) on a
fixed prompt set — so a collapsing policy is caught even when the task suites are quiet.
Lower is better.

Estimator. For prompt x, continuations y = (y_1 … y_T) are sampled from the base
(reference.py: temperature 1, full distribution, seeded, cached per base model), and
d_t = log p_base(y_t | x, y_<t) − log p_cand(y_t | x, y_<t). Then per prompt

    k1 = Σ_t d_t                      unbiased for KL(p_base(·|x) ‖ p_cand(·|x)) over
                                      sequences; a single draw can be negative
    k3 = Σ_t (exp(−d_t) − 1 + d_t)    also unbiased (each term is, given its prefix,
                                      E_{y~p}[q/p − 1 − log q/p] = KL(p‖q)), never
                                      negative, lower variance when the models are close

The score is the mean of k3 over prompts, with its t interval; the mean of k1 (and its
interval) is in the metrics as a cross-check. Per-prompt values are the tasks.

Only the evaluation engine's token-in scoring is needed for the candidate (SGLang
native `/generate` with `input_ids`, `max_new_tokens: 0`, `return_logprob`,
`logprob_start_len`, through shared/engine_client `score`; vLLM's prompt_logprobs
works the same way), at temperature 1: the raw distribution. Prompts are rendered with
the policy's chat template (`ctx.tokenizer`), one user turn each, so drift is measured
where the policy acts.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from pathlib import Path

from services.evaluator.suite import EvalContext, SuiteOutcome
from services.evaluator.suites import call_timeout, reference, run_ordered
from services.evaluator.suites.stats import mean, mean_ci
from shared.auth import presented
from shared.engine_client import make_engine_client
from shared.errors import SettingsError
from shared.schemas import TaskResult

PROMPTS = (
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn leaves.",
    "What is the difference between a list and a tuple in Python?",
    "Give me three tips for a good night's sleep.",
    "Translate 'Where is the train station?' into French.",
    "Summarize the plot of Cinderella in one paragraph.",
    "How do I reverse a string in JavaScript?",
    "What are the main causes of inflation?",
    "Write a short, polite email declining a meeting invitation.",
    "If a train travels 120 km in 1.5 hours, what is its average speed?",
    "Describe the water cycle to a ten-year-old.",
    "What should I pack for a weekend hiking trip?",
    "Suggest a name for a bakery that sells only croissants.",
    "Why do cats purr?",
    "Write a SQL query that counts the rows of a table named orders.",
    "What is photosynthesis?",
    "Tell me a short joke about programmers.",
    "Compare renting and buying a home in a few bullet points.",
    "How does a hash map work?",
    "Write the opening line of a mystery novel.",
    "What is the Pythagorean theorem?",
    "Give a recipe for a simple tomato sauce.",
    "What does HTTP status code 404 mean?",
    "List the planets of the solar system in order.",
    "How can I improve my public speaking?",
    "Explain recursion with an example.",
    "What is the capital of Canada, and why was it chosen?",
    "Write a limerick about a forgetful robot.",
    "What are the benefits of regular exercise?",
    "How do vaccines work?",
    "Fix this sentence: 'Me and him goes to the store yesterday.'",
    "What is the difference between weather and climate?",
)


def log_ratios(base: Sequence[float], cand: Sequence[float]) -> list[float]:
    """d_t = log p_base − log p_cand per token."""
    if len(base) != len(cand):
        raise ValueError(f"{len(base)} base log-probs for {len(cand)} candidate log-probs")
    return [b - c for b, c in zip(base, cand, strict=True)]


def kl_k1(d: Sequence[float]) -> float:
    """Σ d_t: the plain log-ratio estimator of the sequence KL (unbiased, signed)."""
    return math.fsum(d)


def kl_k3(d: Sequence[float]) -> float:
    """Σ (exp(−d_t) − 1 + d_t): unbiased, non-negative, low variance near zero."""
    return math.fsum(math.expm1(-x) + x for x in d)


def prompt_ids(tokenizer: str) -> tuple[list[list[int]], list[int]]:
    """Each prompt as the policy's chat template renders one user turn; and the stop ids."""
    from shared.chat import ChatTemplate

    tpl = ChatTemplate.from_pretrained(tokenizer)
    ids = [tpl.encode([{"role": "user", "content": p}]) for p in PROMPTS]
    return ids, list(tpl.stop_token_ids)


async def suite(ctx: EvalContext) -> SuiteOutcome:
    cfg = ctx.cfg
    if not ctx.base_model:
        raise SettingsError(
            "the drift suite needs the base model's HF folder: set NEXTSTATE_EVAL__BASE_MODEL "
            "(the checkpoint's manifest names none)"
        )
    templated, stop_ids = await asyncio.to_thread(prompt_ids, ctx.tokenizer)
    prompts = [templated[i % len(templated)] for i in range(cfg.samples)]
    ref, cached = await asyncio.to_thread(
        reference.load_or_compute, ctx.base_model, prompts, seed=cfg.seed,
        max_new_tokens=cfg.max_tokens, stop_ids=stop_ids, cache_dir=Path(cfg.local_dir),
    )  # fmt: skip

    engine = make_engine_client(cfg.engine_kind, ctx.engine_url, api_key=presented(ctx.headers),
                                timeout=call_timeout(cfg))  # fmt: skip
    async with engine:

        async def one(i: int) -> TaskResult:
            sample = ref.samples[i]
            cand = await engine.score(sample.ids, sample.start, temperature=1.0)
            d = log_ratios(sample.logprobs, cand)
            k3 = kl_k3(d)
            return TaskResult(
                task=f"drift/{i:03d}",
                score=k3,
                details={"prompt": PROMPTS[sample.prompt % len(PROMPTS)], "tokens": len(d),
                         "kl_k3": k3, "kl_k1": kl_k1(d), "max_abs_log_ratio": max(map(abs, d))},
            )  # fmt: skip

        results = await run_ordered(len(ref.samples), one, cfg.concurrency)
    k3s = [r.score for r in results]
    k1s = [float(r.details["kl_k1"]) for r in results]
    tokens = sum(int(r.details["tokens"]) for r in results)
    ci = mean_ci(k3s)
    metrics = {"kl_k1": mean(k1s), "kl_k3_per_token": math.fsum(k3s) / max(tokens, 1),
               "tokens": float(tokens), "reference_cached": float(cached)}  # fmt: skip
    k1_ci = mean_ci(k1s)
    if k1_ci is not None:
        metrics["kl_k1_ci_low"], metrics["kl_k1_ci_high"] = k1_ci
    return SuiteOutcome(
        score=mean(k3s),
        n=len(results),
        tasks=results,
        higher_is_better=False,
        ci=(max(0.0, ci[0]), ci[1]) if ci is not None else None,
        metrics=metrics,
    )
