"""The engine as the HTTP layer sees it: run a request, reload weights, describe itself.

It owns the `Scheduler` (the model thread) and the tokenizer. Requests are async
iterators of snapshots; leaving the iteration early (a client that went away) aborts
the request so it stops using the model. Weight updates load and check the new
checkpoint in a helper thread while the old weights keep serving, then hand the swap
to the model thread; a failure at any point leaves the old weights and version serving.
LoRA adapters load the same way (read and checked off the model thread) and need no
swap: `load_adapter` makes the new one the default for the requests that follow.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from services.engine import metrics
from services.engine.errors import ModelLoadError
from services.engine.lora import AdapterError, read_adapter
from services.engine.model import LoadedModel, incompatible, load_model
from services.engine.request import GenParams, Job, Snapshot
from services.engine.scheduler import AdapterRefused, Scheduler, SwapRefused, UnknownAdapter
from services.engine.settings import EngineGroup

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, model: LoadedModel, tokenizer: Any, cfg: EngineGroup, decoder: Any = None) -> None:
        """`tokenizer` serves the event loop; `decoder`, a second instance, the model thread.

        Fast tokenizers mutate internal state on some calls, so two threads never share one.
        """
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.tokenizer_path = cfg.tokenizer or cfg.model
        self.served_model_name = cfg.served_model_name or Path(cfg.model).name or "model"
        self.dtype = cfg.dtype
        self.scheduler = Scheduler(
            model,
            decoder if decoder is not None else tokenizer,
            cfg.weight_version,
            max_running=cfg.max_running,
            max_queue=cfg.max_queue,
            context_length=cfg.context_length,
            batch_decode=cfg.batch_decode,
            served_name=self.served_model_name,
        )
        self._update_lock = asyncio.Lock()
        self.started = time.time()

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        self.scheduler.start()

    async def drain(self, grace: float) -> None:
        """Refuse new requests, give running ones up to `grace` seconds, abort the rest."""
        self.scheduler.close()
        await asyncio.to_thread(self.scheduler.wait_idle, grace)
        await self.stop()

    async def stop(self) -> None:
        await asyncio.to_thread(self.scheduler.stop, self.cfg.shutdown_grace_s)

    # -- state ------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    @property
    def model_path(self) -> str:
        return self.scheduler.model.path

    @property
    def vocab_size(self) -> int:
        return self.scheduler.model.vocab_size

    @property
    def context_length(self) -> int:
        return self.scheduler.context_length

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "served_model_name": self.served_model_name,
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
            "base_weight_version": self.scheduler.base_version,
            "lora_adapters": self.loaded_adapters(),
        }

    def loaded_adapters(self) -> dict[str, str]:
        """name -> folder of every loaded LoRA adapter, oldest first (SGLang's `loaded_adapters`)."""
        return {name: a.path for name, a in list(self.scheduler.adapters.items())}

    # -- requests ---------------------------------------------------------------------

    def submit(self, params: GenParams) -> Job:
        """Queue a request (raises `QueueFull` when the queue is at its bound)."""
        job = Job(params, asyncio.get_running_loop())
        self.scheduler.submit(job)
        return job

    async def outputs(self, job: Job) -> AsyncIterator[Snapshot]:
        """The job's snapshots as they come; the last one has `finish` set."""
        finished = False
        try:
            while True:
                item = await job.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finish is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.scheduler.abort(job, "the client went away")

    async def final(self, job: Job) -> Snapshot:
        last: Snapshot | None = None
        async for snap in self.outputs(job):
            last = snap
        assert last is not None
        return last

    # -- weights ----------------------------------------------------------------------

    async def update_weights(
        self, model_path: str, weight_version: str | None, *, abort: bool
    ) -> tuple[bool, str, int]:
        """Load `model_path`, check it fits, swap it in between requests.

        Returns (success, message, in-flight requests that were waited for or aborted).
        """
        async with self._update_lock:
            started = time.monotonic()
            current = self.scheduler.model
            try:
                new = await asyncio.to_thread(
                    load_model, model_path, current.device, self.dtype
                )
                reason = incompatible(current, new)
                if reason is not None:
                    raise ModelLoadError(f"checkpoint {model_path!r} does not fit: {reason}")
            except ModelLoadError as exc:
                metrics.WEIGHT_UPDATES.labels(result="rejected").inc()
                log.warning("weight update refused", extra={"path": model_path, "reason": str(exc)})
                return False, f"Failed to update weights: {exc}. Still serving weight version {self.weight_version}.", 0
            metrics.LOAD_SECONDS.observe(time.monotonic() - started)
            version = weight_version if weight_version is not None else self.weight_version
            try:
                future = self.scheduler.swap(new, version, abort=abort)
                in_flight = await asyncio.wrap_future(future)
            except SwapRefused as exc:
                metrics.WEIGHT_UPDATES.labels(result="refused").inc()
                return False, f"Failed to update weights: {exc}.", 0
            metrics.WEIGHT_UPDATES.labels(result="success").inc()
            took = time.monotonic() - started
            log.info(
                "weights updated",
                extra={"path": model_path, "weight_version": version, "seconds": round(took, 3)},
            )
            return True, f"Succeeded to update model weights in {took:.2f}s.", in_flight

    # -- LoRA adapters ------------------------------------------------------------------

    async def load_adapter(self, name: str, path: str) -> tuple[bool, str]:
        """Read and check the adapter folder in a helper thread, then serve it as `name`, the
        default from the next request on. (success, message); the served set is unchanged on
        failure."""
        async with self._update_lock:
            started = time.monotonic()
            try:
                if not name or not name.isprintable():
                    raise AdapterError("lora_name must be a non-empty printable string")
                adapter = await asyncio.to_thread(
                    read_adapter, name, path, self.scheduler.model.model, max_rank=self.cfg.max_lora_rank)
                self.scheduler.add_adapter(adapter, self.cfg.max_loras)
            except (AdapterError, AdapterRefused) as exc:
                metrics.ADAPTER_LOADS.labels(result="rejected").inc()
                log.warning("LoRA adapter refused", extra={"adapter": name, "path": path, "reason": str(exc)})
                return False, f"Failed to load LoRA adapter {name!r}: {exc}"
            metrics.ADAPTER_LOADS.labels(result="success").inc()
            took = time.monotonic() - started
            log.info("LoRA adapter loaded", extra={"adapter": name, "path": path, "rank": adapter.rank,
                                                   "modules": len(adapter.weights), "seconds": round(took, 3)})
            return True, f"Loaded LoRA adapter {name!r} (rank {adapter.rank}) in {took:.2f}s."

    async def unload_adapter(self, name: str) -> tuple[bool, str]:
        """Stop serving `name` to new requests (running ones finish on it)."""
        async with self._update_lock:
            try:
                self.scheduler.remove_adapter(name)
            except UnknownAdapter as exc:
                return False, str(exc)
            log.info("LoRA adapter unloaded", extra={"adapter": name, "default": self.weight_version})
            return True, f"Unloaded LoRA adapter {name!r}."
