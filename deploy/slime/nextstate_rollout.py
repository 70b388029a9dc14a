"""slime rollout function fed by nextstate's buffer: `--rollout-function-path nextstate_rollout.generate_rollout`.

nextstate has already done what slime's default rollout does: the engine generated
(recording the exact tokens and log-probs), the judge scored the turn from its next
state, the buffer applied the exclusion, at-least-one and staleness rules and batched.
A rollout here only *pulls*: `GET /get_data?n=&wait=` hands out TrainBatches from the
`trainer` consumer group (each batch goes to one trainer and is acknowledged as it is
handed out: at most once; the archive keeps every sample), and each TrainSample becomes
one slime `Sample` in a group of one (GRPO with n_samples_per_prompt=1 and
--disable-rewards-normalization gives A_t = r). slime asks for `args.rollout_batch_size`
groups per rollout; samples beyond that wait in this process for the next rollout.

TrainSample -> Sample: tokens, response_length, loss_mask, reward; rollout_logprobs ->
rollout_log_probs (the ratio's behaviour log-probs under --use-rollout-logprobs);
teacher_logprobs -> teacher_log_probs (--use-opd --opd-type sglang; a sample without a
hint gets its behaviour log-probs as teacher, so its OPD term is 0 and only r trains,
as in nextstate's own trainer); weight_version -> weight_versions; the rest -> metadata.

Settings (pydantic-settings, like every nextstate service):
    NEXTSTATE_SLIME__BUFFER_URL=http://buffer:8200     NEXTSTATE_SLIME__BATCHES_PER_REQUEST=4
    NEXTSTATE_SLIME__WAIT_S=20     long-poll per request (the buffer caps it at its get_data_max_wait_s)
    NEXTSTATE_SLIME__TIMEOUT_S=10  on top of WAIT_S per request      NEXTSTATE_SLIME__RETRY_MAX_S=30
    NEXTSTATE_INTERNAL__TOKEN=...  the stack's internal token: /get_data requires it
slime's own Sample / RolloutFnTrainOutput are used when importable, else the stand-in
in slime_standin.py (tests and CI have no slime).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import Any

import httpx
from pydantic import BaseModel, Field, ValidationError, field_validator

from shared.auth import bearer
from shared.errors import BufferUnavailable, SettingsError
from shared.schemas import TrainBatch, TrainSample, describe
from shared.settings import Settings, load_settings

try:  # inside a slime job
    from slime.rollout.base_types import RolloutFnTrainOutput
    from slime.utils.types import Sample
except ImportError:  # pragma: no cover - depends on the environment
    from slime_standin import RolloutFnTrainOutput, Sample

__all__ = [
    "BufferUnavailable", "RolloutFnTrainOutput", "RolloutSource", "Sample", "SlimeConfig",
    "SlimeSettings", "convert", "generate_rollout", "to_sample", "uniform_logprobs",
]

log = logging.getLogger(__name__)


class SlimeConfig(BaseModel):
    buffer_url: str = "http://127.0.0.1:8200"
    batches_per_request: int = Field(4, ge=1, le=64, description="n of one GET /get_data")
    wait_s: float = Field(20.0, ge=0, le=300, description="long-poll of one request")
    timeout_s: float = Field(10.0, gt=0, description="HTTP timeout beyond wait_s")
    connect_timeout_s: float = Field(5.0, gt=0)
    retry_max_s: float = Field(30.0, gt=0, description="backoff cap while the buffer is down")
    progress_log_s: float = Field(60.0, gt=0, description="log the wait this often")

    @field_validator("buffer_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")


class SlimeSettings(Settings):
    slime: SlimeConfig = SlimeConfig()


# -- conversion ---------------------------------------------------------------------------
_SAMPLE_FIELDS = {f.name for f in dataclasses.fields(Sample)}


def make_sample(**values: Any) -> Any:
    """A `Sample` with the values its class has fields for (slime versions differ)."""
    return Sample(**{k: v for k, v in values.items() if k in _SAMPLE_FIELDS})


def to_sample(s: TrainSample, index: int, *, batch_id: str, use_opd: bool) -> Any:
    """One TrainSample as a slime Sample; teacher log-probs only under OPD."""
    teacher = (s.teacher_logprobs if s.teacher_logprobs is not None else s.rollout_logprobs) \
        if use_opd else None
    return make_sample(
        group_index=index, index=index,
        prompt="", response="",  # token-level training: text is not needed
        tokens=list(s.tokens), response_length=s.response_length,
        loss_mask=list(s.loss_mask), reward=float(s.reward),
        rollout_log_probs=None if s.rollout_logprobs is None else list(s.rollout_logprobs),
        teacher_log_probs=None if teacher is None else list(teacher),
        weight_versions=[s.weight_version],
        status=Sample.Status.COMPLETED,
        session_id=s.session_id,
        metadata={
            "nextstate_sample_id": s.id, "nextstate_batch_id": batch_id,
            "policy_version": s.policy_version, "turn_index": s.turn_index,
            "temperature": s.temperature, "mode": s.mode, "forced": s.forced,
        },
    )  # fmt: skip


def convert(
    batches: Iterable[TrainBatch], first_index: int, *, need_rollout_logprobs: bool, use_opd: bool
) -> tuple[list[Any], Counter[str]]:
    """Samples of `batches` in order, indexed from `first_index`, and why any was dropped:
    `no_rollout_logprobs` (the ratio needs them: --use-rollout-logprobs), `no_teacher`
    (OPD with neither teacher nor behaviour log-probs)."""
    out: list[Any] = []
    dropped: Counter[str] = Counter()
    for batch in batches:
        for s in batch.samples:
            if need_rollout_logprobs and s.rollout_logprobs is None:
                dropped["no_rollout_logprobs"] += 1
            elif use_opd and s.teacher_logprobs is None and s.rollout_logprobs is None:
                dropped["no_teacher"] += 1
            else:
                out.append(to_sample(s, first_index + len(out), batch_id=batch.id, use_opd=use_opd))
    return out, dropped


def uniform_logprobs(samples: Sequence[Any]) -> int:
    """slime stacks rollout_log_probs when the first sample has them: all or none must.
    Drops them from every sample when some lack them; returns how many lost them."""
    have = sum(s.rollout_log_probs is not None for s in samples)
    if 0 < have < len(samples):
        for s in samples:
            s.rollout_log_probs = None
        return have
    return 0


def rollout_metrics(samples: Sequence[Any], temperature: float | None) -> dict[str, float]:
    versions = [int(s.metadata["policy_version"]) for s in samples]
    m: dict[str, float] = {
        "nextstate/samples": float(len(samples)),
        "nextstate/reward_mean": sum(float(s.reward) for s in samples) / max(len(samples), 1),
        "nextstate/forced": float(sum(bool(s.metadata["forced"]) for s in samples)),
        "nextstate/policy_version_min": float(min(versions, default=0)),
        "nextstate/policy_version_max": float(max(versions, default=0)),
    }
    if temperature is not None:
        # slime recomputes log-probs at --rollout-temperature; samples drawn at another
        # temperature get a biased ratio. Counted so a mismatch shows on the dashboard.
        m["nextstate/temperature_mismatch"] = float(
            sum(abs(float(s.metadata["temperature"]) - temperature) > 1e-6 for s in samples)
        )
    return m


# -- pulling ------------------------------------------------------------------------------
class RolloutSource:
    """Pulls TrainBatches from the buffer and hands out exactly `k` Samples per rollout."""

    def __init__(self, cfg: SlimeConfig, client: httpx.Client | None = None, *, token: str | None = None) -> None:
        self.cfg = cfg
        self.client = client or httpx.Client(
            base_url=cfg.buffer_url,
            timeout=httpx.Timeout(cfg.wait_s + cfg.timeout_s, connect=cfg.connect_timeout_s),
            headers=bearer(token),
        )
        self._ready: deque[Any] = deque()
        self._next_index = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        self.client.close()

    def pull(self) -> list[TrainBatch]:
        """One GET /get_data: up to `batches_per_request` batches (waits up to wait_s)."""
        params = {"n": self.cfg.batches_per_request, "wait": self.cfg.wait_s}
        try:
            resp = self.client.get("/get_data", params=params)
        except httpx.HTTPError as exc:
            raise BufferUnavailable(f"GET {self.cfg.buffer_url}/get_data failed: {exc!r}") from exc
        if resp.status_code == 401:  # retrying cannot help: say what to set
            raise SettingsError(
                f"GET {self.cfg.buffer_url}/get_data answered 401 ({resp.text[:200]}): set "
                "NEXTSTATE_INTERNAL__TOKEN in slime's environment to the stack's internal token"
            )
        if resp.status_code != 200:
            raise BufferUnavailable(
                f"GET {self.cfg.buffer_url}/get_data answered {resp.status_code}: {resp.text[:300]}"
            )
        try:
            body = resp.json()
            return [TrainBatch.model_validate(b) for b in body["batches"]]
        except ValidationError as exc:
            raise BufferUnavailable(f"the buffer sent an invalid TrainBatch: {describe(exc)}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise BufferUnavailable(f"the buffer's answer is not {{count, batches}}: {exc!r}") from None

    def take(
        self, k: int, *, need_rollout_logprobs: bool, use_opd: bool, temperature: float | None = None
    ) -> tuple[list[Any], dict[str, float]]:
        """Block until `k` samples are ready; return them and this rollout's metrics."""
        with self._lock:
            started = last_log = time.monotonic()
            dropped: Counter[str] = Counter()
            batches = failures = 0
            while len(self._ready) < k:
                try:
                    got = self.pull()
                    failures = 0
                except BufferUnavailable as exc:
                    failures += 1
                    delay = min(self.cfg.retry_max_s, 0.5 * 2 ** min(failures, 10))
                    log.warning("buffer unavailable, retrying", extra={"error": str(exc), "in_s": delay})
                    time.sleep(delay)
                    continue
                batches += len(got)
                samples, why = convert(got, self._next_index, need_rollout_logprobs=need_rollout_logprobs,
                                       use_opd=use_opd)  # fmt: skip
                self._next_index += len(samples)
                self._ready.extend(samples)
                dropped += why
                if time.monotonic() - last_log >= self.cfg.progress_log_s:
                    last_log = time.monotonic()
                    log.info("waiting for samples", extra={"ready": len(self._ready), "need": k})
            out = [self._ready.popleft() for _ in range(k)]
        metrics = rollout_metrics(out, temperature)
        if not need_rollout_logprobs:
            metrics["nextstate/rollout_logprobs_dropped"] = float(uniform_logprobs(out))
        metrics.update({
            "nextstate/batches": float(batches), "nextstate/wait_s": time.monotonic() - started,
            "nextstate/carried_over": float(len(self._ready)),
            **{f"nextstate/dropped_{r}": float(n) for r, n in dropped.items()},
        })  # fmt: skip
        return out, metrics


_SOURCE: RolloutSource | None = None
_SOURCE_LOCK = threading.Lock()


def source() -> RolloutSource:
    """The process's RolloutSource (its carried-over samples live across rollouts)."""
    global _SOURCE
    with _SOURCE_LOCK:
        if _SOURCE is None:
            settings = load_settings(SlimeSettings)
            _SOURCE = RolloutSource(settings.slime, token=settings.internal.secret())
        return _SOURCE


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's rollout-function signature; `data_source` is unused (data comes from the buffer)."""
    if evaluation:
        raise NotImplementedError(
            "nextstate trains online from live traffic and has no eval prompts: "
            "launch slime without --eval-interval / --eval-prompt-data"
        )
    samples, metrics = source().take(
        int(args.rollout_batch_size),
        need_rollout_logprobs=bool(getattr(args, "use_rollout_logprobs", False)),
        use_opd=bool(getattr(args, "use_opd", False)),
        temperature=getattr(args, "rollout_temperature", None),
    )
    log.info("rollout ready", extra={"rollout_id": rollout_id, "samples": len(samples),
                                     "wait_s": round(metrics["nextstate/wait_s"], 2)})
    return RolloutFnTrainOutput(samples=[[s] for s in samples], metrics=metrics)
