"""LoRA adapters at serving time: the backend's set of loaded adapters, and one step's rows grouped by adapter.

A request names an adapter; the engine resolves the name here when the request arrives and every sequence
of it holds the LoraAdapter (a feature of the sequence) with the adapter's cache key mixed into its block
keys. Unloading removes the name only: sequences already running finish with the weights they hold, new
requests naming it are refused with MODEL_NOT_FOUND.

In a step, LoraBatch adds each adapter's low-rank product beside the base projections for the rows of the
sequences that use it (grouped: one pair of small GEMMs per adapter and projection, whatever the number of
its rows); rows without an adapter get nothing added."""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.lora_weights import AdapterError, LoraAdapter, load_adapter
from kvyard.errors import ErrorCode, RequestError
from kvyard.model_config import ModelConfig

log = logging.getLogger("kvyard.lora")


@dataclass(frozen=True)
class AdapterInfo:
    """What /v1/models and the load report say about one loaded adapter."""
    name: str
    path: str
    rank: int
    created: int  # unix time it was loaded


class LoraRegistry:
    """The adapters a backend holds, by name. Any thread: loads read files off the engine thread and then
    swap the name in under a lock; the engine resolves names under the same lock."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, max_adapters: int = 0,
                 allowed_root: Path | None = None) -> None:
        """max_adapters: at most this many held (0: no bound); loading one more evicts the least recently
        used. allowed_root: when set, adapter paths must lie under it."""
        self.config, self.dtype, self.device = config, dtype, device
        self.max_adapters = max_adapters
        self.allowed_root = allowed_root.resolve() if allowed_root is not None else None
        self._lock = threading.Lock()
        self._adapters: OrderedDict[str, tuple[LoraAdapter, int]] = OrderedDict()  # name → (adapter, created)

    def load(self, name: str, path: str, start_up: bool = False) -> AdapterInfo:
        """Reads the adapter (raises AdapterError) and serves it under `name`, replacing one of that name.
        start_up: the operator's LORA_MODULES, which may lie outside LORA_ROOT."""
        if not name or name.strip() != name or "/" in name:
            raise AdapterError(f"adapter name {name!r}: give a non-empty name without spaces at its ends or '/'")
        where = self._check_path(path, start_up)
        t0 = time.monotonic()
        adapter = load_adapter(name, where, self.config, self.dtype, self.device)
        created = int(time.time())
        with self._lock:
            self._adapters.pop(name, None)
            self._adapters[name] = (adapter, created)
            evicted = []
            while self.max_adapters and len(self._adapters) > self.max_adapters:
                evicted.append(self._adapters.popitem(last=False)[0])
        log.info("LoRA adapter %r loaded from %s: rank %d on %s, %.1f MB, %.0f ms%s", name, where, adapter.rank,
                 ",".join(adapter.targets), adapter.nbytes() / 2**20, (time.monotonic() - t0) * 1e3,
                 f"; evicted {evicted} (least recently used)" if evicted else "")
        return AdapterInfo(name, str(where), adapter.rank, created)

    def unload(self, name: str) -> None:
        """Raises RequestError(MODEL_NOT_FOUND) when no adapter has that name."""
        with self._lock:
            if self._adapters.pop(name, None) is None:
                raise _not_found(name)
        log.info("LoRA adapter %r unloaded (requests already running with it finish)", name)

    def resolve(self, name: str) -> LoraAdapter:
        """The adapter a request names (marked recently used); RequestError(MODEL_NOT_FOUND) if none."""
        with self._lock:
            held = self._adapters.get(name)
            if held is None:
                raise _not_found(name)
            self._adapters.move_to_end(name)
            return held[0]

    def infos(self) -> list[AdapterInfo]:
        with self._lock:
            return [AdapterInfo(n, a.path, a.rank, c) for n, (a, c) in self._adapters.items()]

    def names(self) -> list[str]:
        with self._lock:
            return list(self._adapters)

    def _check_path(self, path: str, start_up: bool) -> Path:
        if not path or "://" in path:
            raise AdapterError(f"adapter path {path!r}: give a local directory (remote paths are not fetched)")
        where = Path(path).expanduser().resolve()
        if not start_up and self.allowed_root is not None and not where.is_relative_to(self.allowed_root):
            raise AdapterError(f"adapter path {path!r} is outside LORA_ROOT ({self.allowed_root})")
        if not where.is_dir():
            raise AdapterError(f"adapter path {path!r} is not a directory")
        return where


def _not_found(name: str) -> RequestError:
    return RequestError(ErrorCode.MODEL_NOT_FOUND, f"the LoRA adapter {name!r} is not loaded on this backend",
                        "model")


class LoraBatch:
    """One step's rows grouped by adapter: (adapter, its rows in the flat batch, or None for every row)."""

    def __init__(self, groups: list[tuple[LoraAdapter, torch.Tensor | None]]) -> None:
        self.groups = groups

    @staticmethod
    def of(adapters: Sequence[LoraAdapter | None], spans: Sequence[tuple[int, int]],
           device: torch.device) -> LoraBatch | None:
        """adapters[i] serves flat rows spans[i] = (first, end); None when no row uses an adapter."""
        by_uid: dict[int, tuple[LoraAdapter, list[int]]] = {}
        total = spans[-1][1] if spans else 0
        for adapter, (a, b) in zip(adapters, spans):
            if adapter is not None:
                by_uid.setdefault(adapter.uid, (adapter, []))[1].extend(range(a, b))
        if not by_uid:
            return None
        groups: list[tuple[LoraAdapter, torch.Tensor | None]] = []
        for adapter, rows in by_uid.values():
            whole = len(rows) == total
            groups.append((adapter, None if whole else torch.tensor(rows, dtype=torch.long, device=device)))
        return LoraBatch(groups)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, target: str) -> torch.Tensor:
        """y [T, out] += each group's (x @ A^T) @ B^T on its rows, for the adapters that adapt `target` of
        `layer`; returns y (changed in place)."""
        for adapter, rows in self.groups:
            ab = adapter.mats.get((layer, target))
            if ab is None:
                continue
            a, b = ab
            if rows is None:
                y.addmm_(x @ a.t(), b.t())
            else:
                y.index_add_(0, rows, (x[rows] @ a.t()) @ b.t())
        return y


def adapter_error(exc: AdapterError) -> RequestError:
    return RequestError(ErrorCode.INVALID_ARGUMENT, str(exc), "lora_path")
