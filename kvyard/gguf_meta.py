"""GGUF metadata (key/value fields) and its tensor directory, read once per file and shared by the
tokenizer, the config loader and the weight loader (which reads tensor bytes itself, range by range)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]   # PyTorch order: [rows, columns] for a matrix (GGUF lists the fastest axis first)
    offset: int              # of its first byte in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFIndex:
    meta: dict[str, Any]                    # key/value fields (strings decoded, arrays as lists)
    tensors: dict[str, GGUFTensorInfo]      # by name, in file order


@lru_cache(maxsize=4)
def read_gguf_index(path: str | Path) -> GGUFIndex:
    """The file's fields and tensor directory. No tensor data is read (the reader maps the file and
    only its header pages are touched)."""
    reader = gguf.GGUFReader(str(path), "r")
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: GGUFTensorInfo(t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape.tolist())),
                                      int(t.data_offset), int(t.n_bytes)) for t in reader.tensors}
    return GGUFIndex(meta, tensors)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value fields of a GGUF file (strings decoded, arrays as lists). Tensors are not read."""
    return read_gguf_index(path).meta


def read_tensor_bytes(fd: int, info: GGUFTensorInfo, start: int = 0, length: int | None = None,
                      out: np.ndarray | None = None) -> np.ndarray:
    """Bytes [start, start + length) of a tensor's data as uint8, read with pread (not through a memory
    map: mapped pages would count as this process's resident memory until unmapped)."""
    length = info.nbytes - start if length is None else length
    buf = np.empty(length, dtype=np.uint8) if out is None else out[:length]
    view, done = memoryview(buf), 0
    while done < length:
        n = os.preadv(fd, [view[done:]], info.offset + start + done)
        if n <= 0:
            raise OSError(f"GGUF tensor {info.name}: the file ends early")
        done += n
    return buf


def read_gguf_vector(path: str | Path, name: str) -> list[float] | None:
    """One small float tensor of the file (e.g. Llama 3.1's `rope_freqs.weight`), or None if absent."""
    info = read_gguf_index(path).tensors.get(name)
    if info is None:
        return None
    fd = os.open(str(path), os.O_RDONLY)
    try:
        raw = read_tensor_bytes(fd, info)
    finally:
        os.close(fd)
    values = gguf.quants.dequantize(raw.reshape(1, -1), info.qtype)
    return [float(v) for v in np.asarray(values, dtype=np.float64).reshape(-1)]
