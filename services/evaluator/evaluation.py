"""One evaluation: a suite on a candidate version, served by this worker's evaluation engine.

`Evaluator.evaluate(job_id, run, version, suite)`:
0. with NEWEST_ONLY, a version whose evaluation had not begun when a newer one was
   committed (the newest entry of `checkpoints`) is skipped (`Superseded`): no result, and
   the gate records it as skipped once it judged a newer one. Begun means a result of it
   is in the bucket or this worker has started it, so a version is never left half done
   by one worker. Never for the base (v0) nor a job that asked for its own `samples`;
1. install the candidate: read its manifest from the bucket, download into
   `local_dir/v000042` checking every sha256 (a complete local copy is reused), prune older
   copies. Version 0 is the base model: the folder BASE_MODEL names, nothing downloaded;
2. load it into the evaluation engine (`/update_weights_from_disk` with `weight_version =
   str(version)`, or an adapter version by name beside the base weights; confirmed through
   the engine's weight version), unless the engine already serves it;
3. run the suite with an `EvalContext` (the engine's URL, the internal credential, the
   tokenizer, the base model, the config — `samples` the suite's (SUITE_SAMPLES, else
   SAMPLES), overridden when the job asks);
4. check the engine still serves the candidate (a score of other weights is no score);
5. write the `EvalResult` (id = the job id) to the bucket at `result_key`, then publish it on
   `evals`. A rerun (a worker killed mid-job) writes the same key and publishes the same id:
   consumers deduplicate by id.

`Evaluator.evaluate_model(...)` does the same for a model outside the run's lineage (`nextstate
eval run --model PATH | --version RUN:V`): an HF folder the worker and its engine see, or
another run's version installed from the bucket (under `local_dir/runs/<run>/`), served
under the weight version `model:<job id>`; its suite runs as a run of its own (the job id:
nothing keyed by run and version meets the run's), and the `EvalResult` (`model` = its label)
goes to the bucket at `model_result_key` only — never on `evals`, so no gate decides on it.
The job's state (running, retrying, done with the result, failed with the error) is kept in
`keys.model_eval(job_id)` for the CLI waiting on it.

Any failure raises; the job fails and rq retries it. Metrics: `nextstate_eval_score{suite}`
and `nextstate_eval_version` (the last version evaluated), `nextstate_eval_duration_seconds
{suite}`; `nextstate_eval_jobs_total{suite,outcome}` is counted by the runtime, which sees
every way a job ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from services.evaluator.settings import EvalConfig, EvalSettings
from services.evaluator.suite import EvalContext, Suite
from shared import checkpoints as ckpt
from shared import keys as K
from shared.auth import bearer
from shared.engine_client import EngineClient
from shared.engine_client.versions import serve_version
from shared.errors import EngineError, MalformedMessage, NextstateError, SettingsError, StoreError
from shared.evaljobs import MODEL_STATE_TTL_S, model_result_key, model_slug, result_key
from shared.schemas import CheckpointManifest, CheckpointPublished, EvalResult
from shared.store import AsyncBucket, Bucket
from shared.streams import Bus

log = logging.getLogger(__name__)

SCORE = Gauge("nextstate_eval_score", "Score of the last version evaluated, per suite", ["suite"])
VERSION = Gauge("nextstate_eval_version", "The version this worker evaluated last")
DURATION = Histogram(
    "nextstate_eval_duration_seconds", "One evaluation job, install to publish", ["suite"],
    buckets=(1, 5, 15, 30, 60, 120, 300, 600, 900, 1800, 3600),
)
JOBS = Counter("nextstate_eval_jobs_total", "Evaluation jobs by how they ended (ok, failed, handed_back, "
               "gone: pruned before its turn, skipped: a newer version came first)", ["suite", "outcome"])


BASE = 0  # version 0: the base model, never published (the baseline every curve starts from)
NEWEST_SCAN = 64  # `checkpoints` entries read back to find the newest version of a run


class Superseded(NextstateError):
    """A newer version was committed before this one's evaluation began: skipped."""


def begun(bucket: Bucket, run: str, version: int) -> bool:
    """(blocking) Whether any suite's result of `version` is in the bucket (a listing: the
    evaluator's bucket role may list everything, read only checkpoints)."""
    prefix = result_key(run, version, "x").rsplit("/", 1)[0] + "/"
    return bool(bucket.list(prefix))


def install(bucket: Bucket, root: Path, run: str, version: int) -> tuple[Path, CheckpointManifest]:
    """(blocking) The verified folder of `version` under `root` and its manifest."""
    key = ckpt.manifest_key(run, version)
    manifest = ckpt.read_manifest(bucket, key)
    if (manifest.run, manifest.version) != (run, version):
        raise StoreError(f"{key} describes {manifest.run} v{manifest.version}, not {run} v{version}")
    return ckpt.download_checkpoint(bucket, manifest, root), manifest


@dataclass
class Evaluator:
    settings: EvalSettings
    bucket: AsyncBucket
    bus: Bus
    engine: EngineClient
    resolve: Callable[[str], Suite]  # suite name -> suite (services.evaluator.suites.resolve)
    worker: str  # this worker's name, recorded in each result
    suites: dict[str, Suite] = field(default_factory=dict)
    started: set[tuple[str, int]] = field(default_factory=set)  # (run, version) begun here

    @property
    def cfg(self) -> EvalConfig:
        return self.settings.eval

    def suite(self, name: str) -> Suite:
        if name not in self.suites:
            self.suites[name] = self.resolve(name)
        return self.suites[name]

    async def evaluate(self, job_id: str, run: str, version: int, suite_name: str,
                       samples: int | None = None) -> EvalResult:
        started = time.monotonic()
        suite = self.suite(suite_name)
        cfg = self.cfg.model_copy(update={"samples": samples or self.cfg.samples_for(suite_name)})
        extra = {"job": job_id, "version": version, "suite": suite_name}
        if samples is None and version != BASE and self.cfg.newest_only:
            newer = await self.newer_than(run, version)
            if newer is not None:
                raise Superseded(f"v{newer} was committed before the evaluation of v{version} began")
        self.started.add((run, version))
        if version == BASE:
            if not cfg.base_model:
                raise SettingsError("evaluating the base model (v0) needs NEXTSTATE_EVAL__BASE_MODEL: its HF folder")
            folder, base_model, tokenizer = Path(cfg.base_model), cfg.base_model, cfg.tokenizer or cfg.base_model
            await self._load_base(cfg.base_model)
        else:
            folder, manifest = await self.bucket.run(install, self.bucket.sync, cfg.local_dir, run, version)
            await self.bucket.run(ckpt.prune_local, cfg.local_dir, cfg.keep_local, protect=[version])
            await self._load(folder, manifest)
            base_model = cfg.base_model or manifest.base_model
            tokenizer = cfg.tokenizer or (str(folder.resolve()) if manifest.format == "full"
                                          else base_model)  # an adapter has none
        ctx = EvalContext(
            run=run, version=version, engine_url=cfg.engine_url,
            headers=bearer(self.settings.internal.secret()),
            tokenizer=tokenizer, base_model=base_model, cfg=cfg, bus=self.bus,
        )
        log.info("evaluating", extra=extra)
        outcome = await suite(ctx)
        served = await self.engine.weight_version()
        if served != str(version):
            raise EngineError(f"the evaluation engine switched to weight_version {served!r} while "
                              f"{suite_name} ran on v{version}: another client loads weights into it "
                              "(give each evaluator worker an engine of its own)")
        duration = time.monotonic() - started
        result = EvalResult(
            id=job_id, run=run, version=version, suite=suite_name, score=outcome.score,
            higher_is_better=outcome.higher_is_better, n=outcome.n,
            ci_low=outcome.ci[0] if outcome.ci else None, ci_high=outcome.ci[1] if outcome.ci else None,
            tasks=outcome.tasks, metrics=outcome.metrics, duration_s=round(duration, 3),
            engine=cfg.engine_url, worker=self.worker,
        )
        # The bucket first: whoever reads the stream entry finds the object.
        await self.bucket.put_json(result_key(run, version, suite_name), result)
        await self.bus.publish(K.EVALS, result)
        SCORE.labels(suite_name).set(result.score)
        VERSION.set(version)
        DURATION.labels(suite_name).observe(duration)
        log.info("evaluated", extra={**extra, "score": result.score, "n": result.n,
                                     "duration_s": result.duration_s})
        return result

    async def newer_than(self, run: str, version: int) -> int | None:
        """The newest version of `run` on `checkpoints` when it is above `version` and the
        evaluation of `version` has not begun (here, or anywhere: a result in the bucket)."""
        if (run, version) in self.started:
            return None
        rows = await self.bus.redis.xrevrange(self.bus.keys.checkpoints, count=NEWEST_SCAN)
        newest = version
        for _, f in rows:
            try:
                msg = CheckpointPublished.from_json(f.get(K.FIELD, ""))
            except MalformedMessage:
                continue
            if msg.run == run:
                newest = max(newest, msg.version)
        if newest == version or await self.bucket.run(begun, self.bucket.sync, run, version):
            return None
        return newest

    def _engine_path(self, folder: Path) -> str:
        """An installed folder (under `local_dir`) as the evaluation engine sees it."""
        if self.cfg.engine_dir:
            rel = folder.resolve().relative_to(self.cfg.local_dir.resolve())
            return f"{self.cfg.engine_dir.rstrip('/')}/{rel.as_posix()}"
        return str(folder.resolve())

    async def _load_base(self, path: str) -> None:
        """Make the evaluation engine serve the base model (v0): its own weights when it
        still has them; otherwise without the adapters of versions, or loaded again from
        `path` (BASE_MODEL: the engine must see the model there, as it was started on it)."""
        if await self.engine.weight_version() == str(BASE):
            return
        adapters = (await self.engine.model_info()).get("lora_adapters") or {}
        for name in [str(a) for a in adapters if str(a).isdigit()]:
            try:
                await self.engine.unload_adapter(name)
            except EngineError as exc:
                log.warning("could not unload an adapter to score the base", extra={"adapter": name, "error": str(exc)})
        if await self.engine.weight_version() == str(BASE):
            return
        ok, message = await self.engine.update_weights(path, str(BASE))
        served = await self.engine.weight_version()
        if not ok or served != str(BASE):
            raise EngineError(f"the evaluation engine did not take the base model from {path}: {message} "
                              f"(it serves weight_version {served!r})")

    async def _load(self, folder: Path, manifest: CheckpointManifest) -> None:
        """Make the evaluation engine serve `manifest`'s version (nothing to do if it already
        does): full weights, or its LoRA adapter beside the base (shared/engine_client/versions.py)."""
        version = manifest.version
        if await self.engine.weight_version() == str(version):
            return
        t0 = time.monotonic()
        ok, message = await serve_version(self.engine, self._engine_path(folder), manifest)
        served = await self.engine.weight_version()
        if not ok:
            raise EngineError(f"the evaluation engine refused v{version}: {message}")
        if served != str(version):
            raise EngineError(f"the evaluation engine reports weight_version {served!r} after loading v{version}")
        log.info("candidate loaded", extra={"version": version, "load_s": round(time.monotonic() - t0, 3)})

    # -- a model outside the run -------------------------------------------------------------
    async def evaluate_model(self, job_id: str, run: str, label: str, suite_name: str, samples: int | None,
                             *, model: str | None, source: tuple[str, int] | None, attempt: int,
                             last: bool) -> EvalResult:
        """Evaluate `suite_name` on an HF folder (`model`) or another run's version (`source`),
        keeping the job's state for the CLI; the result goes to the bucket only."""
        state = self.bus.keys.model_eval(job_id)
        await self._state(state, state="running", attempt=str(attempt), error="")
        try:
            result = await self._evaluate_model(job_id, run, label, suite_name, samples, model, source)
        except Exception as exc:
            await self._state(state, state="failed" if last else "retrying",
                              error=f"{type(exc).__name__}: {exc}"[:2000])
            raise
        await self._state(state, state="done", result=result.to_json())
        return result

    async def _restore(self, before: dict[str, object], tag: str) -> None:
        """Serve again the weights the engine served before a model's evaluation (best effort:
        the next candidate is loaded in any case; a failure is logged)."""
        path = before.get("model_path")
        version = before.get("base_weight_version") or before.get("weight_version")
        try:
            if not path or await self.engine.weight_version() != tag:
                return
            ok, message = await self.engine.update_weights(str(path), str(version))
            if not ok:
                log.warning("could not serve the engine's weights again after a model's evaluation",
                            extra={"path": path, "error": message[:300]})
        except EngineError as exc:
            log.warning("could not serve the engine's weights again after a model's evaluation",
                        extra={"path": path, "error": str(exc)[:300]})

    async def _state(self, key: str, **fields: str) -> None:
        pipe = self.bus.redis.pipeline(transaction=True)
        pipe.hset(key, mapping={**fields, "at": str(time.time())})
        pipe.expire(key, MODEL_STATE_TTL_S)
        await pipe.execute()

    async def _evaluate_model(self, job_id: str, run: str, label: str, suite_name: str, samples: int | None,
                              model: str | None, source: tuple[str, int] | None) -> EvalResult:
        started = time.monotonic()
        suite = self.suite(suite_name)
        cfg = self.cfg.model_copy(update={"samples": samples or self.cfg.samples_for(suite_name)})
        if source is not None:
            src_run, src_version = source
            root = cfg.local_dir / "runs" / model_slug(src_run)
            folder, manifest = await self.bucket.run(install, self.bucket.sync, root, src_run, src_version)
            if manifest.format != "full":
                raise StoreError(f"{src_run} v{src_version} is a LoRA adapter version: only full versions of "
                                 "another run are evaluated beside this one (adapter names are version "
                                 "numbers, which this run's own versions use)")
            await self.bucket.run(ckpt.prune_local, root, cfg.keep_local, protect=[src_version])
            path, base_model = self._engine_path(folder), cfg.base_model or manifest.base_model
            tokenizer = cfg.tokenizer or str(folder.resolve())
        else:
            folder = Path(model or "")
            if not (folder / "config.json").is_file():
                raise StoreError(f"{model} is not an HF model folder this evaluator can read (no config.json): "
                                 "give a path the evaluator and its evaluation engine both see")
            path, base_model = str(folder.resolve()), cfg.base_model or ""
            own = any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
            tokenizer = str(folder.resolve()) if own or not cfg.tokenizer else cfg.tokenizer
        # A weight version of its own: never a version number, which this run's versions use.
        # What the engine served before comes back afterwards: an adapter version of the run
        # must meet its own base weights, not this model's.
        tag = f"model:{job_id}"
        before = await self.engine.model_info()
        try:
            if await self.engine.weight_version() != tag:
                ok, message = await self.engine.update_weights(path, tag)
                if not ok:
                    raise EngineError(f"the evaluation engine refused {label}: {message} (it serves the "
                                      "policy's architecture: a model of another shape needs an engine of its own)")
                if (served := await self.engine.weight_version()) != tag:
                    raise EngineError(f"the evaluation engine reports weight_version {served!r} after loading {label}")
            ctx = EvalContext(run=job_id, version=0, engine_url=cfg.engine_url,
                              headers=bearer(self.settings.internal.secret()), tokenizer=tokenizer,
                              base_model=base_model, cfg=cfg, bus=self.bus)
            log.info("evaluating a model", extra={"job": job_id, "model": label, "suite": suite_name})
            outcome = await suite(ctx)
            if (served := await self.engine.weight_version()) != tag:
                raise EngineError(f"the evaluation engine switched to weight_version {served!r} while "
                                  f"{suite_name} ran on {label}: another client loads weights into it")
        finally:
            await self._restore(before, tag)
        duration = time.monotonic() - started
        result = EvalResult(
            id=job_id, run=run, version=0, suite=suite_name, score=outcome.score, model=label,
            higher_is_better=outcome.higher_is_better, n=outcome.n,
            ci_low=outcome.ci[0] if outcome.ci else None, ci_high=outcome.ci[1] if outcome.ci else None,
            tasks=outcome.tasks, metrics=outcome.metrics, duration_s=round(duration, 3),
            engine=cfg.engine_url, worker=self.worker,
        )
        await self.bucket.put_json(model_result_key(run, label, suite_name), result)
        DURATION.labels(suite_name).observe(duration)
        log.info("evaluated a model", extra={"job": job_id, "model": label, "score": result.score, "n": result.n})
        return result
