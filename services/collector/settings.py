"""The collector's configuration: `NEXTSTATE_COLLECTOR__*` on top of the shared settings.

    NEXTSTATE_COLLECTOR__PORT=8000              NEXTSTATE_COLLECTOR__HOST=127.0.0.1
    NEXTSTATE_COLLECTOR__ENGINE_KIND=sglang     sglang (also our CPU engine) or vllm
    NEXTSTATE_COLLECTOR__ENGINE_URL=http://127.0.0.1:30000
    NEXTSTATE_COLLECTOR__ENGINE_TIMEOUT_S=120   no answer (or no next stream chunk) -> 504
    NEXTSTATE_COLLECTOR__ENGINE_ADAPTERS=false  true with LoRA versions: name the served adapter
    NEXTSTATE_COLLECTOR__API_KEYS=k1,k2         bearer keys (comma list or JSON list);
                                                required when NEXTSTATE_ENV=prod
    NEXTSTATE_COLLECTOR__TOKENIZER=/models/x    default: the engine's /model_info tokenizer_path
    NEXTSTATE_COLLECTOR__DEFAULT_TURN_TYPE=main main | side (X-Turn-Type overrides per request)
    NEXTSTATE_COLLECTOR__PENDING_TTL_S=1800     a turn nobody follows up is emitted without
                                                a next state after this long
    NEXTSTATE_COLLECTOR__SPOOL_PATH=...         turns kept here while Redis is unreachable
    NEXTSTATE_COLLECTOR__RESPONSES_TTL_S=3600   /v1/responses objects (store: true) are kept
                                                this long for previous_response_id and GET
    NEXTSTATE_COLLECTOR__MAX_N=16               the largest `n` (choices per chat completion)
    NEXTSTATE_COLLECTOR__GROUP_UNCHOSEN=keep    keep | judge | drop: the other n - 1 choices
                                                once a follow-up continues one of them
    NEXTSTATE_COLLECTOR__PAIRING=anchors        anchors | prefix: how a follow-up finds the
                                                turn it continues (pairing.py); prefix is
                                                the exact rule alone
    NEXTSTATE_COLLECTOR__PAIRING_MIN_ANCHOR_CHARS=32
                                                an anchor with fewer bytes of text and tool
                                                calls is not used (unless scoped to a session id)

Groups (`n > 1`): the n choices are captured as n turns of one group. A follow-up that
continues choice k closes k's turn with its next state, and at the same moment its
siblings, by GROUP_UNCHOSEN:

    keep   emitted now with no next state (closed_by "unchosen"): on `turns` for the
           record, never trained (the buffer excludes them: no_next_state). The default:
           the next state answers the choice the user continued, not the others.
    judge  emitted now with the chosen choice's next state (closed_by "unchosen"), so the
           judge scores every choice against the same reply: what a group advantage
           (NEXTSTATE_BUFFER__GROUP_ADVANTAGE) compares. Sound when the reply judges the
           task rather than the wording (a verdict, a test result), not for tool results
           that answer the chosen choice's own calls.
    drop   deleted, never emitted (counted).

A choice identical to the chosen one (the same message after pairing's canonical form)
is closed as chosen: the follow-up continues it as much. A group nobody follows up
expires like any turn (ttl, no next state).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from shared.settings import Settings
from shared.toolparsers import tool_parser_names

TurnTypeSetting = Literal["main", "side"]
GroupUnchosen = Literal["keep", "judge", "drop"]
OverContext = Literal["clamp", "refuse"]
UnsupportedTools = Literal["drop", "refuse"]
PairingRule = Literal["prefix", "anchors"]


class CollectorConfig(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)

    # -- the engine ---------------------------------------------------------------------
    engine_kind: Literal["sglang", "vllm"] = "sglang"
    # The policy engine (SGLang's native API, or vLLM with ENGINE_KIND=vllm).
    engine_url: str = "http://127.0.0.1:30000"
    engine_timeout_s: float = Field(120.0, gt=0, description="per request / per stream chunk")
    engine_connect_timeout_s: float = Field(5.0, gt=0)
    engine_max_connections: int = Field(256, ge=1)
    engine_adapters: bool = Field(False, description="the policy is served as LoRA adapters (nextstate up --lora): name the adapter the engine's weight version points at in every request (SGLang and vLLM serve the base model to requests that name none; our engine serves its newest adapter either way)")
    startup_timeout_s: float = Field(120.0, ge=0, description="wait this long for the engine at start")
    served_model_name: str | None = None  # default: the engine's served_model_name
    tokenizer: str | None = None  # default: the engine's /model_info tokenizer_path
    chat_template: str | None = None  # a Jinja template overriding the tokenizer's

    # -- requests -----------------------------------------------------------------------
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    tool_parser: str = "hermes"
    reasoning: bool = False  # parse <think>…</think> into reasoning_content
    default_temperature: float = Field(1.0, ge=0, le=2)
    default_top_p: float = Field(1.0, gt=0, le=1)
    default_top_k: int = -1
    default_max_tokens: int | None = Field(None, ge=1)
    max_n: int = Field(16, ge=1, description="the largest n (choices per chat completion)")
    context_length: int | None = Field(
        None, ge=2, description="the policy's context window in tokens; a prompt that does not "
        "fit is refused before the engine is called (400 context_length_exceeded). Default: the "
        "engine's model info (context_length, vLLM's max_model_len), else the model config "
        "(max_position_embeddings)")  # fmt: skip
    max_tokens_over_context: OverContext = Field(
        "clamp", description="a max_tokens (max_output_tokens) that runs past the context window: "
        "clamp cuts it to the room left (the answer ends with finish_reason length, as vLLM "
        "does), refuse answers 400 context_length_exceeded (as OpenAI and SGLang do)")  # fmt: skip
    unsupported_tools: UnsupportedTools = Field(
        "drop", description="built-in tools a request offers that the engine cannot run (web "
        "search, file search, code interpreter, computer use, Anthropic server tools): drop "
        "leaves them out of the prompt and names them in the X-Nextstate-Dropped-Tools response "
        "header; refuse answers 400. A tool_choice forcing one is a 400 either way")  # fmt: skip

    # -- capture --------------------------------------------------------------------------
    default_turn_type: TurnTypeSetting = "main"
    pending_ttl_s: float = Field(1800.0, gt=0)
    sweep_interval_s: float = Field(1.0, gt=0)
    redis_timeout_s: float = Field(0.2, gt=0, description="the longest a request waits on Redis")
    redis_background_timeout_s: float = Field(5.0, gt=0, description="publishing, sweeping, replaying")
    redis_retry_s: float = Field(0.5, gt=0, description="probe an unreachable Redis this often")
    spool_path: Path | None = None  # default: .nextstate/collector-<port>.spool.jsonl
    spool_max_bytes: int = Field(512 * 1024 * 1024, ge=1024)
    fallback_max_pending: int = Field(10_000, ge=0, description="pending turns kept in memory in an outage")
    max_pairing_candidates: int = Field(64, ge=1, description="assistant messages checked per request")
    pairing: PairingRule = Field("anchors", description="prefix: the exact prefix rule only; anchors: "
                                 "then the anchors of the last response (services/collector/pairing.py)")
    pairing_min_anchor_chars: int = Field(32, ge=0, description="bytes of text and tool calls an "
                                          "unscoped anchor's messages need (fewer: not used)")
    responses_ttl_s: float = Field(3600.0, gt=0, description="stored Responses API objects live this long")
    group_unchosen: GroupUnchosen = "keep"  # the other choices of a group, once one is continued

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys(cls, v: Any) -> Any:
        if isinstance(v, str):
            s = v.strip()
            if s.startswith("["):
                return json.loads(s)
            return [p.strip() for p in s.split(",") if p.strip()]
        return v

    @field_validator("tool_parser")
    @classmethod
    def _parser(cls, v: str) -> str:
        if v not in tool_parser_names():
            raise ValueError(f"unknown tool parser {v!r}; known: {', '.join(tool_parser_names())}")
        return v

    @field_validator("engine_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return v.rstrip("/")

    def key_values(self) -> list[str]:
        return [k.get_secret_value() for k in self.api_keys]

    def spool_file(self) -> Path:
        if self.spool_path is not None:
            return self.spool_path
        return Path(".nextstate") / f"collector-{self.port}.spool.jsonl"


class CollectorSettings(Settings):
    collector: CollectorConfig = CollectorConfig()

    @model_validator(mode="after")
    def _keys_in_prod(self) -> CollectorSettings:
        if self.env == "prod" and not self.collector.api_keys:
            raise ValueError(
                "NEXTSTATE_COLLECTOR__API_KEYS is empty: set at least one bearer key "
                "when NEXTSTATE_ENV=prod (the collector refuses unauthenticated traffic there)"
            )
        return self
