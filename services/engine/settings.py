"""The engine's configuration: `NEXTSTATE_ENGINE__*`, with CLI flags layered on top.

    NEXTSTATE_ENGINE__MODEL=/models/policy     HF folder (config, safetensors, tokenizer); required
    NEXTSTATE_ENGINE__HOST=127.0.0.1           NEXTSTATE_ENGINE__PORT=30000
    NEXTSTATE_ENGINE__DEVICE=auto              cuda when available, else cpu
    NEXTSTATE_ENGINE__DTYPE=auto               float32 on cpu (exact log-probs), the config's dtype on cuda
    NEXTSTATE_ENGINE__WEIGHT_VERSION=0         reported until the first /update_weights_from_disk
    NEXTSTATE_ENGINE__MAX_RUNNING=16           requests generating at once (decode steps batched)
    NEXTSTATE_ENGINE__BATCH_DECODE=true        false: each request steps alone (bit-exact under load)
    NEXTSTATE_ENGINE__MAX_QUEUE=256            requests waiting beyond those; more are refused with 503
    NEXTSTATE_ENGINE__THREADS=                 torch threads (default: half the CPUs it may use, at least 1;
                                               shared/cpus.py says why)
    NEXTSTATE_ENGINE__MAX_LORAS=4              LoRA adapters loaded at once (/load_lora_adapter, by name)
    NEXTSTATE_ENGINE__MAX_LORA_RANK=256        the highest rank of an adapter it loads
    NEXTSTATE_ENGINE__TOOL_CALL_PARSER=        as SGLang's --tool-call-parser: /v1/chat/completions with
                                               `tools` parses the output's tool calls (hermes, mistral, ...);
                                               unset: the text is returned as is
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from shared.settings import Settings

Device = str  # "auto", "cpu", "cuda", "cuda:1", ...
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class EngineGroup(BaseModel):
    model: str = Field(description="HF model folder to serve")
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=0, le=65535)
    device: Device = "auto"
    dtype: Dtype = "auto"
    served_model_name: str | None = None  # default: the model folder's name
    tokenizer: str | None = None  # default: the model folder
    weight_version: str = "0"
    max_running: int = Field(16, ge=1, description="requests generating concurrently")
    max_queue: int = Field(256, ge=0, description="requests waiting for a slot; then 503")
    batch_decode: bool = Field(True, description="one forward pass per decode step for all running requests")
    default_max_new_tokens: int = Field(128, ge=0, description="as SGLang, when a request sets none")
    context_length: int | None = Field(None, ge=2, description="default: the model config's")
    threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (default: half the CPUs it may use, at least 1)")
    health_timeout_s: float = Field(20.0, gt=0, description="/health_generate gives up after this")
    tool_call_parser: str | None = Field(
        None, description="parse tool calls on /v1/chat/completions with tools (shared/toolparsers.py)")
    max_loras: int = Field(
        4, ge=1, description="LoRA adapters loaded at once (/load_lora_adapter beyond it is refused; "
        "the watcher unloads the one it replaced)")
    max_lora_rank: int = Field(256, ge=1, description="the highest LoRA rank /load_lora_adapter accepts")
    shutdown_grace_s: float = Field(10.0, ge=0)

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("set it to an HF model folder (or pass --model)")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v != "auto" and v != "cpu" and not v.startswith("cuda") and v != "mps":
            raise ValueError("auto, cpu, cuda, cuda:N or mps")
        return v

    @field_validator("tool_call_parser")
    @classmethod
    def _tool_call_parser(cls, v: str | None) -> str | None:
        from shared.toolparsers import tool_parser_names

        if v is not None and v not in tool_parser_names():
            raise ValueError(f"unknown tool parser {v!r}; known: {', '.join(tool_parser_names())}")
        return v


class EngineSettings(Settings):
    engine: EngineGroup

    @model_validator(mode="before")
    @classmethod
    def _engine_group(cls, data: Any) -> Any:
        # Without this a missing group reads "NEXTSTATE_ENGINE: Field required";
        # with it the error names NEXTSTATE_ENGINE__MODEL, the variable to set.
        if isinstance(data, dict):
            data.setdefault("engine", {})
        return data
