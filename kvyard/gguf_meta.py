"""GGUF metadata (key/value fields) as plain Python values, shared by the tokenizer and the config loader."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf


@lru_cache(maxsize=4)
def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key/value fields of a GGUF file (strings decoded, arrays as lists). Tensors are not read."""
    reader = gguf.GGUFReader(str(path), "r")
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        meta[name] = field.contents()
    return meta
