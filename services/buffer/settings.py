"""The buffer's configuration: `NEXTSTATE_BUFFER__*`.

    NEXTSTATE_BUFFER__BATCH_SIZE=16          samples per TrainBatch (B)
    NEXTSTATE_BUFFER__MAX_WAIT_S=30          publish a partial batch once its oldest sample waited this long
    NEXTSTATE_BUFFER__MAX_STALENESS=16       samples more than this many versions behind the trainer do not
                                             train on their reward (16: a saturated stack measured at most 12;
                                             bench/staleness.py)
    NEXTSTATE_BUFFER__MODE=rl                rl | opd | combine: which turns become samples
    NEXTSTATE_BUFFER__MIN_SAMPLES_PER_SESSION=1   at-least-one rule (0 turns it off)
    NEXTSTATE_BUFFER__FORCE_SETTLE_S=300     a final turn waits for its session's earlier turns at most this long
    NEXTSTATE_BUFFER__OUTCOME_WAIT_S=600     an episode's turns wait this long for its Outcome (and a group for
                                             its K outcomes); then missing = dropped, counted `outcome_missing`
    NEXTSTATE_BUFFER__OUTCOME_MODE=outcome   outcome | outcome+prm: an episode turn's reward (below)
    NEXTSTATE_BUFFER__PRM_WEIGHT=0.5         w of the judge's per-turn score in outcome+prm
    NEXTSTATE_BUFFER__GROUP_ADVANTAGE=raw    raw | group_mean | group_norm: the outcome term (below), and
                                             a chat group's (n > 1 choices) rewards (chat_groups.py)
    NEXTSTATE_BUFFER__GROUP_EPS=1e-6         eps of group_norm
    NEXTSTATE_BUFFER__ARCHIVE=true           gzip JSONL of every published sample in the bucket
    NEXTSTATE_BUFFER__ARCHIVE_ROLL_SAMPLES=1000   NEXTSTATE_BUFFER__ARCHIVE_ROLL_S=300
    NEXTSTATE_BUFFER__HOST=127.0.0.1         NEXTSTATE_BUFFER__PORT=8200
    NEXTSTATE_BUFFER__TOKENIZER=/models/policy    HF folder whose chat template tokenizes imports

The reward of an environment episode's turn (session id `env:...`, episodes.py): with
R the episode's `Outcome.reward` and, for group advantages, mean and std over the
rewards of the outcomes of its group (`Outcome.group`; failed episodes excluded; std
with Bessel's correction),

    raw         A = R
    group_mean  A = R - mean
    group_norm  A = (R - mean) / (std + eps)

    outcome      reward = A                     (the judge's score is ignored)
    outcome+prm  reward = A + prm_weight * s    (s: the judge's score in [-1, 1] for that turn)

Every main turn of the episode with a next state gets it (the env worker gives every step
one: the tool results, or the verdict after a final answer); its closing request and
side turns never train. Then the usual rules: staleness, and in rl mode a reward of exactly 0 is
excluded (`zero_reward`); the at-least-one rule does not apply to episodes.

A chat group (the n choices of one completion, `n > 1`), in rl and combine modes: `raw`
trains each choice on its own judged reward r (A = r, at once); `group_mean` /
`group_norm` wait (at most `outcome_wait_s`) until every choice of the group came, then
give each judged choice r - mean, or (r - mean) / (std + eps), over the group's judged
rewards. They need the collector's GROUP_UNCHOSEN=judge: under `keep` only the chosen
choice is judged, and a group with fewer than 2 judged choices is dropped (`group_too_small`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from shared.schemas import Mode
from shared.settings import Settings

OutcomeMode = Literal["outcome", "outcome+prm"]
GroupAdvantage = Literal["raw", "group_mean", "group_norm"]


class BufferConfig(BaseModel):
    batch_size: int = Field(16, ge=1, description="samples per TrainBatch")
    max_wait_s: float = Field(30.0, gt=0, description="a partial batch is published after this")
    # The PPO ratio against the engine's exact behaviour log-probs corrects staleness, and
    # the clip bounds each update; the bound only catches a policy left far behind (an
    # engine stuck on an old version). Measured (bench/staleness.py, 2 cores, tiny model,
    # 40 req/s, 3.35 versions/s): staleness at intake peaks at 12, and a bound of 4 would
    # have refused 55% of samples, 8 refused 6%, 16 none.
    max_staleness: int = Field(16, ge=0, description="versions behind the trainer a sample may be")
    mode: Mode = "rl"
    min_samples_per_session: int = Field(1, ge=0, description="at-least-one rule; 0 disables")
    session_ttl_s: int = Field(24 * 3600, ge=60, description="life of a session's sample set in Redis")
    # The at-least-one rule decides a session's final turn once its earlier turns are
    # decided, or after this long (finals.py).
    force_settle_s: float = Field(300.0, ge=0, description="longest wait for a final turn's ancestors")
    force_sweep_s: float = Field(0.25, gt=0, description="how often parked final turns are checked")
    force_scan: int = Field(1000, ge=1, description="parked final turns looked at per sweep")
    force_lease: float | None = Field(
        None, gt=0, description="a claimed final turn is held this long (default max_wait_s + 60)")
    # Handlers in flight: each waits until the batch holding its sample is published, so
    # this must be at least one batch; two lets the next batch fill while one publishes.
    concurrency: int | None = Field(None, ge=1, description="default: 2 x batch_size")
    # A stable name lets a restarted buffer take back its own unacknowledged entries at
    # once; the default (host-pid) leaves them to the janitor after claim_idle_ms.
    consumer_name: str | None = None
    publish_retry_max_s: float = Field(5.0, gt=0, description="backoff cap when batches is full")

    # Environment episodes (track 2): the join of their turns with their Outcome.
    outcome_wait_s: float = Field(600.0, gt=0, description="longest wait for an episode's outcome or its group")
    outcome_mode: OutcomeMode = "outcome"
    prm_weight: float = Field(0.5, description="w of the judge's per-turn score in outcome+prm")
    group_advantage: GroupAdvantage = "raw"  # episode groups and chat groups (n > 1)
    group_eps: float = Field(1e-6, gt=0, description="eps in group_norm's (R - mean) / (std + eps)")
    # Claims of held episode sessions are leases of force_lease_s, sweeps look at force_scan.
    outcome_sweep_s: float = Field(0.25, gt=0, description="how often held episode sessions are checked")

    archive: bool = True
    archive_roll_samples: int = Field(1000, ge=1, description="samples per archive object")
    archive_roll_s: float = Field(300.0, gt=0, description="seal an archive object after this")
    archive_max_pending: int = Field(64, ge=1, description="sealed objects waiting to upload; then drop oldest")
    archive_retry_max_s: float = Field(30.0, gt=0, description="backoff cap for failed uploads")
    archive_in_flight: int = Field(256, ge=2, description="batches the archive group holds unacknowledged")

    host: str = "127.0.0.1"
    port: int = Field(8200, ge=0, le=65535)
    tokenizer: str | None = Field(None, description="HF folder or hub id for POST /receive")
    receive_max_records: int = Field(1000, ge=1, description="records per POST /receive")
    get_data_max: int = Field(64, ge=1, description="largest n for GET /get_data")
    get_data_max_wait_s: float = Field(30.0, ge=0, description="longest wait= for GET /get_data")

    @model_validator(mode="after")
    def _enough_in_flight(self) -> BufferConfig:
        if self.concurrency is not None and self.concurrency < self.batch_size:
            raise ValueError(
                f"concurrency {self.concurrency} < batch_size {self.batch_size}: a batch could "
                "never fill (every handler waits for its batch); raise it or leave it unset"
            )
        return self

    @property
    def force_lease_s(self) -> float:
        """How long a claimed final turn is held: long enough for its batch to publish."""
        return self.force_lease if self.force_lease is not None else self.max_wait_s + 60.0

    @property
    def outcome_ttl_s(self) -> int:
        """How long an Outcome and its group are kept: its group's wait, then the bound
        again for turns that come after it."""
        return int(2 * self.outcome_wait_s) + 60

    @property
    def in_flight(self) -> int:
        return self.concurrency if self.concurrency is not None else 2 * self.batch_size


class BufferSettings(Settings):
    buffer: BufferConfig = BufferConfig()
