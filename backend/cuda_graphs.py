"""Decode-only steps replayed from CUDA graphs (DEVICE=cuda; CUDA_GRAPHS=0 turns them off).

On a GPU a decode step is bound by the host launching a few hundred small kernels one at a time, not by the
GPU (an H100 reads a 1.7B model's bfloat16 weights in ~1 ms). A CUDA graph records one step's kernels once and
replays them with a single launch. The step recorded is the model's own op-by-op forward (LlamaModel's
hidden_states, final norm, LM head over every row): the same code as an eager step, on static buffers.

A graph has fixed shapes, so a step is padded: its rows up to the next of ROW_BUCKETS, each row's block table
up to the next power of two of blocks. A padding row repeats row 0 entirely (token, position, KV slot, blocks),
so it computes row 0's keys and values again and writes the same numbers to the same slot: no slot of another
sequence is touched and no spare block is needed. Graphs are captured lazily, the first time a (rows, blocks)
shape is met, into one memory pool shared by all of them (steps never overlap), and kept for the model's
life. `capture` is injectable: tests run the same padding on the CPU with an eager stand-in."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
import torch

from backend.attention import KVCache

log = logging.getLogger("kvyard.backend")

# Padded row counts (vLLM pads alike): a step of B rows runs the graph of the smallest bucket >= B.
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
# Block tables longer than this (8192 tokens at 16 a block) run eagerly: a graph keeps its step's gathered keys
# and values in the shared pool for good, and one for a rare very long row is not worth holding.
MAX_GRAPH_BLOCKS = 512

# (cache, ids, positions, slots, block tables, key counts) → logits of every row
Step = Callable[[KVCache, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def cuda_capture(pool: object) -> Capture:
    """Records fn once as a CUDA graph (after one eager warm-up on a side stream, which creates what a kernel
    creates lazily: cuBLAS handles, workspaces) and returns a replay that reruns it and gives its output."""
    side = torch.cuda.Stream()  # one for every warm-up: what a warm-up frees is cached for the next

    def capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay
    return capture


@dataclass
class _Graph:
    ids: torch.Tensor      # [Bp] static inputs, padded
    positions: torch.Tensor
    slots: torch.Tensor
    blocks: torch.Tensor   # [Bp, Np]
    lens: torch.Tensor
    replay: Callable[[], torch.Tensor]  # → logits [Bp, V]


class GraphedDecoder:
    """Runs decode-only steps of up to max_rows rows through graphs of `step`, one graph per padded shape and
    KV cache storage (a graph has its address baked in)."""

    def __init__(self, step: Step, device: torch.device, max_rows: int = ROW_BUCKETS[-1],
                 capture: Capture | None = None, max_blocks: int = MAX_GRAPH_BLOCKS) -> None:
        self.step = step
        self.device = device
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        self._capture = capture
        self._graphs: dict[tuple[int, ...], _Graph] = {}
        self.enabled = True  # False once a capture failed: every step then runs eagerly (logged once)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def takes(self, rows: int, blocks: int) -> bool:
        """Whether a decode-only step of this many rows and block-table columns replays a graph."""
        return self.enabled and rows <= self.max_rows and blocks <= self.max_blocks

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor,
            lens: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
        """Logits [B, V] of the step's rows, or None where the step could not be captured (the caller then
        runs it eagerly; graphs stay off from then on)."""
        rows, nblk = ids.shape[0], blocks.shape[1]
        padded_rows = next(b for b in ROW_BUCKETS if b >= rows)
        padded_blocks = 1 << max(0, nblk - 1).bit_length()
        key = (padded_rows, padded_blocks, cache.data.data_ptr(), *cache.data.shape)
        graph = self._graphs.get(key)
        fresh = graph is None
        if fresh:
            graph = self._buffers(padded_rows, padded_blocks)
        _fill(graph, ids, positions, slots, blocks, lens)
        if fresh:
            try:
                graph.replay = self._capturer()(lambda: self.step(cache, graph.ids, graph.positions, graph.slots,
                                                                  graph.blocks, graph.lens))
            except Exception:  # noqa: BLE001 - any capture failure: serve eagerly rather than fail requests
                log.exception("CUDA graph capture failed for %d rows x %d blocks: decode steps run eagerly",
                              padded_rows, padded_blocks)
                self.enabled = False
                return None
            self._graphs[key] = graph
            log.debug("captured a decode graph: %d rows, %d blocks (%d graphs)", padded_rows, padded_blocks,
                      len(self._graphs))
        return graph.replay()[:rows]

    def _capturer(self) -> Capture:
        if self._capture is None:
            self._capture = cuda_capture(torch.cuda.graph_pool_handle())
        return self._capture

    def _buffers(self, rows: int, nblk: int) -> _Graph:
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=self.device)
        return _Graph(longs(rows), longs(rows), longs(rows), longs(rows, nblk), longs(rows), _unset)


def _fill(g: _Graph, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, blocks: torch.Tensor,
          lens: torch.Tensor) -> None:
    """The step's rows into the static inputs; padding rows repeat row 0. Block columns past a row's own stay
    what they were (zeros, or an earlier step's valid ids): its key count masks them."""
    rows, nblk = blocks.shape
    for static, real in ((g.ids, ids), (g.positions, positions), (g.slots, slots), (g.lens, lens)):
        static[:rows].copy_(real)
        static[rows:].copy_(real[:1].expand(static.shape[0] - rows))
    g.blocks[:rows, :nblk].copy_(blocks)
    g.blocks[rows:, :nblk].copy_(blocks[:1].expand(g.blocks.shape[0] - rows, nblk))


def _unset() -> torch.Tensor:
    raise RuntimeError("graph not captured")
