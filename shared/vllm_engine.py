"""vLLM as the engine on this machine: where its venv is, and how it is started on CPU.

`nextstate up --engine vllm` (or NEXTSTATE_ENGINE__KIND=vllm), bench/engine.py and the
real-vLLM tests start it the same way:

    spec = VLLMLaunch.from_env()                 # NEXTSTATE_ENGINE__* below
    argv, env = spec.command(model, port)        # -> `python -m services.vllm …` (its own venv)

    NEXTSTATE_ENGINE__KIND=cpu|vllm          which engine `up` starts (default cpu: ours)
    NEXTSTATE_ENGINE__VLLM_PYTHON=…          the vLLM venv's python (default: .venv-vllm of this
                                             checkout, which `make vllm` installs)
    NEXTSTATE_ENGINE__THREADS=               OpenMP threads (default: half the CPUs it may use,
                                             at least 1, as our engine; shared/cpus.py says why)
    NEXTSTATE_ENGINE__MAX_RUNNING=16         sequences decoded together (--max-num-seqs)
    NEXTSTATE_ENGINE__CONTEXT_LENGTH=4096    --max-model-len (default: 4096, or the model's if less)
    NEXTSTATE_ENGINE__KV_CACHE_GIB=1         vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE)
    NEXTSTATE_ENGINE__DTYPE=float32          float32: the trainer recomputes the same log-probs
    NEXTSTATE_ENGINE__LORA_RANK=             serve LoRA adapters up to this rank, loaded by name at
                                             run time (`nextstate up --lora R` sets it)

What every start gets, and why:
- `--enforce-eager`: no torch.compile (minutes of compiling on 2 cores, for little at this size).
- `--logprobs-mode processed_logprobs`: sampled log-probs after temperature (and top-k/top-p),
  the distribution the token was drawn from — what the trainer's PPO ratio compares against.
- `--enable-scale-out`: `/inference/v1/generate`, token ids in and out with the weight version
  of every output token (VLLMClient); `--return-tokens-as-token-ids`: log-prob tokens as
  `token_id:<id>`; `--max-logprobs 21`: the client asks one more than the OpenAI maximum of 20.
- VLLM_SERVER_DEV_MODE=1: `/pause`, `/collective_rpc reload_weights`, `/update_weight_version`,
  `/resume` — the hot reload. services/vllm puts every route behind the internal token
  (VLLM_API_KEY, never on the command line).
- VLLM_CPU_OMP_THREADS_BIND=nobind + OMP_NUM_THREADS: a deliberate thread count, not pinned to
  cores the machine shares with the rest of the stack (vLLM's `auto` binds one per core).
- HF_HUB_OFFLINE=1: a weights path that does not exist is never looked up on a model hub.
- `--served-model-name policy`, `--disable-log-stats`: one name for every version; quiet logs.
  (`up --judge-model` serves its judge model as `judge`, on a vLLM server of its own.)
- with LoRA versions (`lora_rank`): `--enable-lora --max-lora-rank R --max-loras 2` and
  VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, which opens `/v1/load_lora_adapter` and
  `/v1/unload_lora_adapter` (the CPU build serves LoRA: checked against 0.32, log-probs of base
  + adapter equal to PEFT's within 1e-6). Two adapters: the one serving and the one replacing it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from shared.cpus import default_threads
from shared.settings import Settings

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VENV = REPO / ".venv-vllm"
SERVED_NAME = "policy"


class EngineChoice(BaseModel):
    """The `NEXTSTATE_ENGINE__*` settings `up` reads to start the engine (the CPU engine's own
    are in services/engine/settings.py; these names are shared where they mean the same)."""

    kind: Literal["cpu", "vllm"] = "cpu"
    vllm_python: str | None = None
    threads: int | None = Field(None, ge=1)
    max_running: int = Field(16, ge=1)
    context_length: int | None = Field(None, ge=16)
    kv_cache_gib: int = Field(1, ge=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    lora_rank: int | None = Field(None, ge=1, description="serve LoRA adapters up to this rank (vLLM: "
                                  "--enable-lora --max-lora-rank; our engine: NEXTSTATE_ENGINE__MAX_LORA_RANK)")


class EngineChoiceSettings(Settings):
    engine: EngineChoice = EngineChoice()


def vllm_python(configured: str | None = None) -> Path | None:
    """The vLLM venv's interpreter: `configured`, else this checkout's .venv-vllm; None when
    it is not installed (`make vllm`)."""
    path = Path(configured) if configured else DEFAULT_VENV / "bin" / "python"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _model_max_len(model: Path) -> int | None:
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) else None


class VLLMLaunch(BaseModel):
    """How one vLLM server is started (see the module docstring)."""

    python: str
    threads: int = Field(ge=1)
    max_running: int = Field(16, ge=1)
    context_length: int | None = None
    kv_cache_gib: int = Field(1, ge=1)
    dtype: str = "float32"
    lora_rank: int | None = Field(None, ge=1)

    @classmethod
    def from_choice(cls, choice: EngineChoice) -> VLLMLaunch:
        python = vllm_python(choice.vllm_python)
        if python is None:
            where = choice.vllm_python or f"{DEFAULT_VENV}/bin/python"
            raise RuntimeError(f"vLLM is not installed at {where}: run `make vllm` (its own venv, "
                               "about 1.5 minutes) or set NEXTSTATE_ENGINE__VLLM_PYTHON")
        return cls(python=str(python), threads=choice.threads or default_threads(),
                   max_running=choice.max_running, context_length=choice.context_length,
                   kv_cache_gib=choice.kv_cache_gib, dtype=choice.dtype, lora_rank=choice.lora_rank)

    @classmethod
    def from_env(cls) -> VLLMLaunch:
        return cls.from_choice(EngineChoiceSettings().engine)

    def command(self, model: Path, port: int, host: str = "127.0.0.1",
                served_name: str = SERVED_NAME) -> tuple[list[str], dict[str, str]]:
        """The argv and the environment additions that serve `model` on `port` as `served_name`."""
        max_len = self.context_length or min(4096, _model_max_len(model) or 4096)
        argv = [
            self.python, "-m", "services.vllm",
            "--model", str(model), "--served-model-name", served_name,
            "--host", host, "--port", str(port),
            "--dtype", self.dtype, "--enforce-eager",
            "--max-model-len", str(max_len), "--max-num-seqs", str(self.max_running),
            "--logprobs-mode", "processed_logprobs", "--max-logprobs", "21",
            "--enable-scale-out", "--return-tokens-as-token-ids",
            "--disable-log-stats", "--generation-config", "vllm",
        ]
        if self.lora_rank is not None:
            argv += ["--enable-lora", "--max-lora-rank", str(self.lora_rank), "--max-loras", "2"]
        env = {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": str(self.threads),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            # services.vllm is imported from this checkout, by the vLLM venv's interpreter.
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        }
        if self.lora_rank is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return argv, env
