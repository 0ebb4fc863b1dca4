"""One engine step on the device: scheduled chunks → flat tensors → model forward → logits of the rows asked."""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol, Sequence, TypeVar

import torch

from backend.attention import AttentionMetadata, KVCache, PrefillSpan
from backend.lora import LoraBatch, LoraStacks
from backend.lora_weights import LoraAdapter
from backend.model import LlamaModel
from backend.mrope import MropePositions, StepPositions
from backend.vision_inputs import chunk_embeds

Feature = TypeVar("Feature")


class ChunkSeq(Protocol):
    token_ids: list[int]    # prompt then output
    block_table: list[int]  # KV block ids in position order

    def feature(self, kind: type[Feature]) -> Feature | None: ...  # e.g. its LoraAdapter


class StepChunk(Protocol):
    """What the runner needs of one scheduled sequence (backend.scheduler.ScheduledSeq fits)."""
    seq: ChunkSeq
    start: int            # first position computed this step
    num_new_tokens: int   # tokens computed this step
    samples: bool         # whether a token is sampled after this chunk


@dataclass
class DirectSeq:
    """A bare sequence for callers that drive the runner without a scheduler (benchmarks, tests)."""
    token_ids: list[int]
    block_table: list[int]
    features: tuple[object, ...] = field(default=())  # e.g. a LoraAdapter

    def feature(self, kind: type[Feature]) -> Feature | None:
        return next((f for f in self.features if isinstance(f, kind)), None)


@dataclass
class DirectChunk:
    """A StepChunk built by hand: compute seq.token_ids[start:start + num_new_tokens]."""
    seq: DirectSeq
    start: int
    num_new_tokens: int
    samples: bool = True


@dataclass
class StepTensors:
    input_ids: torch.Tensor   # [T]
    positions: torch.Tensor   # [T]
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [R] flat rows whose logits are computed, in chunk order
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # rows [M] given embeddings [M, D] (images)
    lora: LoraBatch | None = None  # rows grouped by LoRA adapter; None: no row uses one
    mrope: torch.Tensor | None = None  # [3, T] Qwen-VL (t, h, w) rotary positions when a row is an image token


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = model.device
        self.lora_stacks = LoraStacks()  # adapters' matrices stacked per step's set (backend/lora.py)

    def run(self, chunks: Sequence[StepChunk], logit_rows: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """Logits [R, V] (float32) for the requested chunk-relative rows, chunk by chunk in order.
        By default one row per chunk with samples=True: its last."""
        if logit_rows is None:
            logit_rows = [[c.num_new_tokens - 1] if c.samples else [] for c in chunks]
        t = self.prepare(chunks, logit_rows)
        return self.model.forward(t.input_ids, t.positions, self.cache, t.meta, t.logits_rows, t.embeds, t.lora, t.mrope)

    def prepare(self, chunks: Sequence[StepChunk], logit_rows: Sequence[Sequence[int]]) -> StepTensors:
        bs = self.cache.block_size
        ids: list[int] = []
        positions = StepPositions()  # rotary positions: the index, unless M-RoPE shifts it (backend/mrope.py)
        slots: list[int] = []
        logits_rows: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[Sequence[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        image_rows: list[int] = []
        image_values: list[torch.Tensor] = []
        adapters: list[LoraAdapter | None] = []
        for chunk, rows in zip(chunks, logit_rows):
            row0, start, n = len(ids), chunk.start, chunk.num_new_tokens
            adapters.append(chunk.seq.feature(LoraAdapter))
            for offset, values in chunk_embeds(chunk.seq, start, n):
                image_rows.extend(range(row0 + offset, row0 + offset + values.shape[0]))
                image_values.append(values)
            table = chunk.seq.block_table
            ids.extend(chunk.seq.token_ids[start:start + n])
            positions.add(chunk.seq.feature(MropePositions), start, n)
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                decode_rows.append(row0)
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                used = (start + n + bs - 1) // bs
                prefills.append(PrefillSpan(rows=slice(row0, row0 + n), key_blocks=self._tensor(list(table[:used])),
                                            num_keys=start + n, start=start))
            logits_rows.extend(row0 + r for r in rows)

        meta = AttentionMetadata(slot_mapping=self._tensor(slots), decode_rows=None, decode_blocks=None,
                                 decode_lens=None, prefills=prefills)
        if decode_rows:
            max_blocks = max((n + bs - 1) // bs for n in decode_lens)
            table = torch.zeros(len(decode_rows), max_blocks, dtype=torch.long)
            for r, (tbl, n) in enumerate(zip(decode_tables, decode_lens)):
                used = (n + bs - 1) // bs
                table[r, :used] = torch.tensor(tbl[:used], dtype=torch.long)
            meta.decode_rows = self._tensor(decode_rows)
            meta.decode_blocks = table.to(self.device)
            meta.decode_lens = self._tensor(decode_lens)
        embeds = (self._tensor(image_rows), torch.cat(image_values)) if image_values else None
        lora = None
        if any(a is not None for a in adapters):
            ends = list(accumulate(c.num_new_tokens for c in chunks))
            lora = LoraBatch.of(adapters, list(zip([0, *ends[:-1]], ends)), self.lora_stacks, self.device)
        return StepTensors(self._tensor(ids), self._tensor(positions.flat), meta, self._tensor(logits_rows), embeds, lora,
                           positions.mrope(self.device))

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
