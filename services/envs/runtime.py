"""The asyncio half of an environment worker, on a thread of its own beside the rq worker.

rq's worker owns the main thread (its signal handlers and job timeouts need it). This
thread runs one event loop for the life of the process, holding what every episode uses,
opened once: the policy client (`AsyncOpenAI` on the collector: one pooled HTTP client),
the Redis bus (the outcome publisher), and the ops port (/healthz, /readyz: Redis and
the policy endpoint's /models, /metrics).

A job (services/envs/jobs.py, in the main thread) hands its episode to this loop with
`run_job` and waits; once a stop was requested it waits `shutdown_grace_s` more, then
cancels the episode and raises `HandedBack` (the worker requeues the job, no retry spent).

One attempt of an episode job:
1. its outcome was published already (a worker died after publishing): return at once;
2. a fresh environment and `Sandbox`, a new session id (`episode_session_id(job id,
   attempt, nonce)`: a rerun never continues a dead attempt's session), the agent loop
   (services/envs/episode.py), the verdict;
3. the `Outcome` (id = the job id), published once (services/envs/outcomes.py).
An attempt that fails (the policy unreachable after the client's retries, the sandbox,
the environment's own bug, the job timeout) raises, and rq runs the job again while it
has retries; the last attempt publishes an Outcome with `error` set and reward 0 (the
buffer never trains it), then fails the job — so every enqueued episode ends with exactly
one Outcome.

An evaluation episode (the job's `target`, shared/envjobs.py `enqueue_eval_episodes`) runs
the same loop against the evaluation engine it names (only one of `eval_engines`: the
internal credential goes to no other URL), at the target's temperature, without the closing
request; its result (verdict, steps, or the last attempt's error) goes to the evaluation's
hash `keys.eval_episodes(evaluation)`, never to `outcomes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from typing import Any

from openai import AsyncOpenAI
from prometheus_client import Counter, Histogram

from services.envs.base import EnvironmentNotFound, Task, load_environment, load_tasks
from services.envs.episode import run_episode
from services.envs.outcomes import OutcomePublisher
from services.envs.sandbox import Sandbox
from services.envs.settings import EnvsSettings
from shared.envjobs import EVAL_RESULT_TTL_S
from shared.errors import NextstateError
from shared.jobloop import JobLoop
from shared.schemas import Outcome, episode_job_id, episode_session_id
from shared.streams import Bus
from shared.telemetry import embedded_server, ops_app

log = logging.getLogger(__name__)

EPISODES = Counter("nextstate_envs_episodes_total", "Episode attempts by how they ended",
                   ["env", "outcome"])  # passed | failed | error | retried | duplicate | handed_back
EPISODE_SECONDS = Histogram("nextstate_envs_episode_seconds", "Wall time of an episode", ["env"],
                            buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600))


class HandedBack(NextstateError):
    """The worker is stopping: the episode was cancelled and goes back to the queue."""


def resolve_task(env: str, ref: dict[str, Any]) -> Task:
    """The task a job's reference names (shared/envjobs.py `task_json` / `task_pick`)."""
    if "task" in ref:
        return Task.model_validate(ref["task"])
    pick = ref["pick"]
    tasks = load_tasks(env, pick["split"], pick["n"], pick["seed"])
    if not tasks:
        raise EnvironmentNotFound(f"environment {env!r} has no {pick['split']} tasks")
    return tasks[int(pick["position"]) % len(tasks)]


class Runtime(JobLoop):
    def __init__(self, settings: EnvsSettings, worker: str) -> None:
        super().__init__("envs worker", settings.envs.shutdown_grace_s)
        self.settings = settings
        self.worker = worker
        self.bus: Bus | None = None
        self.publisher: OutcomePublisher | None = None
        self.client: AsyncOpenAI | None = None
        self.eval_clients: dict[str, AsyncOpenAI] = {}  # evaluation engine root -> its client

    async def main(self) -> None:
        settings, cfg = self.settings, self.settings.envs
        client = AsyncOpenAI(
            base_url=cfg.url, api_key=cfg.api_key.get_secret_value(), max_retries=cfg.request_retries,
            timeout=cfg.request_timeout_s,
        )
        async with Bus(settings) as bus, client:
            self.bus, self.client = bus, client
            self.publisher = OutcomePublisher(bus)

            async def policy_ok() -> None:
                await client.with_options(max_retries=0, timeout=5.0).models.list()

            server = embedded_server(ops_app({"redis": bus.ping, "policy": policy_ok}, settings.internal),
                                     cfg.host, cfg.port)
            ops = asyncio.create_task(server.serve(), name="ops")
            while not server.started:
                if ops.done():
                    await ops  # raises (SystemExit from a port that would not bind)
                    raise RuntimeError(f"the ops port {cfg.host}:{cfg.port} stopped at start")
                await asyncio.sleep(0.02)
            self.ready()
            log.info("envs worker started", extra={"policy": cfg.url, "worker": self.worker})
            finish = asyncio.create_task(self.finished())
            await asyncio.wait({finish, ops}, return_when=asyncio.FIRST_COMPLETED)
            if not finish.done():
                finish.cancel()
                raise RuntimeError(f"the ops port stopped: {ops.exception()!r}")
            server.should_exit = True
            await asyncio.gather(ops, return_exceptions=True)
            for eval_client in self.eval_clients.values():
                await eval_client.close()

    # -- jobs (called from the worker's thread) ----------------------------------------------------
    def run_job(self, *, run: str, env: str, task_id: str, task: dict[str, Any], group: str, index: int,
                group_size: int, attempt: int, last_attempt: bool,
                target: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run one attempt on the loop and wait; hand it back when the worker stops."""
        if self.publisher is None:
            raise RuntimeError("the envs worker's event loop is not running")
        job_id = episode_job_id(run, env, task_id, group, index)

        def handed_back() -> HandedBack:
            EPISODES.labels(env, "handed_back").inc()
            return HandedBack("the worker is stopping: the episode goes back to the queue")

        def interrupted(exc: BaseException) -> None:
            if last_attempt and target is not None:
                self._record_eval_error(target, job_id, task_id, exc)
            elif last_attempt:  # rq's job timeout (or a cold stop) ended the last attempt: say so once
                self._publish_error(run, env, job_id, task_id, group, index, group_size, attempt, exc)

        if target is not None:
            return self.wait(self.evaluate(env, job_id, task_id, task, target, last_attempt), handed_back,
                             interrupted)
        return self.wait(self.attempt(run, env, job_id, task_id, task, group, index, group_size, attempt,
                                      last_attempt), handed_back, interrupted)

    def _record_eval_error(self, target: dict[str, Any], job_id: str, task_id: str, exc: BaseException) -> None:
        if self.stop_requested_at is not None:
            return
        result = {"task_id": task_id, "error": f"{type(exc).__name__}: {exc}"}
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._record_eval(target, job_id, result), self.loop).result(timeout=10)

    def _publish_error(self, run: str, env: str, job_id: str, task_id: str, group: str, index: int,
                       group_size: int, attempt: int, exc: BaseException) -> None:
        if self.stop_requested_at is not None:
            return  # a stop, not a failure: the job goes back to the queue
        outcome = self._outcome(run, env, job_id, task_id, group, index, group_size, attempt,
                                episode_session_id(job_id, attempt, secrets.token_hex(4)),
                                error=f"{type(exc).__name__}: {exc}")
        assert self.publisher is not None
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.publisher.publish_once(outcome), self.loop).result(timeout=10)

    # -- one attempt (on the loop) -------------------------------------------------------------
    def _outcome(self, run: str, env: str, job_id: str, task_id: str, group: str, index: int, group_size: int,
                 attempt: int, session_id: str, **fields: Any) -> Outcome:
        return Outcome(id=job_id, run=run, env=env, task_id=task_id,
                       session_id=session_id, group=group, group_index=index, group_size=group_size,
                       attempt=attempt, worker=self.worker, reward=fields.pop("reward", 0.0), **fields)

    async def attempt(self, run: str, env_name: str, job_id: str, task_id: str, ref: dict[str, Any], group: str,
                      index: int, group_size: int, attempt: int, last_attempt: bool) -> dict[str, Any]:
        assert self.publisher is not None and self.client is not None
        cfg = self.settings.envs
        before = await self.publisher.published(job_id)
        if before is not None:
            EPISODES.labels(env_name, "duplicate").inc()
            log.info("outcome published before: nothing to run", extra={"job": job_id, "session": before})
            return {"id": job_id, "session_id": before, "duplicate": True}
        session_id = episode_session_id(job_id, attempt, secrets.token_hex(4))
        t0 = time.monotonic()
        try:
            task = resolve_task(env_name, ref)
            task_id = task.id
            env = load_environment(env_name)
            try:
                with Sandbox(cfg.sandbox) as sandbox:
                    result = await run_episode(
                        self.client, env, task, sandbox, session_id, model=cfg.model, max_steps=cfg.max_steps,
                        max_tokens=cfg.max_tokens, temperature=cfg.temperature)
            finally:
                env.close()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("episode attempt failed", extra={"job": job_id, "attempt": attempt,
                                                         "error": f"{type(exc).__name__}: {exc}"})
            if not last_attempt:
                EPISODES.labels(env_name, "retried").inc()
                raise  # rq runs the job again (a new attempt, a new session)
            EPISODES.labels(env_name, "error").inc()
            outcome = self._outcome(run, env_name, job_id, task_id, group, index, group_size, attempt, session_id,
                                    error=f"{type(exc).__name__}: {exc}", wall_s=time.monotonic() - t0)
            await self.publisher.publish_once(outcome)
            raise
        verdict = result.verdict
        outcome = self._outcome(
            run, env_name, job_id, task.id, group, index, group_size, attempt, session_id, reward=verdict.reward,
            passed=verdict.passed, details={**verdict.details, "ended": result.ended},
            policy_versions=result.policy_versions, steps=result.steps, wall_s=result.wall_s)
        published, _ = await self.publisher.publish_once(outcome)
        EPISODE_SECONDS.labels(env_name).observe(result.wall_s)
        EPISODES.labels(env_name, ("passed" if verdict.passed else "failed") if published else "duplicate").inc()
        log.info("episode done", extra={"job": job_id, "session": session_id, "reward": verdict.reward,
                                        "steps": result.steps, "ended": result.ended, "published": published})
        return {"id": job_id, "session_id": session_id, "reward": verdict.reward, "passed": verdict.passed,
                "steps": result.steps}


    # -- an evaluation episode (on the loop) ---------------------------------------------------
    def _eval_client(self, engine: str) -> AsyncOpenAI:
        cfg = self.settings.envs
        root = engine.rstrip("/")
        if root not in cfg.eval_engines:
            raise PermissionError(
                f"{root} is not an evaluation engine of this worker (NEXTSTATE_ENVS__EVAL_ENGINES="
                f"{json.dumps(cfg.eval_engines)}): the internal credential goes to those only")
        if root not in self.eval_clients:
            self.eval_clients[root] = AsyncOpenAI(
                base_url=f"{root}/v1", api_key=self.settings.internal.secret() or "none",
                max_retries=cfg.request_retries, timeout=cfg.request_timeout_s)
        return self.eval_clients[root]

    async def _record_eval(self, target: dict[str, Any], job_id: str, result: dict[str, Any]) -> None:
        assert self.bus is not None
        key = self.bus.keys.eval_episodes(str(target["evaluation"]))
        pipe = self.bus.redis.pipeline(transaction=True)
        pipe.hset(key, job_id, json.dumps(result, default=str))
        pipe.expire(key, EVAL_RESULT_TTL_S)
        await pipe.execute()

    async def evaluate(self, env_name: str, job_id: str, task_id: str, ref: dict[str, Any],
                       target: dict[str, Any], last_attempt: bool) -> dict[str, Any]:
        """One attempt at an evaluation episode: greedy on the evaluation engine; the result
        recorded for the evaluator (the last attempt's error too), nothing on `outcomes`."""
        cfg = self.settings.envs
        t0 = time.monotonic()
        try:
            client = self._eval_client(str(target["engine"]))
            task = resolve_task(env_name, ref)
            env = load_environment(env_name)
            try:
                with Sandbox(cfg.sandbox) as sandbox:
                    result = await run_episode(
                        client, env, task, sandbox, job_id, model=cfg.model, max_steps=cfg.max_steps,
                        max_tokens=cfg.max_tokens, temperature=float(target.get("temperature", 0.0)),
                        close_session=False)
            finally:
                env.close()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("evaluation episode failed", extra={"job": job_id, "error": f"{type(exc).__name__}: {exc}"})
            EPISODES.labels(env_name, "error" if last_attempt else "retried").inc()
            if last_attempt:
                await self._record_eval(target, job_id, {"task_id": task_id, "error": f"{type(exc).__name__}: {exc}",
                                                         "wall_s": round(time.monotonic() - t0, 3)})
            raise
        verdict = result.verdict
        summary = {"task_id": task.id, "reward": verdict.reward, "passed": verdict.passed, "steps": result.steps,
                   "ended": result.ended, "details": verdict.details, "wall_s": round(result.wall_s, 3)}
        await self._record_eval(target, job_id, summary)
        EPISODES.labels(env_name, "passed" if verdict.passed else "failed").inc()
        log.info("evaluation episode done", extra={"job": job_id, "reward": verdict.reward, "steps": result.steps})
        return {"id": job_id, **summary}
