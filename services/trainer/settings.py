"""The trainer's configuration: `NEXTSTATE_TRAINER__*` on top of the shared settings.

    NEXTSTATE_TRAINER__MODEL=/models/base        HF folder of the base model (also the KL reference); required
    NEXTSTATE_TRAINER__LR=1e-6                   NEXTSTATE_TRAINER__WEIGHT_DECAY=0.0
    NEXTSTATE_TRAINER__BETAS=[0.9,0.999]         NEXTSTATE_TRAINER__GRAD_CLIP=1.0
    NEXTSTATE_TRAINER__EPS_CLIP=0.2              NEXTSTATE_TRAINER__EPS_CLIP_HIGH=0.28
    NEXTSTATE_TRAINER__KL_BETA=0.02              0 skips the reference model entirely
    NEXTSTATE_TRAINER__LOSS_MODE=rl              rl | opd | combine (W_RL, W_OPD weigh combine): the
                                                 samples that train and their advantages
    NEXTSTATE_TRAINER__LOSS=                     the loss: rl | opd | combine (default: LOSS_MODE's) |
                                                 opd_topk | a plugin module:function (loss_plugins.py)
    NEXTSTATE_TRAINER__LOSS_OPTIONS={}           a JSON object handed to the loss (LossConfig.options)
    NEXTSTATE_TRAINER__MICRO_BATCH_TOKENS=8192   padded tokens per forward; gradients accumulate
    NEXTSTATE_TRAINER__GRADIENT_CHECKPOINTING=auto  recompute layers in the backward (auto: above 3B
                                                 parameters, or when the memory plan needs it; fit.py)
    NEXTSTATE_TRAINER__REFERENCE_OFFLOAD=auto    the KL reference's layers on the CPU, streamed in (auto:
                                                 when a resident copy would not fit; reference.py)
    NEXTSTATE_TRAINER__CHECKPOINT_EVERY=1        publish a version every K optimizer steps
    NEXTSTATE_TRAINER__IS_CORRECTION=tis         tis: each token's term weighted by min(π_old/π_b, IS_CAP),
                                                 the ratio against π_old (stale samples and the
                                                 train/inference mismatch corrected); off: the ratio
                                                 against the behaviour π_b (docs/methods.md)
    NEXTSTATE_TRAINER__IS_CAP=2.0                NEXTSTATE_TRAINER__MAX_SAMPLE_KL=1.0 (a sample whose
                                                 behaviour is further from the trainer is not trained)
    NEXTSTATE_TRAINER__MISMATCH_ALARM=0.05       mean |log π_old/π_b| of samples from the trainer's own
                                                 version past which status, metric and log warn
    NEXTSTATE_TRAINER__MAX_STALENESS=            unset: no bound by version count (MAX_SAMPLE_KL bounds
                                                 what trains); N: a sample more than N versions behind
                                                 is not trained unless users get its version now
    NEXTSTATE_TRAINER__MASTER_WEIGHTS=auto       fp32 master weights and optimizer state for a model
                                                 trained in bf16/fp16 (auto: when its dtype is not fp32)
    NEXTSTATE_TRAINER__KEEP_VERSIONS=3           versions (and trainer states) kept in the bucket
    NEXTSTATE_TRAINER__RESUME_EVERY=10           the resume state (optimizer, RNG, step) every K versions,
    NEXTSTATE_TRAINER__RESUME_EVERY_S=600        or T seconds after the last, and on a clean stop;
                                                 a version never waits for it (trainer_state.py)
    NEXTSTATE_TRAINER__LORA=false                LORA_RANK=16 LORA_ALPHA=32; LORA_PUBLISH=adapter: each
                                                 version is the PEFT adapter (merged: full weights)
    NEXTSTATE_TRAINER__PUBLISH_DTYPE=auto        the published weights' dtype (auto: the dtype served,
                                                 the base model folder's: v0's)
    NEXTSTATE_TRAINER__SNAPSHOT_EVERY=1          K > 1: deltas between full snapshots every K versions
    NEXTSTATE_TRAINER__DEVICE=auto               NEXTSTATE_TRAINER__DTYPE=auto (bf16 on GPU, fp32 on CPU)
    NEXTSTATE_TRAINER__HOST=127.0.0.1            NEXTSTATE_TRAINER__PORT=9103  (/healthz /readyz /metrics)

Ray Train backend (services/trainer/ray_backend.py): data-parallel over a Ray cluster.

    NEXTSTATE_TRAINER__BACKEND=local             local | ray
    NEXTSTATE_TRAINER__RAY_ADDRESS=              cluster to join (default: RAY_ADDRESS, else a local one)
    NEXTSTATE_TRAINER__NUM_WORKERS=2             DDP ranks       NEXTSTATE_TRAINER__USE_GPU=false (NCCL; else gloo)
    NEXTSTATE_TRAINER__CPUS_PER_WORKER=1         Ray CPUs per rank (also its torch threads unless THREADS)
    NEXTSTATE_TRAINER__COLLECTIVE_TIMEOUT_S=1800 NEXTSTATE_TRAINER__HEARTBEAT_S=30 (idle ranks stay inside it)
    NEXTSTATE_TRAINER__RAY_STORAGE=              Ray Train's run folder   NEXTSTATE_TRAINER__RAY_LOG_TO_DRIVER=true
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from shared.schemas import Mode
from shared.settings import Settings

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
BUILTIN_LOSSES = ("rl", "opd", "combine", "opd_topk")  # services/trainer/loss_plugins.py
_PLUGIN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class TrainerConfig(BaseModel):
    model: str = Field(description="HF folder of the base model: initial policy and KL reference")
    tokenizer: str | None = Field(None, description="tokenizer folder published with each version")
    # -- optimizer ------------------------------------------------------------------------
    lr: float = Field(1e-6, gt=0, description="AdamW's learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's betas")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW's eps")
    grad_clip: float = Field(1.0, gt=0, description="max global gradient norm")
    # -- loss ---------------------------------------------------------------------------------
    loss_mode: Mode = "rl"
    loss: str | None = Field(
        None, description="rl | opd | combine | opd_topk | module:function (default: loss_mode's)"
    )
    loss_options: dict[str, Any] = Field(default_factory=dict, description="handed to the loss")
    w_rl: float = Field(1.0, description="combine: the weight of the judge's reward in A")
    w_opd: float = Field(1.0, description="combine: the weight of teacher - behaviour in A")
    eps_clip: float = Field(0.2, gt=0, lt=1, description="the ratio's lower clip: 1 - eps_clip")
    eps_clip_high: float = Field(0.28, gt=0, description="the ratio's upper clip: 1 + eps_clip_high")
    kl_beta: float = Field(0.02, ge=0, description="weight of the k3 KL to the reference (0: no reference model)")
    # -- batching and checkpoints ---------------------------------------------------------------
    micro_batch_tokens: int = Field(8192, ge=16, description="padded tokens per micro-batch")
    # -- memory (services/trainer/fit.py, memory.py; docs/methods.md#memory) ------------------------
    gradient_checkpointing: Literal["auto", "true", "false"] = Field(
        "auto", description="activation checkpointing: recompute each layer in the backward instead of "
        "keeping its activations (about a third more compute). auto: on above 3B parameters, or when "
        "the memory plan does not fit the device without it")
    reference_offload: Literal["auto", "true", "false"] = Field(
        "auto", description="full fine-tuning with KL_BETA > 0: keep the frozen KL reference's layers "
        "on the CPU and stream them onto the device for each forward, instead of a second resident "
        "model. auto: only when the memory plan does not fit with it resident")
    checkpoint_every: int = Field(1, ge=1, description="optimizer steps per published version")
    keep_versions: int = Field(3, ge=1)
    # The resume state is 2x a bf16 version's bytes with AdamW in bf16 (Qwen3-4B: 16 GB beside
    # 8 GB of weights), 6x with fp32 masters and moments (48 GB); every 10th version adds a fifth
    # (or 60 %) to what versions upload instead of 2x (6x), and a crash costs at most 10
    # versions' (or 10 minutes') optimizer history — never weights or feedback
    # (docs/design.md#resume-and-rollback).
    resume_every: int = Field(
        10, ge=1, le=1000, description="write the resume state (optimizer state, RNG, step; with LoRA "
        "the adapter) with every K-th version; a version's commit never waits for it (at most 1000: "
        "the ancestors a version's record lists)")
    resume_every_s: float = Field(
        600.0, gt=0, description="... or with the first version T seconds after the last one (an idle "
        "trainer writes it then, if a version was made since); and always on a clean stop")
    max_pending_uploads: int = Field(
        2, ge=1, description="versions uploading while training goes on; then training waits"
    )
    remember_batches: int = Field(10_000, ge=100, description="consumed batch ids kept for replays")
    max_staleness: int | None = Field(
        None, ge=0, description="versions a sample may be behind the weights it trains (older: dropped, "
        "unless its version is the one served); unset: no bound by count, MAX_SAMPLE_KL decides")
    # -- off-policy correction and the train/inference mismatch (services/trainer/offpolicy.py) ------
    is_correction: Literal["tis", "off"] = Field(
        "tis", description="tis: truncated importance sampling against the behaviour policy, the "
        "ratio against the trainer's own log-probs; off: the ratio against the behaviour's")
    is_cap: float = Field(2.0, ge=1.0, description="the importance weight's truncation C")
    max_sample_kl: float | None = Field(
        1.0, gt=0, description="a sample whose behaviour policy is further than this from the trainer "
        "(token-mean k3 KL) is not trained; unset: every sample trains")
    mismatch_alarm: float = Field(
        0.05, gt=0, description="mean |log π_old/π_b| over samples of the trainer's own version past "
        "which the mismatch alarm goes off")
    master_weights: Literal["auto", "true", "false"] = Field(
        "auto", description="fp32 master weights and AdamW state for low-precision parameters "
        "(auto: whenever a trainable parameter is not fp32)")
    # -- what a version carries (docs/weights.md) ------------------------------------------------
    publish_dtype: Dtype = Field(
        "auto", description="dtype of the published weights: the dtype the engine serves. auto: the "
        "base model folder's (its config.json, else its weights: shared/dtypes.py), which the engine "
        "serves as v0, so v0 and every version are served in one dtype and the watcher, which refuses "
        "a full version in another, loads them all; an explicit value wins (the watcher then needs "
        "NEXTSTATE_WATCHER__SERVED_DTYPE to match)")
    snapshot_every: int = Field(
        1, ge=1, description="full versions: a full snapshot every K versions, and in between each "
        "weight file as a delta against the version before (XOR of the bits, then zstd; lossless). "
        "1: every version whole")
    # -- LoRA ------------------------------------------------------------------------------------
    lora: bool = Field(False, description="train LoRA adapters (peft) instead of every weight")
    lora_rank: int = Field(16, ge=1, description="LoRA rank r")
    lora_alpha: int = Field(32, ge=1, description="LoRA alpha (the update is scaled by alpha / r)")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="LoRA: dropout")
    lora_targets: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="modules that get adapters: all-linear, or names such as [\"q_proj\",\"v_proj\"]")
    lora_publish: Literal["adapter", "merged"] = Field(
        "adapter", description="with LoRA, each version is the adapter (format adapter: a PEFT folder "
        "the engine loads by name, megabytes) or the merged full weights (format full, for an engine "
        "started without LoRA support)")
    # -- process -----------------------------------------------------------------------------------
    device: str = "auto"
    dtype: Dtype = "auto"
    threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (default: half the CPUs it may use, at least 1)")
    seed: int = 0
    work_dir: str | None = Field(None, description="local scratch for snapshots (default: a temp dir)")
    consumer_name: str | None = Field(None, description="default trainer-<run>: one trainer per run")
    upload_retry_max_s: float = Field(30.0, gt=0, description="upload retries back off up to this")
    shutdown_upload_s: float = Field(120.0, ge=0, description="on stop, wait this long for uploads")
    host: str = "127.0.0.1"
    port: int = Field(9103, ge=0, le=65535)
    # -- Ray Train backend ---------------------------------------------------------------------------
    backend: Literal["local", "ray"] = "local"
    ray_address: str | None = Field(None, description="default: RAY_ADDRESS, else start a local cluster")
    num_workers: int = Field(2, ge=1, description="data-parallel ranks (Ray Train workers)")
    use_gpu: bool = Field(False, description="one GPU per rank, NCCL; otherwise CPU ranks over gloo")
    cpus_per_worker: float = Field(1.0, gt=0, description="Ray CPUs reserved per rank")
    ray_storage: str | None = Field(None, description="Ray Train's run folder (default: under work_dir)")
    ray_log_to_driver: bool = Field(True, description="stream the ranks' logs to this process")
    collective_timeout_s: float = Field(1800.0, gt=0, description="a collective waiting longer fails the group")
    heartbeat_s: float = Field(30.0, gt=0, description="while idle, rank 0 pings the others this often")

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("set it to the base model's HF folder")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v not in ("auto", "cpu", "mps") and not v.startswith("cuda"):
            raise ValueError("auto, cpu, cuda, cuda:N or mps")
        return v

    @field_validator("max_staleness", "max_sample_kl", mode="before")
    @classmethod
    def _unset(cls, v: Any) -> Any:
        return None if v == "" else v  # compose passes an unset ${VAR:-} as empty

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):
            raise ValueError("both betas must be in [0, 1)")
        return v

    @field_validator("loss")
    @classmethod
    def _loss(cls, v: str | None) -> str | None:
        if v == "":  # compose passes an unset ${TRAINER_LOSS:-} as empty: LOSS_MODE's loss
            return None
        if v is not None and v not in BUILTIN_LOSSES and not _PLUGIN.fullmatch(v):
            raise ValueError(f"one of {', '.join(BUILTIN_LOSSES)} or a plugin as module:function, got {v!r}")
        return v

    @model_validator(mode="after")
    def _weights(self) -> TrainerConfig:
        if self.loss_mode == "combine" and self.w_rl == 0 and self.w_opd == 0:
            raise ValueError("combine mode with w_rl = w_opd = 0 trains nothing")
        if self.loss == "opd_topk" and self.loss_mode != "opd":
            raise ValueError("NEXTSTATE_TRAINER__LOSS=opd_topk needs LOSS_MODE=opd (teacher samples)")
        if self.loss in ("rl", "opd", "combine") and self.loss != self.loss_mode:
            raise ValueError(
                f"NEXTSTATE_TRAINER__LOSS={self.loss} disagrees with LOSS_MODE={self.loss_mode}: "
                "unset LOSS (the mode's loss is the default) or make them the same"
            )
        return self

    @model_validator(mode="after")
    def _ray(self) -> TrainerConfig:
        if self.heartbeat_s >= self.collective_timeout_s:
            raise ValueError("heartbeat_s must be shorter than collective_timeout_s (idle ranks would time out)")
        if self.backend == "ray" and self.device not in ("auto", "cuda" if self.use_gpu else "cpu"):
            raise ValueError("with backend=ray, use_gpu decides each rank's device: leave device=auto")
        return self

    @property
    def consumer_concurrency(self) -> int:
        """Batches the consumer holds at once. Training stays strictly ordered (one worker
        takes them from an in-process FIFO); a batch is acked only once its version is
        committed, so a whole window of `checkpoint_every` batches must be in flight, plus
        one window per version still uploading. Fewer would deadlock; more buys nothing."""
        return self.checkpoint_every * (self.max_pending_uploads + 1)


class TrainerSettings(Settings):
    trainer: TrainerConfig

    @model_validator(mode="before")
    @classmethod
    def _trainer_group(cls, data: Any) -> Any:
        # Without this a missing group reads "NEXTSTATE_TRAINER: Field required"; with it
        # the error names NEXTSTATE_TRAINER__MODEL, the variable to set.
        if isinstance(data, dict):
            data.setdefault("trainer", {})
        return data
