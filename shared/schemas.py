"""One pydantic model per message on the wire (docs/design.md#messages).

Each message carries `type`, `schema_version`, an idempotency `id` and `created_at`
(unix seconds). Messages are JSON in the `data` field of a stream entry; `parse_message`
reads any of them and `Model.from_json` one known type. Validation happens here, at
the edge, once: a malformed message raises `MalformedMessage` with every problem named.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from typing_extensions import Self

from shared.errors import MalformedMessage

SCHEMA_VERSION: Literal[1] = 1

# A judge's reward: -1 / 0 / 1 from labels, any value in between from graded scores
# (services/judge/parsing.py). The buffer and trainer take it as the float it is.
Reward = Annotated[float, Field(ge=-1.0, le=1.0, allow_inf_nan=False)]
TurnType = Literal["main", "side"]
Mode = Literal["rl", "opd", "combine"]

M = TypeVar("M", bound="Message")


def new_id() -> str:
    return uuid.uuid4().hex


def describe(exc: ValidationError) -> str:
    """A one-line summary of every validation problem: `field.path: message; ...`."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ())) or "message"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str  # each message narrows this to its own literal
    schema_version: Literal[1] = SCHEMA_VERSION
    id: str = Field(default_factory=new_id, min_length=1, max_length=256)
    created_at: float = Field(default_factory=time.time)

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes) -> Self:
        try:
            return cls.model_validate_json(data)
        except ValidationError as exc:
            raise MalformedMessage(f"not a valid {cls.__name__}: {describe(exc)}") from None


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    max_tokens: int | None = Field(None, ge=0)
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    # Constrained decoding (the collector's `response_format`; SGLang's sampling params of
    # the same names, vLLM's `structured_outputs`). Set on a Turn, it records that the
    # sample came from the grammar-masked distribution; the log-probs are still the
    # full-vocabulary ones (services/engine/grammar.py says why).
    json_schema: str | None = None  # a JSON Schema, serialized; '{"type":"object"}' = any object
    regex: str | None = None


class Turn(Message):
    """One model response, with its exact tokens, once its next state is known."""

    type: Literal["turn"] = "turn"
    session_id: str
    turn_index: int = Field(0, ge=0)
    turn_type: TurnType = "main"
    model: str = ""
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    response: dict[str, Any]
    # Exactly as the engine saw and sampled them. Empty (and logprobs None) only for
    # turns imported as text without a tokenizer (`source="import"`): the buffer's
    # /receive tokenizes imports itself, so in practice they arrive with ids.
    prompt_ids: list[int] = Field(default_factory=list)
    response_ids: list[int] = Field(default_factory=list)
    response_logprobs: list[float] | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    weight_version: str = "0"
    policy_version: int = Field(0, ge=0)
    finish_reason: str | None = None
    # The `id` of the chat completion the client received (ties a response to its turn).
    completion_id: str | None = None
    # Every message between this response and the end of the request that followed it
    # (the user's reply, or all tool results). None: the session ended or the turn expired.
    next_state: list[dict[str, Any]] | None = None
    # unchosen: a sibling of the group member the follow-up continued (see group_id);
    # its next state is None, or the chosen member's under GROUP_UNCHOSEN=judge.
    closed_by: Literal["next_request", "session_done", "ttl", "import", "unchosen"] = "next_request"
    source: Literal["collector", "import"] = "collector"
    # The client's end-user id (the request's `user`, Anthropic's `metadata.user_id`): the
    # judge keeps what it learns from a session under it (experiential learning).
    user: str | None = Field(None, max_length=256)
    requested_at: float | None = None
    responded_at: float | None = None
    # A group: the n choices of one chat completion (`n > 1`), sampled from the same
    # prompt. Every member has the group's id (the completion's id), its choice index
    # and the group's size; a turn of its own has none (size 1).
    group_id: str | None = Field(None, min_length=1, max_length=256)
    group_index: int = Field(0, ge=0)
    group_size: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _aligned(self) -> Turn:
        if self.response_logprobs is not None and len(self.response_logprobs) != len(
            self.response_ids
        ):
            raise ValueError(
                f"response_logprobs has {len(self.response_logprobs)} entries "
                f"for {len(self.response_ids)} response_ids"
            )
        if self.group_index >= self.group_size:
            raise ValueError(f"group_index {self.group_index} outside a group of {self.group_size}")
        if self.group_size > 1 and self.group_id is None:
            raise ValueError(f"a group of {self.group_size} needs a group_id")
        return self

    @property
    def grouped(self) -> bool:
        """One of the n choices of a completion (n > 1)."""
        return self.group_id is not None and self.group_size > 1


class Vote(BaseModel):
    model_config = ConfigDict(extra="forbid")

    score: Reward | None  # None: the judge's answer could not be parsed
    text: str = ""  # the judge model's whole raw answer (or the rule's / plugin's reason)
    latency_s: float = 0.0
    error: str | None = None


class ScoredTurn(Message):
    """A turn with its reward (its judge votes aggregated: services/judge/parsing.py) and,
    in OPD, a hint."""

    type: Literal["scored_turn"] = "scored_turn"
    turn: Turn
    reward: Reward
    judged: bool = True  # False: no next state, so nothing to judge (reward 0)
    votes: list[Vote] = Field(default_factory=list)  # the reward votes
    hint_votes: list[Vote] = Field(default_factory=list)  # OPD: the hint judge's votes
    # Who decided: prm | rule (also for rule+prm, whichever decided) | the plugin's
    # module:callable | opd | prm+opd | rule+opd.
    judge: str = "prm"
    judge_model: str | None = None
    prompt_version: str | None = None
    mode: Mode = "rl"
    hint: str | None = None
    teacher_prompt_ids: list[int] | None = None
    teacher_logprobs: list[float] | None = None
    # Top-K OPD: the teacher's top-K ids and log-probs per response token (the trainer's opd_topk)
    teacher_topk_ids: list[list[int]] | None = None
    teacher_topk_logprobs: list[list[float]] | None = None
    # Experiential learning: the ids of the Experience records in the teacher prompt
    # (services/judge/experience.py), in the order shown; None: no experience.
    experience_ids: list[str] | None = None

    @model_validator(mode="after")
    def _teacher_aligned(self) -> ScoredTurn:
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != len(
            self.turn.response_ids
        ):
            raise ValueError(
                f"teacher_logprobs has {len(self.teacher_logprobs)} entries "
                f"for {len(self.turn.response_ids)} response_ids"
            )
        check_topk(self.teacher_topk_ids, self.teacher_topk_logprobs, len(self.turn.response_ids))
        return self


class TrainSample(Message):
    """What the trainer consumes for one turn: tokens, mask, reward, behaviour log-probs."""

    type: Literal["train_sample"] = "train_sample"
    session_id: str
    turn_index: int = 0
    tokens: list[int]  # prompt + response
    response_length: int = Field(ge=1)
    loss_mask: list[int]  # one per response token, 0 or 1
    reward: float
    rollout_logprobs: list[float] | None = None  # None: the trainer uses its own (on-policy)
    teacher_logprobs: list[float] | None = None
    # Top-K distillation (the trainer's `opd_topk` loss): per response token, the teacher's
    # K most likely token ids and their log-probs (K the same on every row).
    teacher_topk_ids: list[list[int]] | None = None
    teacher_topk_logprobs: list[list[float]] | None = None
    policy_version: int = Field(0, ge=0)
    weight_version: str = "0"
    temperature: float = Field(1.0, ge=0)
    mode: Mode = "rl"
    forced: bool = False  # kept only by the at-least-one rule
    group_id: str | None = None  # the Turn's group (n > 1 choices of one completion)

    @model_validator(mode="after")
    def _shapes(self) -> TrainSample:
        n = self.response_length
        if n > len(self.tokens):
            raise ValueError(f"response_length {n} exceeds {len(self.tokens)} tokens")
        if len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {n} response tokens")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("loss_mask entries must be 0 or 1")
        for name in ("rollout_logprobs", "teacher_logprobs"):
            lp = getattr(self, name)
            if lp is not None and len(lp) != n:
                raise ValueError(f"{name} has {len(lp)} entries for {n} response tokens")
        check_topk(self.teacher_topk_ids, self.teacher_topk_logprobs, n)
        return self

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length


def check_topk(ids: list[list[int]] | None, logprobs: list[list[float]] | None, n: int) -> None:
    """Top-K rows: both or neither, one per response token, the same K >= 1 on every row,
    ids >= 0, log-probs <= 0 (raises ValueError)."""
    if ids is None and logprobs is None:
        return
    if ids is None or logprobs is None:
        raise ValueError("teacher_topk_ids and teacher_topk_logprobs come together")
    if len(ids) != n or len(logprobs) != n:
        raise ValueError(f"teacher top-K has {len(ids)}/{len(logprobs)} rows for {n} response tokens")
    k = len(ids[0]) if ids else 1
    for row_ids, row_lp in zip(ids, logprobs, strict=True):
        if len(row_ids) != k or len(row_lp) != k or k < 1:
            raise ValueError(f"every teacher top-K row needs the same K >= 1 ids and log-probs (K={k})")
        if any(t < 0 for t in row_ids) or any(not lp <= 0.0 for lp in row_lp):
            raise ValueError("teacher top-K ids must be >= 0 and log-probs <= 0")


class TrainBatch(Message):
    type: Literal["train_batch"] = "train_batch"
    run: str = "default"
    samples: list[TrainSample] = Field(min_length=1)


class CheckpointFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str  # relative to the version folder
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class EncodedFile(BaseModel):
    """A file of the version stored as a delta (shared/deltas.py): the object at `path` in
    the version's folder, XOR-ed onto `of` as version `base_version` holds it, gives the
    file `of` of this version (whose size and sha256 `files` lists)."""

    model_config = ConfigDict(extra="forbid")

    path: str  # the delta object, relative to the version folder (`model.safetensors.xor.zst`)
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    codec: Literal["xor-zstd"] = "xor-zstd"
    of: str  # the file of `files` it rebuilds
    base_version: int = Field(ge=1)  # the version whose `of` it is XOR-ed onto
    base_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")  # that file, as the reader must have it


class AdapterSpec(BaseModel):
    """What a `format: adapter` version is: a PEFT LoRA adapter on the run's base model."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(ge=1)
    alpha: float = Field(gt=0)
    target_modules: list[str] = Field(min_length=1)  # module names, e.g. q_proj, v_proj


WeightFormat = Literal["full", "adapter"]


class CheckpointManifest(Message):
    """`policies/<run>/vNNNNNN/manifest.json`: written after every file, before LATEST.

    `files` are the version's files as a reader installs them (what the engine loads),
    each with its size and sha256. `format` says what they are: `full`, an HF model folder
    (config, safetensors, tokenizer) in `dtype`; or `adapter`, a PEFT LoRA adapter
    (`adapter_config.json` + `adapter_model.safetensors`, described by `adapter`) on the
    base model whose identity (shared/runs.py fingerprint) is `base_fingerprint`. Files
    listed in `encoded` are not in the bucket as such: each is rebuilt from its delta and
    the same file of an earlier version, down to `snapshot`, the full version the chain
    starts from (None: this version is one, every file stored as is).
    """

    type: Literal["checkpoint_manifest"] = "checkpoint_manifest"
    run: str
    version: int = Field(ge=0)
    step: int = Field(0, ge=0)
    base_model: str = ""
    # The version this one was trained from (0: the base model; None: not recorded).
    # After a rollback to K, the next version's parent is K: a lineage, never a reuse.
    parent: int | None = None
    files: list[CheckpointFile]
    consumed_batch_ids: list[str] = Field(default_factory=list)
    metrics: dict[str, float] = Field(default_factory=dict)
    format: WeightFormat = "full"
    dtype: str | None = None  # the weights' dtype as stored: float32, bfloat16 (None: unrecorded)
    base_fingerprint: str = ""  # the base model's identity ("": unrecorded)
    adapter: AdapterSpec | None = None  # with format adapter
    encoded: list[EncodedFile] = Field(default_factory=list)
    snapshot: int | None = None  # the full version a delta chain starts from

    @property
    def weight_version(self) -> str:
        return str(self.version)

    @model_validator(mode="after")
    def _layout(self) -> Self:
        if (self.format == "adapter") != (self.adapter is not None):
            raise ValueError("an adapter version carries `adapter` (rank, alpha, target_modules), "
                             "and only an adapter version does")
        names = {f.path for f in self.files}
        for e in self.encoded:
            if e.of not in names:
                raise ValueError(f"encoded {e.path!r} rebuilds {e.of!r}, which `files` does not list")
            if e.path in names:
                raise ValueError(f"encoded {e.path!r} has the name of a file of the version")
            if e.base_version >= self.version:
                raise ValueError(f"encoded {e.path!r} builds on v{e.base_version}, not an earlier version")
        if len({e.of for e in self.encoded}) != len(self.encoded):
            raise ValueError("a file is encoded twice")
        if self.encoded and (self.snapshot is None or self.snapshot >= self.version):
            raise ValueError("a version with deltas names the earlier full `snapshot` its chain starts from")
        return self

    def stored(self) -> list[CheckpointFile]:
        """The objects of this version in the bucket: its files, each encoded one replaced by
        its delta."""
        encoded = {e.of: e for e in self.encoded}
        return [CheckpointFile(path=encoded[f.path].path, size=encoded[f.path].size,
                               sha256=encoded[f.path].sha256) if f.path in encoded else f
                for f in self.files]


class LatestPointer(BaseModel):
    """`policies/<run>/LATEST`: the one object readers follow."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0)
    manifest: str
    committed_at: float = Field(default_factory=time.time)


class CheckpointPublished(Message):
    type: Literal["checkpoint_published"] = "checkpoint_published"
    run: str
    version: int = Field(ge=0)
    step: int = 0
    manifest: str
    committed_at: float = Field(default_factory=time.time)
    metrics: dict[str, float] = Field(default_factory=dict)


class PolicyLoaded(Message):
    type: Literal["policy_loaded"] = "policy_loaded"
    run: str
    version: int = Field(ge=0)
    weight_version: str
    engine: str = ""
    download_s: float = 0.0
    load_s: float = 0.0
    sync_s: float | None = None  # LATEST commit -> the engine answering with this version
    # Why it was loaded: a version the watcher had not served yet (new LATEST, rollback,
    # fallback), or the one it serves put back into an engine that lost it (restart, ...).
    cause: Literal["new_version", "reconcile"] = "new_version"
    # With the gate on: why this version may be served (the Promotion's reasons).
    promotion: str | None = None


class TaskResult(BaseModel):
    """One task of an evaluation suite: its score (0..1 for pass/fail tasks) and details."""

    model_config = ConfigDict(extra="forbid")

    task: str
    score: float
    passed: bool | None = None
    details: dict[str, Any] = Field(default_factory=dict)


class EvalResult(Message):
    """One suite run on one candidate version. Its `id` is `eval_job_id(run, version,
    suite)`: a rerun (a worker killed mid-job) publishes the same id, deduplicated."""

    type: Literal["eval_result"] = "eval_result"
    run: str
    version: int = Field(ge=0)
    suite: str
    score: float
    higher_is_better: bool = True  # False for drift (a KL: lower is better)
    n: int = Field(0, ge=0)  # tasks (or samples) behind the score
    ci_low: float | None = None  # a 95% confidence interval of the score
    ci_high: float | None = None
    tasks: list[TaskResult] = Field(default_factory=list)
    metrics: dict[str, float] = Field(default_factory=dict)
    duration_s: float = 0.0
    engine: str = ""  # the evaluation engine that served the candidate
    worker: str = ""
    # Set for a model outside the run's lineage (`nextstate eval run --model PATH` or
    # `--version RUN:V`): its label. Such a result is stored beside the run's versions in
    # the bucket and never published on `evals` (no gate sees it); `version` is then 0.
    model: str | None = None


def eval_job_id(run: str, version: int, suite: str) -> str:
    """The deterministic id of the evaluation job (and its EvalResult): run/version/suite."""
    return f"eval.{run}.v{version:06d}.{suite}"


class SuiteTest(BaseModel):
    """How the gate decided one suite of a version (services/watcher/gate_rules.py).

    test: mcnemar_exact | paired_bootstrap   paired with the best version (`against`) on
              the `n` tasks both were scored on; `p_value` of "not worse", refused below `alpha`
          threshold   no per-task results to pair: score >= best - delta (`effect` = score - best)
          limit       a lower-is-better suite (drift): score <= the limit
          none        no baseline to compare with yet: passes
    """

    model_config = ConfigDict(extra="forbid")

    test: Literal["mcnemar_exact", "paired_bootstrap", "threshold", "limit", "none"]
    passed: bool
    n: int = Field(0, ge=0)
    p_value: float | None = None
    alpha: float | None = None
    effect: float | None = None  # candidate - best (mean over the paired tasks)
    against: int | None = None  # the version compared with (0: the base model)
    lost: int | None = None  # McNemar: tasks the best passes and the candidate fails
    gained: int | None = None  # ... and the other way round


class Promotion(Message):
    """The gate's decision on a version: served (`promoted`), not served (`refused`), served
    and then taken back (`rolled_back`), or never evaluated because a newer version was
    (`skipped`), with the reasons, the scores seen and, per suite, the test that decided.

    schema_version 2 added `tests` and `skipped`; a version-1 message (no tests) still
    parses, so readers take both."""

    type: Literal["promotion"] = "promotion"
    schema_version: Literal[1, 2] = 2  # type: ignore[assignment]  # wider than Message's
    run: str
    version: int = Field(ge=0)
    decision: Literal["promoted", "refused", "rolled_back", "skipped"]
    reasons: list[str] = Field(default_factory=list)
    scores: dict[str, float] = Field(default_factory=dict)  # suite -> score of this version
    baseline: dict[str, float] = Field(default_factory=dict)  # suite -> the best's score
    serving: int | None = None  # what the engine serves after the decision
    tests: dict[str, SuiteTest] = Field(default_factory=dict)  # suite -> how it was decided

    @model_validator(mode="after")
    def _v1_has_no_tests(self) -> Promotion:
        if self.schema_version == 1 and (self.tests or self.decision == "skipped"):
            raise ValueError("schema_version 1 has no `tests` and no `skipped` decision: write 2")
        return self


# Episode sessions (track 2) have session ids starting so: the buffer holds their scored
# turns until the episode's Outcome arrives (an ordinary client's session never waits).
EPISODE_SESSION_PREFIX = "env:"


def episode_job_id(run: str, env: str, task_id: str, group: str, index: int) -> str:
    """The deterministic id of an episode job (and of its Outcome): run, environment, task,
    group and the episode's index in it. Enqueued twice, it runs once."""
    return f"episode.{run}.{env}.{task_id}.{group}.{index}"


def episode_session_id(job_id: str, attempt: int, nonce: str) -> str:
    """The session id of one attempt at an episode (`X-Session-Id` of its requests). A
    retried episode is a new session: the turns of an attempt that died never meet the
    outcome of the one that finished."""
    return f"{EPISODE_SESSION_PREFIX}{job_id}.a{attempt}.{nonce}"


class Outcome(Message):
    """How one environment episode ended. Its `id` is the episode's job id
    (`episode_job_id`): a retried episode publishes the same id, deduplicated, and only
    the attempt in `session_id` is joined with it. `error` set: the episode could not be
    run to its end (the policy unreachable, the step budget's wall clock spent...) — its
    turns are not trained, and the reason is counted."""

    type: Literal["outcome"] = "outcome"
    run: str
    env: str
    task_id: str
    session_id: str
    group: str  # the episodes of one task sampled together (advantage groups)
    group_index: int = Field(0, ge=0)
    group_size: int = Field(1, ge=1)
    reward: float = Field(ge=-1.0, le=1.0)
    passed: bool = False
    details: dict[str, Any] = Field(default_factory=dict)
    policy_versions: list[int] = Field(default_factory=list)  # every version that answered
    steps: int = Field(0, ge=0)  # policy calls (turns) in the episode
    wall_s: float = Field(0.0, ge=0)
    attempt: int = Field(1, ge=1)
    worker: str = ""
    error: str | None = None

    @model_validator(mode="after")
    def _episode_session(self) -> Outcome:
        if not self.session_id.startswith(EPISODE_SESSION_PREFIX):
            raise ValueError(f"session_id must start with {EPISODE_SESSION_PREFIX!r}")
        if self.group_index >= self.group_size:
            raise ValueError(f"group_index {self.group_index} outside a group of {self.group_size}")
        return self


class Replay(Message):
    """A session whose held turns are due to be scored (experiential learning): its
    experience was extracted when it ended (`experience`), or it never ended within the
    judge's wait (`deadline`). Its `id` names the cause, so a cause published twice is
    replayed once; replaying is idempotent anyway (services/judge/replay.py)."""

    type: Literal["replay"] = "replay"
    session_id: str
    reason: Literal["experience", "deadline"]


class DeadLetter(Message):
    """A message that failed `deliveries` times, with the last error. Never silently dropped."""

    type: Literal["dead_letter"] = "dead_letter"
    stream: str  # short name of the stream it came from
    group: str
    entry_id: str  # its Redis entry id there
    data: str  # the original `data` field, verbatim
    error: str
    deliveries: int = Field(ge=0)
    consumer: str = ""


AnyMessage = Annotated[
    Turn
    | ScoredTurn
    | TrainSample
    | TrainBatch
    | CheckpointManifest
    | CheckpointPublished
    | PolicyLoaded
    | EvalResult
    | Promotion
    | Outcome
    | Replay
    | DeadLetter,
    Field(discriminator="type"),
]
_ANY: TypeAdapter[Any] = TypeAdapter(AnyMessage)

MESSAGE_TYPES: dict[str, type[Message]] = {
    "turn": Turn,
    "scored_turn": ScoredTurn,
    "train_sample": TrainSample,
    "train_batch": TrainBatch,
    "checkpoint_manifest": CheckpointManifest,
    "checkpoint_published": CheckpointPublished,
    "policy_loaded": PolicyLoaded,
    "eval_result": EvalResult,
    "promotion": Promotion,
    "outcome": Outcome,
    "replay": Replay,
    "dead_letter": DeadLetter,
}


def parse_message(data: str | bytes) -> Message:
    """Parse any known message by its `type`."""
    try:
        msg: Message = _ANY.validate_json(data)
    except ValidationError as exc:
        raise MalformedMessage(f"not a valid message: {describe(exc)}") from None
    return msg
