"""The one model thread: admits requests, batches their decode steps, swaps weights.

The event loop never runs the model. Requests wait in a bounded FIFO; up to
`max_running` are active at once. Each loop iteration advances every active request by
one token: a newly admitted request runs its prompt alone (prefill) and samples its
first token, then joins the decode batch (`services.engine.batch`), where one forward
pass gives every member its next token. With `batch_decode` off (or a model whose cache
cannot be batched) each request steps alone with its own KV cache at batch size 1 —
bit-exact under any load, and slower: the weights are read once per request per token.

A weight swap is a control message to this thread: admission stops, in-flight requests
finish (or are aborted first when asked), then the model reference is replaced while
nothing is mid-generation, and admission resumes on the new weights. Pausing freezes
active requests in place and holds new ones in the queue.

LoRA adapters need no swap: loading one makes it the default for requests submitted from
then on, while those already submitted keep theirs (each job holds its adapter); an
unloaded adapter lives on in the jobs that still use it. A full swap is refused while
adapters are loaded (they were made for the weights it would replace).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from services.engine import metrics
from services.engine.batch import DecodeBatch, supports
from services.engine.lora import Adapter, attach
from services.engine.model import LoadedModel
from services.engine.request import Job
from shared.errors import EngineRejected, EngineUnavailable

log = logging.getLogger(__name__)


@dataclass
class _Swap:
    model: LoadedModel
    version: str
    in_flight: int
    done: concurrent.futures.Future[int]


class QueueFull(EngineUnavailable):
    """Every waiting slot is taken: the caller should retry later (HTTP 503)."""


class SwapRefused(Exception):
    """A weight swap cannot happen now (the message says why)."""


class AdapterRefused(Exception):
    """A LoRA adapter cannot be loaded now (the message says why)."""


class UnknownAdapter(EngineRejected):
    """A request or an unload names a LoRA adapter that is not loaded (HTTP 400)."""


class Scheduler:
    def __init__(
        self,
        model: LoadedModel,
        tokenizer: Any,
        weight_version: str,
        *,
        max_running: int,
        max_queue: int,
        context_length: int | None = None,
        batch_decode: bool = True,
        served_name: str = "",
    ) -> None:
        self.model = model
        self.served_name = served_name
        self.batch_decode = batch_decode
        self._batch = DecodeBatch(model) if batch_decode else None
        self.tokenizer = tokenizer
        self.base_version = weight_version  # the base weights' version label
        # LoRA adapters by name, oldest first; requests that name none take `_default`.
        self.adapters: dict[str, Adapter] = {}
        self._default: str | None = None
        self.max_running = max_running
        self.max_queue = max_queue
        self._ctx_override = context_length
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: list[Job] = []
        self._paused = False
        self._swap: _Swap | None = None
        self._stopping = False
        self._closed = False  # no new requests (shutting down)
        self._thread = threading.Thread(target=self._run, name="engine-model", daemon=True)
        self._eos = self._eos_ids(model)

    # -- called from the event loop --------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def context_length(self) -> int:
        return self._ctx_override or self.model.context_length

    @property
    def weight_version(self) -> str:
        """What a request naming no adapter is served with: the default adapter's name, or
        the base weights' version when no adapter is loaded."""
        return self._default if self._default is not None else self.base_version

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping or self._closed:
                raise EngineUnavailable("the engine is shutting down")
            job.adapter = self._adapter_for(job.params.adapter)
            if len(self._waiting) >= self.max_queue + max(0, self.max_running - len(self._active)):
                metrics.REJECTED.inc()
                raise QueueFull(
                    f"engine queue is full ({len(self._waiting)} waiting, "
                    f"{len(self._active)} running); retry later"
                )
            self._waiting.append(job)
            metrics.QUEUE_DEPTH.set(len(self._waiting))
            self._cond.notify_all()

    def abort(self, job: Job, reason: str) -> None:
        with self._cond:
            if job.finish is None and job.abort_reason is None:
                job.abort_reason = reason
                self._cond.notify_all()

    def pause(self, abort: bool) -> int:
        """Hold new requests and freeze active ones; with `abort`, end every request first."""
        with self._cond:
            self._paused = True
            n = self._abort_all_locked("generation paused with mode=abort") if abort else 0
            self._cond.notify_all()
            return n

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def swap(self, model: LoadedModel, version: str, *, abort: bool) -> concurrent.futures.Future[int]:
        """Schedule a swap; the future resolves (to the in-flight count) once it happened."""
        with self._cond:
            if self._swap is not None:
                raise SwapRefused("another weight update is in progress")
            if self._stopping:
                raise SwapRefused("the engine is shutting down")
            if self.adapters:
                raise SwapRefused(f"LoRA adapters are loaded ({', '.join(self.adapters)}) on the weights "
                                  "it would replace: unload them first")
            running = sum(1 for j in self._active if j.abort_reason is None)
            if self._paused and running and not abort:
                raise SwapRefused(
                    f"generation is paused with {running} request(s) mid-generation; "
                    "continue_generation first, or pass abort_all_requests=true"
                )
            in_flight = self._abort_all_locked("aborted for a weight update") if abort else running
            self._swap = _Swap(model, version, in_flight, concurrent.futures.Future())
            self._cond.notify_all()
            return self._swap.done

    # -- LoRA adapters (services/engine/lora.py) ----------------------------------------

    def _adapter_for(self, name: str | None) -> Adapter | None:
        if name is None:
            return self.adapters.get(self._default) if self._default is not None else None
        if name in self.adapters:
            return self.adapters[name]
        if name in (self.base_version, self.served_name):
            return None  # the base weights, named
        loaded = ", ".join(self.adapters) or "none"
        raise UnknownAdapter(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")

    def add_adapter(self, adapter: Adapter, max_loaded: int) -> None:
        """Serve `adapter` from the next request on, as the default (the newest). A name
        already loaded from the same folder just becomes the default again."""
        with self._cond:
            same = self.adapters.get(adapter.name)
            if same is not None and same.path != adapter.path:
                raise AdapterRefused(f"LoRA adapter {adapter.name!r} is already loaded from {same.path}: "
                                     "unload it first")
            if same is None and len(self.adapters) >= max_loaded:
                raise AdapterRefused(f"{len(self.adapters)} LoRA adapters are loaded, the most this engine "
                                     "holds (NEXTSTATE_ENGINE__MAX_LORAS): unload one first")
            if same is None:
                attach(self.model.model, adapter.modules, self.model.lora)
                self.adapters[adapter.name] = adapter
            self._default = adapter.name

    def remove_adapter(self, name: str) -> None:
        """No new request takes `name`; those running on it finish on it."""
        with self._cond:
            if self.adapters.pop(name, None) is None:
                raise UnknownAdapter(f"LoRA adapter {name!r} is not loaded")
            if self._default == name:
                self._default = next(reversed(self.adapters), None)

    def set_default(self, version: str) -> None:
        """SGLang's /update_weight_version: the default adapter when `version` names a loaded
        one, else the base weights' version label."""
        with self._cond:
            if version in self.adapters:
                self._default = version
            else:
                self.base_version = version

    def wait_idle(self, timeout: float) -> bool:
        """Block until nothing is queued or running (True), or `timeout` passes (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._active and not self._waiting, timeout)

    def close(self) -> None:
        """Refuse new requests from now on (those already here continue)."""
        with self._cond:
            self._closed = True

    def stop(self, timeout: float) -> None:
        with self._cond:
            self._stopping = True
            self._abort_all_locked("the engine is shutting down")
            if self._swap is not None:
                self._swap.done.set_exception(SwapRefused("the engine is shutting down"))
                self._swap = None
            self._cond.notify_all()
        self._thread.join(timeout)

    def load(self) -> tuple[int, int]:
        with self._cond:
            return len(self._waiting), len(self._active)

    # -- the model thread -------------------------------------------------------------

    def _abort_all_locked(self, reason: str) -> int:
        n = 0
        for job in [*self._active, *self._waiting]:
            if job.finish is None and job.abort_reason is None:
                job.abort_reason = reason
                n += 1
        return n

    @staticmethod
    def _eos_ids(model: LoadedModel) -> frozenset[int]:
        ids: set[int] = set()
        for src in (getattr(model.model, "generation_config", None), model.config):
            eos = getattr(src, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list | tuple):
                ids.update(int(e) for e in eos)
        return frozenset(ids)

    def _run(self) -> None:
        try:
            while self._iterate():
                pass
        except Exception:  # pragma: no cover - a bug here must not leave callers hanging
            log.exception("the engine's model thread crashed")
            with self._cond:
                self._stopping = True
                jobs = [*self._active, *self._waiting]
            for job in jobs:
                job.deliver(EngineUnavailable("the engine's model thread crashed"))

    def _iterate(self) -> bool:
        ended: list[Job] = []
        runnable: list[Job] = []
        with self._cond:
            while True:
                ended += self._reap_locked()
                if self._stopping and not self._active and not self._waiting:
                    break
                if self._swap is not None and not self._active:
                    self._do_swap_locked()
                if not self._paused and self._swap is None:
                    self._admit_locked()
                runnable = [] if self._paused else list(self._active)
                if runnable or ended:
                    break
                self._cond.wait()
            stopping_now = self._stopping and not self._active and not self._waiting
        for job in ended:
            self._finish(job)
        decoding: list[Job] = []
        joining: list[Job] = []
        for job in runnable:
            if job.abort_reason is not None:
                continue
            if self._batch is not None and job in self._batch:
                decoding.append(job)
                continue
            joins = self._batch is not None and not job.prefilled
            self._advance(job)
            if joins and job.finish is None and supports(job.cache):
                joining.append(job)
        if self._batch is not None:
            if decoding:
                self._decode(decoding)
            # finished or aborted rows leave (while paused, rows stay as they are)
            self._batch.keep([j for j in self._batch.members if j.finish is None and j.abort_reason is None])
            for job in joining:  # decode with the batch from the next iteration on
                self._batch.add(job)
        if any(j.finish is not None for j in runnable):
            with self._cond:
                self._active = [j for j in self._active if j.finish is None]
                metrics.RUNNING.set(len(self._active))
                self._cond.notify_all()
        return not stopping_now

    def _reap_locked(self) -> list[Job]:
        """Take aborted requests out of the queue and the active set."""
        out = [j for j in (*self._active, *self._waiting) if j.abort_reason is not None]
        if out:
            self._active = [j for j in self._active if j.abort_reason is None]
            self._waiting = collections.deque(j for j in self._waiting if j.abort_reason is None)
            for job in out:
                if job.model is None:  # never admitted
                    job.tokenizer = self.tokenizer
                    job.weight_version = job.adapter.name if job.adapter is not None else self.base_version
                job.finish = {"type": "abort", "message": job.abort_reason}
            metrics.QUEUE_DEPTH.set(len(self._waiting))
            metrics.RUNNING.set(len(self._active))
            self._cond.notify_all()
        return out

    def _admit_locked(self) -> None:
        while self._waiting and len(self._active) < self.max_running:
            job = self._waiting.popleft()
            job.bind(self.model, self.base_version, self.tokenizer, self._eos, self.context_length)
            self._active.append(job)
        metrics.QUEUE_DEPTH.set(len(self._waiting))
        metrics.RUNNING.set(len(self._active))

    def _do_swap_locked(self) -> None:
        swap, self._swap = self._swap, None
        assert swap is not None
        self.model, self.base_version = swap.model, swap.version
        if self._batch is not None:  # empty: nothing is mid-generation
            self._batch = DecodeBatch(swap.model)
        self._eos = self._eos_ids(swap.model)
        log.info("weights swapped", extra={"weight_version": swap.version, "path": swap.model.path})
        swap.done.set_result(swap.in_flight)

    def _decode(self, jobs: list[Job]) -> None:
        """One batched decode step for `jobs` (the batch's live members)."""
        batch = self._batch
        assert batch is not None
        batch.keep(jobs)
        metrics.DECODE_BATCH.observe(len(batch))
        try:
            logits = batch.step()
        except Exception as exc:
            log.exception("batched decode step failed", extra={"rows": len(batch)})
            for job in batch.members:
                job.finish = {"type": "abort", "message": f"internal error: {type(exc).__name__}"}
                job.deliver(exc)
                metrics.REQUESTS.labels(status="error").inc()
            batch.clear()
            return
        for row, job in enumerate(list(batch.members)):
            self._advance(job, logits[row])

    def _advance(self, job: Job, logits: torch.Tensor | None = None) -> None:
        """A step for one job: its own forward (prefill, or an unbatched decode), or
        sampling from the logits the batch computed for it."""
        try:
            if logits is None:
                job.step()
            else:
                job.take(logits)
        except Exception as exc:
            log.exception("generation step failed", extra={"rid": job.params.rid})
            job.finish = {"type": "abort", "message": f"internal error: {type(exc).__name__}"}
            job.deliver(exc)
            metrics.REQUESTS.labels(status="error").inc()
            return
        if job.finish is not None:
            self._finish(job)
        elif job.due():
            job.deliver(job.snapshot())

    def _finish(self, job: Job) -> None:
        snap = job.snapshot()
        job.deliver(snap)
        kind = str((job.finish or {}).get("type", "abort"))
        metrics.REQUESTS.labels(status=kind).inc()
        metrics.GENERATED_TOKENS.inc(len(job.output_ids))
        metrics.PROMPT_TOKENS.inc(len(job.params.input_ids))
        metrics.LATENCY.observe(time.monotonic() - job.created)
