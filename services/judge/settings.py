"""The judge's configuration: `NEXTSTATE_JUDGE__*` on top of the shared settings.

    NEXTSTATE_JUDGE__TYPE=prm            prm | rule | rule+prm | classifier | module:callable (a plugin)
    NEXTSTATE_JUDGE__CLASSIFIER=...      classifier: an HF sequence-classification folder; reward 2p - 1
                                         (CLASSIFIER_POSITIVE_LABEL=1, CLASSIFIER_BATCH_SIZE=16,
                                         CLASSIFIER_BATCH_WAIT_MS=10, CLASSIFIER_MAX_LENGTH=1024)
    NEXTSTATE_JUDGE__MODE=rl             rl (reward) | opd (hint + teacher log-probs) | combine (both)
    NEXTSTATE_JUDGE__BACKEND=openai      openai (any /v1/chat/completions) | sglang (native /generate, text in)
    NEXTSTATE_JUDGE__URL=http://127.0.0.1:30000      with or without a trailing /v1
    NEXTSTATE_JUDGE__MODEL=judge         the model name sent to an OpenAI-compatible server
    NEXTSTATE_JUDGE__API_KEY=...         bearer key of the judge model (never logged); unset and the
                                         judge model is the policy engine (URL on the same host:port
                                         as ENGINE_URL): the stack's NEXTSTATE_INTERNAL__TOKEN
    NEXTSTATE_JUDGE__JUDGE_ENGINE_URL=   the stack's own judge-model engine (`nextstate up --judge-model`,
                                         compose's and k8s's `judge-model`): a URL on its host:port is
                                         sent the internal token, whatever API_KEY says
    NEXTSTATE_JUDGE__VOTES=3             calls per turn, run concurrently; aggregated as SCORES says
    NEXTSTATE_JUDGE__SCORES=label        label (\\boxed{-1|0|1}) | graded (a number in [-1, 1]) |
                                         probability (p in [0, 1] -> 2p - 1): services/judge/parsing.py
    NEXTSTATE_JUDGE__VOTE_THRESHOLD=     labels: the share of valid votes a label needs (e.g. 0.6);
                                         default strictly more than half; else the reward is 0.
                                         graded / probability votes are averaged (no threshold)
    NEXTSTATE_JUDGE__VERDICT_GRAMMAR=false   BACKEND=sglang, labels: every PRM vote is decoded under a grammar
                                         allowing only \\boxed{1|0|-1}, no reasoning (prompt prm-verdict-v1): a
                                         small judge model that never ends in a box still gives readable votes
    NEXTSTATE_JUDGE__QUORUM=             calls that must answer (default: a majority of VOTES)
    NEXTSTATE_JUDGE__TEMPERATURE=0.6     NEXTSTATE_JUDGE__MAX_TOKENS=1024
    NEXTSTATE_JUDGE__TIMEOUT_S=60        per call, all attempts of one call share nothing
    NEXTSTATE_JUDGE__RETRIES=2           extra attempts on transport errors, timeouts, 5xx, 429
    NEXTSTATE_JUDGE__CONCURRENCY=256     turns in flight in this process
    NEXTSTATE_JUDGE__ENGINE_URL=...      the policy engine, for OPD teacher log-probs (sent the internal token)
    NEXTSTATE_JUDGE__TOKENIZER=...       the policy's tokenizer folder, for OPD teacher prompts
    NEXTSTATE_JUDGE__TOPK=0              OPD: also record the teacher's top-K ids and log-probs per
                                         response token (for the trainer's opd_topk loss; 50 is usual)
    NEXTSTATE_JUDGE__HINT_SOURCE=llm     llm (the hint judge, HINT_PROMPT_VERSION) | rule (the next state, quoted,
                                         when the rule judge reads it as a correction; no model needed)
    NEXTSTATE_JUDGE__TEACHER=hint        OPD/combine: what the teacher prompt adds to the context: hint (one
                                         turn's hindsight hint) | experience (lessons extracted from finished
                                         sessions: experiential learning, services/judge/experience.py)
    NEXTSTATE_JUDGE__EXPERIENCE_SCOPE=session   session (only the turn's own session's lessons) | cross
                                         (also the most relevant of the user's, else everyone's, stored ones)
    NEXTSTATE_JUDGE__EXPERIENCE_EXTRACTOR=llm   llm (the judge model, EXPERIENCE_PROMPT_VERSION) | rule (the
                                         user's replies the rule judge reads as corrections, verbatim)
    NEXTSTATE_JUDGE__EXPERIENCE_STORE_MAX=100   records kept per list (global, and each user's), newest first
    NEXTSTATE_JUDGE__EXPERIENCE_WAIT_S=2400     a turn waits this long for its session to end, then is scored
                                         without its session's experience (> the collector's PENDING_TTL_S)
    NEXTSTATE_JUDGE__COLLAPSE_WINDOW=200     the reward-collapse alarm (collapse.py): over the last N judged turns
                                         of every replica (0: off), alarm when one reward value holds at least
    NEXTSTATE_JUDGE__COLLAPSE_VALUE_SHARE=0.95       this share of them, or the votes of at least
    NEXTSTATE_JUDGE__COLLAPSE_UNDECIDED_SHARE=0.5    this share were undecided (a tie, nothing readable);
    NEXTSTATE_JUDGE__COLLAPSE_MIN_TURNS=100  judged only once the window holds this many turns
    NEXTSTATE_JUDGE__PROMPT_VERSION=prm-v1   (default by SCORES: prm-v1, prm-graded-v1, prm-prob-v1)
    NEXTSTATE_JUDGE__HINT_PROMPT_VERSION=hint-v1
    NEXTSTATE_JUDGE__HOST=127.0.0.1      NEXTSTATE_JUDGE__PORT=9102   (/healthz /readyz /metrics)
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

from services.judge.parsing import ScoreScale
from shared.schemas import Mode
from shared.settings import Settings

BUILTIN_JUDGES = ("prm", "rule", "rule+prm", "classifier")
DEFAULT_PROMPTS: dict[str, str] = {"label": "prm-v1", "graded": "prm-graded-v1", "probability": "prm-prob-v1"}
VERDICT_PROMPT = "prm-verdict-v1"  # the default prompt under VERDICT_GRAMMAR
_PLUGIN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

DEFAULT_POSITIVE = (
    r"\bthanks?\b", r"\bthank you\b", r"\bperfect\b", r"\b(?<!not )(?<!doesn't )(?<!does not )works?\b",
    r"\bworked\b", r"(?<!not )\bcorrect\b", r"\bgreat\b", r"\bexit code:? 0\b",
    r"\bsuccess(ful(ly)?)?\b", r"\blooks good\b",
)  # fmt: skip
DEFAULT_NEGATIVE = (
    r"\bwrong\b", r"\bagain\b", r"\bretry\b", r"\berror\b", r"\btraceback\b", r"\bnot what i\b",
    r"\bincorrect\b", r"\bnot correct\b", r"\bdoes(n't| not) work\b", r"\bfail(ed|ure|s)?\b",
    r"\bexception\b", r"\bexit code:? [1-9]\d*\b", r"\bthat's not\b",
)  # fmt: skip


class JudgeConfig(BaseModel):
    type: str = Field("prm", description="prm | rule | rule+prm | classifier | module:callable")
    mode: Mode = "rl"
    # -- the judge model ----------------------------------------------------------
    backend: Literal["openai", "sglang"] = "openai"
    url: str = "http://127.0.0.1:30000"
    model: str = "default"
    api_key: SecretStr | None = None
    judge_tokenizer: str | None = Field(
        None, description="sglang backend: render the judge prompt with this model's chat template"
    )
    verdict_grammar: bool = Field(
        False, description="sglang backend, labels: each vote decoded under a grammar that allows only "
                           "\\boxed{1}, \\boxed{0} or \\boxed{-1} (no reasoning): small judge models")
    judge_engine_url: str | None = Field(
        None, description="the stack's own judge-model engine: a URL on its origin gets the internal token"
    )
    votes: int = Field(3, ge=1, le=32)
    quorum: int | None = Field(None, ge=1, description="answered calls needed (default: votes//2+1)")
    scores: ScoreScale = Field("label", description="label | graded | probability (parsing.py)")
    vote_threshold: float | None = Field(
        None, gt=0, le=1, description="labels: share of valid votes a label needs (default: > 1/2)"
    )
    temperature: float = Field(0.6, ge=0)
    max_tokens: int = Field(1024, ge=1)
    timeout_s: float = Field(60.0, gt=0, description="one call, one attempt")
    connect_timeout_s: float = Field(5.0, gt=0)
    retries: int = Field(2, ge=0, le=10, description="extra attempts per call")
    backoff_s: float = Field(0.5, ge=0, description="first retry delay; doubles each time")
    concurrency: int = Field(256, ge=1, le=10_000, description="turns in flight per process")
    prompt_version: str = "prm-v1"
    hint_prompt_version: str = "hint-v1"
    max_response_chars: int = Field(4000, ge=200)
    max_next_state_chars: int = Field(3000, ge=200)
    max_context_chars: int = Field(1200, ge=0)
    # -- classifier judge (services/judge/classifier.py) -----------------------------------
    classifier: str | None = Field(None, description="HF sequence-classification folder")
    classifier_positive_label: int = Field(1, ge=0, description="the label whose probability is p")
    classifier_batch_size: int = Field(16, ge=1, le=1024)
    classifier_batch_wait_ms: float = Field(10.0, ge=0, description="wait this long to fill a batch")
    classifier_max_length: int = Field(1024, ge=8, description="tokens per text (truncated)")
    # -- rule judge -------------------------------------------------------------------
    positive: list[str] = Field(default_factory=lambda: list(DEFAULT_POSITIVE))
    negative: list[str] = Field(default_factory=lambda: list(DEFAULT_NEGATIVE))
    # -- OPD ----------------------------------------------------------------------------
    engine_url: str | None = None
    engine_kind: Literal["sglang", "vllm"] = "sglang"
    engine_timeout_s: float = Field(120.0, gt=0)
    engine_adapters: bool = Field(False, description="the policy is served as LoRA adapters (nextstate up --lora): name the adapter the engine's weight version points at in every request (SGLang and vLLM serve the base model to requests that name none; our engine serves its newest adapter either way)")
    tokenizer: str | None = Field(None, description="policy tokenizer folder for teacher prompts")
    teacher_temperature: float | None = Field(
        None, gt=0, description="default: the turn's sampling temperature (1.0 when it was 0)"
    )
    topk: int = Field(
        0, ge=0, le=1024, description="OPD: also record the teacher's top-K per response token (0: off)"
    )
    min_hint_chars: int = Field(12, ge=1)
    max_hint_chars: int = Field(800, ge=20)
    hint_source: Literal["llm", "rule"] = Field(
        "llm", description="hints from the judge model (HINT_PROMPT_VERSION), or the next state quoted "
        "when the rule judge reads it as a correction"
    )
    teacher: Literal["hint", "experience"] = Field(
        "hint", description="OPD/combine: the teacher's extra context, a hint or extracted experience"
    )
    # -- experiential learning (services/judge/experience.py, replay.py) -----------------
    experience_scope: Literal["session", "cross"] = "session"
    experience_extractor: Literal["llm", "rule"] = "llm"
    experience_prompt_version: str = "experience-v1"
    experience_max_lessons: int = Field(5, ge=1, le=20, description="lessons kept per session")
    experience_lesson_chars: int = Field(300, ge=20, le=2000, description="a lesson is cut at this length")
    experience_session_chars: int = Field(6000, ge=500, description="the session as the extractor reads it")
    experience_store_max: int = Field(100, ge=1, le=100_000, description="records per list (global, per user)")
    experience_ttl_s: int = Field(7 * 24 * 3600, ge=60, description="a session's and a user's records expire")
    experience_records: int = Field(3, ge=0, le=50, description="cross: stored records in a teacher prompt")
    experience_scan: int = Field(50, ge=1, le=1000, description="cross: newest records ranked per list")
    experience_prompt_chars: int = Field(2000, ge=100, description="the experience block's bound")
    experience_wait_s: float = Field(2400.0, gt=0, description="a held turn's wait for its session's end")
    experience_max_held: int = Field(512, ge=1, description="held turns per session; then scored at once")
    experience_sweep_s: float = Field(1.0, gt=0, description="how often overdue sessions are looked for")
    experience_lease_s: float = Field(300.0, gt=0, description="a deadline replay is tried again after this")
    replay_concurrency: int = Field(8, ge=1, le=1024, description="sessions replayed at once per process")
    # -- the reward-collapse alarm (services/judge/collapse.py) ----------------------------
    collapse_window: int = Field(200, ge=0, le=100_000, description="judged turns looked at (0: no alarm)")
    collapse_min_turns: int = Field(100, ge=1, description="the alarm is judged once the window holds this many")
    collapse_value_share: float = Field(0.95, gt=0, le=1, description="alarm: one reward value holds this share")
    collapse_undecided_share: float = Field(0.5, gt=0, le=1, description="alarm: this share of turns undecided")
    # -- process --------------------------------------------------------------------------
    consumer_name: str | None = Field(None, description="stable name to reclaim own work on restart")
    publish_wait_s: float = Field(30.0, ge=0, description="wait this long for room in `scored`")
    host: str = "127.0.0.1"
    port: int = Field(9102, ge=0, le=65535)

    @field_validator("type")
    @classmethod
    def _type(cls, v: str) -> str:
        if v not in BUILTIN_JUDGES and not _PLUGIN.fullmatch(v):
            raise ValueError(
                f"one of {', '.join(BUILTIN_JUDGES)} or a plugin as module:callable, got {v!r}"
            )
        return v

    @field_validator("url", "engine_url", "judge_engine_url")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/") if v is not None else None

    @field_validator("positive", "negative")
    @classmethod
    def _regexes(cls, v: list[str]) -> list[str]:
        for pattern in v:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"invalid regular expression {pattern!r}: {exc}") from None
        return v

    @model_validator(mode="after")
    def _consistent(self) -> JudgeConfig:
        if self.quorum is not None and self.quorum > self.votes:
            raise ValueError(f"quorum {self.quorum} exceeds votes {self.votes}")
        if self.vote_threshold is not None and self.scores != "label":
            raise ValueError(
                f"NEXTSTATE_JUDGE__VOTE_THRESHOLD applies to labels; {self.scores} scores are "
                "averaged: unset it, or set NEXTSTATE_JUDGE__SCORES=label"
            )
        if self.type == "classifier" and self.classifier is None:
            raise ValueError("judge type classifier needs NEXTSTATE_JUDGE__CLASSIFIER (an HF folder)")
        if self.topk and self.engine_kind != "sglang":
            raise ValueError("NEXTSTATE_JUDGE__TOPK needs ENGINE_KIND=sglang (token-in top-K scoring)")
        if self.topk and self.mode == "rl":
            raise ValueError("NEXTSTATE_JUDGE__TOPK records the teacher's top-K: it needs MODE=opd or combine")
        if self.verdict_grammar and (self.backend != "sglang" or self.scores != "label"):
            raise ValueError("NEXTSTATE_JUDGE__VERDICT_GRAMMAR constrains label votes on /generate: it needs "
                             "BACKEND=sglang (SGLang or our engine; set JUDGE_TOKENIZER too) and SCORES=label")
        if "prompt_version" not in self.model_fields_set:
            self.prompt_version = VERDICT_PROMPT if self.verdict_grammar else DEFAULT_PROMPTS[self.scores]
        if self.teacher == "experience" and self.mode == "rl":
            raise ValueError("NEXTSTATE_JUDGE__TEACHER=experience distils a teacher: it needs MODE=opd or combine")
        if self.mode in ("opd", "combine"):
            missing = [n for n in ("engine_url", "tokenizer") if getattr(self, n) is None]
            if missing:
                names = " and ".join(f"NEXTSTATE_JUDGE__{n.upper()}" for n in missing)
                raise ValueError(f"mode {self.mode} needs {names} (teacher log-probs)")
        return self

    @property
    def needed(self) -> int:
        """Calls that must answer for a vote to stand (the partial-failure rule)."""
        return self.quorum if self.quorum is not None else self.votes // 2 + 1

    @property
    def experience(self) -> bool:
        """Experiential learning: turns wait for their session's experience (replay.py)."""
        return self.mode != "rl" and self.teacher == "experience"

    @property
    def uses_llm(self) -> bool:
        if self.type in ("prm", "rule+prm"):
            return True
        if self.mode == "rl":
            return False
        if self.teacher == "hint":
            return self.hint_source == "llm"
        return self.experience_extractor == "llm"


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80)


class JudgeSettings(Settings):
    judge: JudgeConfig = JudgeConfig()

    @model_validator(mode="after")
    def _judge_model_key(self) -> JudgeSettings:
        """The stack's own engines need the internal token. The judge-model engine (`up
        --judge-model`, compose's and k8s's `judge-model` service) takes nothing else: a judge
        URL on its origin always sends the token. The policy engine (the judge model of
        compose and k8s by default) gets it when no API_KEY is set. Any other judge model (a
        hosted API) never receives it."""
        j = self.judge
        if j.judge_engine_url is not None and _origin(j.url) == _origin(j.judge_engine_url):
            j.api_key = self.internal.token
        elif j.api_key is None and j.engine_url is not None and _origin(j.url) == _origin(j.engine_url):
            j.api_key = self.internal.token
        return self
