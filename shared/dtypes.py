"""The dtype a model folder's weights are in: the one dtype v0 and every version are served in.

An engine started on the base model's folder with its dtype left to the folder serves v0
in the folder's dtype (our engine on a GPU; SGLang's and vLLM's `--dtype auto` for a bf16
or fp16 folder — a float32 one they serve in fp16). Every version must reach it in that
same dtype, or the first one switches the served precision (fp32 → bf16 rounds every
weight) without any training in it. Two services read the folder through the functions
here, so they cannot disagree:

- the trainer publishes in it (`NEXTSTATE_TRAINER__PUBLISH_DTYPE=auto`);
- the watcher refuses a full version whose weights are in another dtype (LoRA adapters
  are exempt: the engine applies them in the dtype of the weights it holds).

`folder_dtype` is what `dtype="auto"` loaders read: config.json's `dtype` (transformers
5; `torch_dtype` before), else the safetensors headers. `weights_dtype` reads the
headers only: what a version's bytes are. Mixed folders (a few fp32 norms among bf16
matrices) count as the dtype that holds most of the weights.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from pathlib import Path

from shared.errors import IncompatibleCheckpoint

MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on a header
# safetensors' names of the floating dtypes -> torch's (what config.json and manifests say).
FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
          "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) from a safetensors file's header; IncompatibleCheckpoint
    when the header does not parse or the data does not end where the file ends."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise IncompatibleCheckpoint(f"{path.name}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > min(MAX_HEADER, size - 8):
            raise IncompatibleCheckpoint(f"{path.name}: safetensors header of {n} bytes in a {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise IncompatibleCheckpoint(f"{path.name}: safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise IncompatibleCheckpoint(f"{path.name}: safetensors header is not an object")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            out[name] = (str(meta["dtype"]), tuple(int(d) for d in meta["shape"]))
            end = max(end, int(meta["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            raise IncompatibleCheckpoint(f"{path.name}: malformed entry {name!r} in the header") from None
    if 8 + n + end != size:
        raise IncompatibleCheckpoint(f"{path.name}: its tensors end at byte {8 + n + end}, the file at {size}")
    return out


def weights_dtype(folder: Path, pattern: str = "*.safetensors") -> str | None:
    """The floating dtype (torch's name) holding most of the elements of `folder`'s
    safetensors files; None without any. IncompatibleCheckpoint for a header that does not parse."""
    counts: Counter[str] = Counter()
    for path in sorted(folder.glob(pattern)):
        for dtype, shape in safetensors_header(path).values():
            if dtype in FLOATS:
                counts[FLOATS[dtype]] += math.prod(shape)
    return counts.most_common(1)[0][0] if counts else None


def config_dtype(folder: Path) -> str | None:
    """config.json's `dtype` (or `torch_dtype`), when it names a dtype."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if isinstance(value, str) and (name := value.removeprefix("torch.")) in FLOATS.values():
            return name
    return None


def folder_dtype(folder: Path) -> str | None:
    """The dtype an engine serves `folder` in when left to the folder (config.json's, else
    the weights'); None when neither says, or the headers do not parse."""
    try:
        return config_dtype(folder) or weights_dtype(folder)
    except (IncompatibleCheckpoint, OSError):
        return None
