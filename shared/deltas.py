"""Lossless deltas between two versions of a weight file: XOR of the raw bytes, then zstd.

Two consecutive versions of a model differ in the low bits of most numbers and in none
of the others, so the XOR of their files is mostly zero bytes and compresses well, and
XOR-ing it back onto the older file gives the newer one bit for bit. Measured on
SmolLM2-135M after one Adam step at lr 1e-6 (every element moves): fp32, 538 MB -> 136 MB
(25 %); bf16, where most elements round to what they were, 269 MB -> 12 MB (4.5 %).
Grouping the bytes of each number before zstd (a "byte shuffle") was measured too and
saved at most 5 % more (bf16) while costing more time: not used. (`bench/sync.py`
measures the whole hand-off.)

Both directions stream in `CHUNK`-sized blocks, so memory stays flat whatever the size
of the file. Files of different sizes are handled: the older file counts as padded with
zero bytes (or cut) to the newer one's length, which the reader knows from the manifest.

    encode(new, old, out) -> bytes written          (the trainer, before the upload)
    decode(delta, old, out, size)                   (the watcher and evaluator, after the
                                                     download; every sha256 is checked after)

Errors are `DeltaError` (a corrupt or truncated delta, or one that decodes to another
length): the caller treats the version as not verifiable, never as a model.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np
import zstandard

from shared.errors import NextstateError

Codec = Literal["xor-zstd"]
CODECS: tuple[Codec, ...] = ("xor-zstd",)
SUFFIX = ".xor.zst"  # the delta object of `model.safetensors` is `model.safetensors.xor.zst`
CHUNK = 16 * 1024 * 1024
LEVEL = 3  # zstd's default: level 1 was no faster here, 19 far slower for a few % less


class DeltaError(NextstateError):
    """A delta that cannot be decoded into the file it stands for."""


def _read_exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    return data if len(data) == n else data + bytes(n - len(data))  # past the end: zeros


def _xor(block: bytes, base: bytes) -> bytes:
    a = np.frombuffer(block, dtype=np.uint8)
    b = np.frombuffer(base, dtype=np.uint8)
    return np.bitwise_xor(a, b).tobytes()


def encode(new: Path, old: Path, out: Path) -> int:
    """Write the delta of `new` against `old` to `out`; returns its size in bytes."""
    size = new.stat().st_size
    compressor = zstandard.ZstdCompressor(level=LEVEL, write_content_size=False)
    with open(new, "rb") as fn, open(old, "rb") as fo, open(out, "wb") as fd:
        with compressor.stream_writer(fd, size=size, closefd=False) as z:
            done = 0
            while done < size:
                block = fn.read(min(CHUNK, size - done))
                if not block:
                    raise DeltaError(f"{new} shrank while it was encoded")
                z.write(_xor(block, _read_exact(fo, len(block))))
                done += len(block)
    return out.stat().st_size


def decode(delta: Path, old: Path, out: Path, size: int) -> None:
    """Rebuild the file of `size` bytes whose delta against `old` is `delta`, into `out`.

    `DeltaError` when the delta does not decompress or does not hold exactly `size` bytes."""
    decompressor = zstandard.ZstdDecompressor()
    done = 0
    try:
        with open(delta, "rb") as fd, open(old, "rb") as fo, open(out, "wb") as fw:
            with decompressor.stream_reader(fd, read_across_frames=False, closefd=False) as z:
                while True:
                    block = z.read(CHUNK)
                    if not block:
                        break
                    done += len(block)
                    if done > size:
                        raise DeltaError(f"{delta.name} decodes to more than the {size} bytes "
                                         "the manifest says")
                    fw.write(_xor(block, _read_exact(fo, len(block))))
    except zstandard.ZstdError as exc:
        raise DeltaError(f"{delta.name} is not a valid zstd stream: {exc}") from None
    if done != size:
        raise DeltaError(f"{delta.name} decodes to {done} bytes, the manifest says {size}")
