"""The `classifier` judge: a sequence-classification reward model in the judge process.

`NEXTSTATE_JUDGE__TYPE=classifier` with `NEXTSTATE_JUDGE__CLASSIFIER=<HF folder>` (any
transformers `AutoModelForSequenceClassification` with its tokenizer, local files only)
scores the turn as the PRM reads it — the user's request, the response and the next
state, rendered by `render_for_judge` — and the reward is 2p − 1 with p the
positive class's probability: softmax over the labels at `CLASSIFIER_POSITIVE_LABEL`
(default 1), or sigmoid of the single logit of a one-label model. No votes, no quorum:
the one Vote keeps p in its text.

Batched: turns in flight queue their texts; one worker takes up to
`CLASSIFIER_BATCH_SIZE` of them (waiting at most `CLASSIFIER_BATCH_WAIT_MS` for more),
pads them (truncated to `CLASSIFIER_MAX_LENGTH` tokens) and runs one forward in a
worker thread, so the event loop keeps reading turns meanwhile. A forward that raises
fails the turns of its batch (retried, then dead-lettered), never scores them.
torch and transformers are imported only when this judge is built (the judge's
`classifier` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from services.judge import metrics
from services.judge.settings import JudgeConfig
from services.judge.verdict import Verdict, render_for_judge
from shared.errors import NextstateError, SettingsError
from shared.schemas import Turn, Vote

log = logging.getLogger(__name__)


class ClassifierError(NextstateError):
    """The classifier's forward failed; the turns of that batch are retried."""


class SequenceClassifier:
    """A tokenizer and a sequence-classification model: texts in, positive probabilities out."""

    def __init__(self, folder: str, positive_label: int, max_length: int) -> None:
        path = Path(folder)
        if not (path / "config.json").is_file():
            raise SettingsError(
                f"NEXTSTATE_JUDGE__CLASSIFIER={folder!r} is not an HF model folder (no config.json)"
            )
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.model: Any = AutoModelForSequenceClassification.from_pretrained(
            str(path), local_files_only=True
        )
        self.model.eval()
        if self.tokenizer.pad_token_id is None:  # decoder-only classifiers often have none
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.num_labels = int(self.model.config.num_labels)
        if self.num_labels > 1 and not 0 <= positive_label < self.num_labels:
            raise SettingsError(
                f"NEXTSTATE_JUDGE__CLASSIFIER_POSITIVE_LABEL={positive_label}: the classifier "
                f"has {self.num_labels} labels"
            )
        self.positive_label = positive_label
        self.max_length = max_length

    def probabilities(self, texts: list[str]) -> list[float]:
        """p(positive) of each text, in one padded forward."""
        torch = self.torch
        enc = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        with torch.inference_mode():
            logits = self.model(**enc).logits.float()  # (B, num_labels)
        if self.num_labels == 1:
            p = torch.sigmoid(logits[:, 0])
        else:
            p = torch.softmax(logits, dim=-1)[:, self.positive_label]
        return [float(x) for x in p.tolist()]


class ClassifierJudge:
    """Queues each turn's text; one worker scores them in batches."""

    name = "classifier"

    def __init__(self, cfg: JudgeConfig, classifier: SequenceClassifier | None = None) -> None:
        assert cfg.classifier is not None
        self.cfg = cfg
        self.classifier = classifier or SequenceClassifier(
            cfg.classifier, cfg.classifier_positive_label, cfg.classifier_max_length
        )
        self.queue: asyncio.Queue[tuple[str, asyncio.Future[float]]] = asyncio.Queue()
        self.worker: asyncio.Task[None] | None = None
        self.batches = 0  # forwards run (a test and the log read it)

    async def judge(self, turn: Turn) -> Verdict:
        if self.worker is None or self.worker.done():
            self.worker = asyncio.create_task(self._work(), name="classifier")
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        await self.queue.put((render_for_judge(turn, self.cfg), future))
        p = await future
        reward = 2.0 * p - 1.0
        metrics.VOTES.labels("classifier", metrics.score_label(reward)).inc()
        return Verdict(
            reward=reward, votes=[Vote(score=reward, text=f"classifier p={p:.6f}")],
            judge=self.name, judge_model=self.cfg.classifier,
        )  # fmt: skip

    async def _work(self) -> None:
        wait_s = self.cfg.classifier_batch_wait_ms / 1000
        while True:
            batch = [await self.queue.get()]
            deadline = time.monotonic() + wait_s
            while len(batch) < self.cfg.classifier_batch_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), left))
                except TimeoutError:
                    break
            batch = [(text, fut) for text, fut in batch if not fut.cancelled()]
            if not batch:
                continue
            try:
                probs = await asyncio.to_thread(self.classifier.probabilities, [t for t, _ in batch])
            except Exception as exc:  # fail these turns (retried), keep serving the next ones
                err = ClassifierError(f"classifier forward failed: {type(exc).__name__}: {exc}")
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            self.batches += 1
            for (_, fut), p in zip(batch, probs, strict=True):
                if not fut.done():
                    fut.set_result(p)

    async def aclose(self) -> None:
        if self.worker is not None:
            self.worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.worker
