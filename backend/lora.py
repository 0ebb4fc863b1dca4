"""LoRA adapters at serving time: the backend's set of loaded adapters, and one step's rows grouped by adapter.

A request names an adapter; the engine resolves the name here when the request arrives and every sequence
of it holds the LoraAdapter (a feature of the sequence) with the adapter's cache key mixed into its block
keys. Unloading removes the name only: sequences already running finish with the weights they hold, new
requests naming it are refused with MODEL_NOT_FOUND.

In a step, LoraBatch adds each adapter's low-rank product beside the base projections for the rows of the
sequences that use it (grouped: one pair of small GEMMs per adapter and projection, whatever the number of
its rows); rows without an adapter get nothing added. A decode-only step hands the adapters and each row's
index to the fused C++ decode step instead (LoraBatch.fused), which adds the same terms row by row."""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        return self.install([self.read(name, path, start_up)])[0]

    def read(self, name: str, path: str, start_up: bool = False) -> LoraAdapter:
        """Reads and checks the adapter (raises AdapterError) without serving it yet (install)."""
        if not name or name.strip() != name or "/" in name:
            raise AdapterError(f"adapter name {name!r}: give a non-empty name without spaces at its ends or '/'")
        return load_adapter(name, self._check_path(path, start_up), self.config, self.dtype, self.device)

    def install(self, adapters: Sequence[LoraAdapter], unload: Sequence[str] = ()) -> list[AdapterInfo]:
        """Serves adapters already read, each under its name (replacing one of that name), and drops the names
        in `unload`, in one step: requests see the set before or after, never half of it (RTP-LLM's /update)."""
        created = int(time.time())
        with self._lock:
            for name in unload:
                self._adapters.pop(name, None)
            for adapter in adapters:
                self._adapters.pop(adapter.name, None)
                self._adapters[adapter.name] = (adapter, created)
            evicted = []
            while self.max_adapters and len(self._adapters) > self.max_adapters:
                evicted.append(self._adapters.popitem(last=False)[0])
        for adapter in adapters:
            log.info("LoRA adapter %r loaded from %s: rank %d on %s, %.1f MB", adapter.name, adapter.path,
                     adapter.rank, ",".join(adapter.targets), adapter.nbytes() / 2**20)
        if unload or evicted:
            log.info("LoRA adapters unloaded: %s%s", list(unload), f"; evicted {evicted} (least recently used)"
                     if evicted else "")
        return [AdapterInfo(a.name, a.path, a.rank, created) for a in adapters]

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

    def resolved_path(self, path: str) -> Path:
        """The directory a path names (what AdapterInfo.path holds); AdapterError for one that cannot be."""
        try:
            return Path(path).expanduser().resolve()
        except (ValueError, RuntimeError):  # a NUL byte; a symlink loop
            raise AdapterError(f"adapter path {path!r} is not a directory") from None

    def _check_path(self, path: str, start_up: bool) -> Path:
        if not path or "://" in path:
            raise AdapterError(f"adapter path {path!r}: give a local directory (remote paths are not fetched)")
        where = self.resolved_path(path)
        if not start_up and self.allowed_root is not None and not where.is_relative_to(self.allowed_root):
            raise AdapterError(f"adapter path {path!r} is outside LORA_ROOT ({self.allowed_root})")
        if not where.is_dir():
            raise AdapterError(f"adapter path {path!r} is not a directory")
        return where


def _not_found(name: str) -> RequestError:
    return RequestError(ErrorCode.MODEL_NOT_FOUND, f"the LoRA adapter {name!r} is not loaded on this backend",
                        "model")


# From this many rows (prefill chunks) a step's LoRA products are grouped by adapter: each adapter's rows
# (a slice, or gathered) through its own A and B, 2-4 operations per adapter and projection. Below it
# (op-by-op decode, dense weights) every row goes through all the step's adapters stacked, then a mask
# keeps its own: 3 operations whatever the number of adapters, but each row pays for all of them (on a
# 640-row prefill with 4 rank-16 adapters the masked products cost 4x the grouped ones' arithmetic).
GROUPED_ROWS = 64


class LoraBatch:
    """One step's rows by adapter. Below GROUPED_ROWS rows, every adapter of the step is stacked per
    projection (cached while the step's set of adapters stays the same, as it does from one decode step to
    the next), so each projection costs three operations: one GEMM of every row into every adapter's rank
    columns, a mask keeping each row's own adapter's columns (none for rows of the base model), one GEMM out.
    From GROUPED_ROWS, each adapter's rows go through its own matrices only."""

    def __init__(self, stack: _Stack, row_owner: torch.Tensor,
                 groups: list[tuple[LoraAdapter, slice | torch.Tensor]] | None = None) -> None:
        self.stack = stack
        self.row_owner = row_owner  # [T]: each row's index into adapters, -1 for the base model
        self.groups = groups  # (adapter, its rows) when grouped
        self._masks: dict[int, torch.Tensor] = {}

    @staticmethod
    def of(adapters: Sequence[LoraAdapter | None], spans: Sequence[tuple[int, int]], stacks: LoraStacks,
           device: torch.device) -> LoraBatch | None:
        """adapters[i] serves flat rows spans[i] = (first, end); None when no row uses an adapter."""
        order: dict[int, int] = {}
        held: list[LoraAdapter] = []
        owner: list[int] = []
        rows: list[list[tuple[int, int]]] = []  # per adapter, its spans
        for adapter, (a, b) in zip(adapters, spans):
            k = -1
            if adapter is not None:
                if adapter.uid not in order:
                    order[adapter.uid] = len(held)
                    held.append(adapter)
                    rows.append([])
                k = order[adapter.uid]
                rows[k].append((a, b))
            owner.extend([k] * (b - a))
        if not held:
            return None
        groups = None
        if len(owner) >= GROUPED_ROWS:
            groups = [(adapter, _rows(its, device)) for adapter, its in zip(held, rows)]
        return LoraBatch(stacks.get(tuple(held)), torch.tensor(owner, dtype=torch.long, device=device), groups)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, target: str) -> torch.Tensor:
        """y [T, out] += each row's adapter's (x @ A^T) @ B^T for `target` of `layer`; returns y (in place)."""
        if self.groups is not None:
            for adapter, rows in self.groups:
                mats = adapter.mats.get((layer, target))
                if mats is None:
                    continue
                a, bt = mats
                if isinstance(rows, slice):
                    y[rows].addmm_(x[rows] @ a.t(), bt)
                else:
                    y.index_add_(0, rows, (x[rows] @ a.t()) @ bt)
            return y
        stacked = self.stack.get(layer, target)
        if stacked is None:
            return y
        a, bt, col_owner = stacked
        mask = self._masks.get(id(col_owner))
        if mask is None:
            mask = (self.row_owner[:, None] == col_owner[None, :]).to(x.dtype)  # [T, R]
            self._masks[id(col_owner)] = mask
        return y.addmm_((x @ a.t()).mul_(mask), bt)

    def fused(self, build: Callable[[LoraAdapter], Any]) -> list[Any]:
        """The step's adapters in the fused decode step's form (build: the ops' fused_lora), in row_owner's
        order; built once per set of adapters."""
        return self.stack.fused(build)


def _rows(spans: list[tuple[int, int]], device: torch.device) -> slice | torch.Tensor:
    """Rows (first, end) spans as a slice when they are one run, else an index tensor."""
    if all(b == a for (_, a), (b, _) in zip(spans, spans[1:])):
        return slice(spans[0][0], spans[-1][1])
    return torch.cat([torch.arange(a, b) for a, b in spans]).to(device)


class _Stack:
    """The step's adapters' matrices side by side, per (layer, projection), built on first use."""

    def __init__(self, adapters: tuple[LoraAdapter, ...]) -> None:
        self.adapters = adapters
        self._mats: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {}
        self._owners: dict[tuple[int, ...], torch.Tensor] = {}  # one tensor per column layout (masks reuse it)
        self._fused: list[Any] | None = None

    def get(self, layer: int, target: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        key = (layer, target)
        if key not in self._mats:
            parts = [(k, ad.mats[key]) for k, ad in enumerate(self.adapters) if key in ad.mats]
            if not parts:
                self._mats[key] = None
            else:
                layout = tuple(k for k, (a, _) in parts for _ in range(a.shape[0]))
                owner = self._owners.get(layout)
                if owner is None:
                    owner = self._owners[layout] = torch.tensor(layout, dtype=torch.long, device=parts[0][1][0].device)
                self._mats[key] = (torch.cat([a for _, (a, _) in parts]).contiguous(),
                                   torch.cat([bt for _, (_, bt) in parts]).contiguous(), owner)
        return self._mats[key]

    def fused(self, build: Callable[[LoraAdapter], Any]) -> list[Any]:
        if self._fused is None:
            self._fused = [build(a) for a in self.adapters]
        return self._fused


class LoraStacks:
    """The stacks of the last few sets of adapters a step held (the model runner keeps one; engine thread)."""

    def __init__(self, kept: int = 2) -> None:
        self.kept = kept  # the batch's current set and one before it (a request joining or leaving flips them)
        self._stacks: OrderedDict[tuple[int, ...], _Stack] = OrderedDict()

    def get(self, adapters: tuple[LoraAdapter, ...]) -> _Stack:
        key = tuple(a.uid for a in adapters)
        stack = self._stacks.get(key)
        if stack is None:
            stack = self._stacks[key] = _Stack(adapters)
            while len(self._stacks) > self.kept:
                self._stacks.popitem(last=False)
        self._stacks.move_to_end(key)
        return stack


def adapter_error(exc: AdapterError) -> RequestError:
    return RequestError(ErrorCode.INVALID_ARGUMENT, str(exc), "lora_path")
