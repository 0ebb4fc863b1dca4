"""Hand-off types between the gRPC edge, the engine loop and the engine (no protobuf, no torch)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from backend.sampler import Sample
from kvyard.sampling_params import SamplingParams
from backend.sequence import FinishReason, Sequence, StopConditions
from kvyard.aux_info import AuxInfo
from kvyard.constraint import Constraint

if TYPE_CHECKING:
    import torch

    from backend.constraints import GrammarState
    from backend.lora_weights import LoraAdapter


@dataclass(frozen=True)
class ImageInput:
    """One image of a prompt, in prompt order: the k-th image fills the k-th run of placeholder tokens."""
    digest: bytes                    # SHA-256 of the image file's bytes: the embedding cache's and block keys' key
    pixels: torch.Tensor | None      # [3, S, S] preprocessed (the gRPC edge decodes); None where no tower runs;
                                     # Qwen-VL: its patches [h·w, 3·t·p·p]
    embeds: torch.Tensor | None = None  # [placeholders, D] from a VIT process (VIT_ADDRESSES): no tower runs here
    grid: tuple[int, int, int] | None = None  # Qwen-VL: (t, h, w) patches, which M-RoPE's positions need
    file: bytes | None = None        # the file, where the gRPC edge skipped preprocessing because the tower's
                                     # cache held the digest (the engine preprocesses it if evicted since)


@dataclass
class GenerationRequest:
    """A validated generation request as the engine takes it (built from protobuf in pb_convert.py)."""
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: StopConditions
    n: int = 1                       # sequences sampled from this prompt
    arrival_time: float = field(default_factory=time.monotonic)
    hold_blocks: bool = False        # prefill hand-over: keep the KV after finishing until released
    constraint: Constraint | None = None  # the grammar the output must follow, as asked
    grammar: GrammarState | None = None   # `constraint` compiled (by the gRPC edge, off the engine thread),
                                          # at the place the output starts; each sequence takes a copy
    images: list[ImageInput] = field(default_factory=list)  # a vision model's images, in prompt order
    adapter: LoraAdapter | None = None    # sampling.adapter resolved by Engine.validate (held to the end)


@dataclass(frozen=True)
class KVLayout:
    """One KV block as the hand-over sends it; fixed for the engine's life, so any thread may read it."""
    block_size: int
    dtype: str                      # torch dtype name without "torch.", e.g. "float32"
    block_shape: tuple[int, ...]    # [layers, 2 (K, V), block_size, kv heads, head dim]
    itemsize: int

    @property
    def block_bytes(self) -> int:
        return self.itemsize * math.prod(self.block_shape)


@dataclass
class ImportPlan:
    """Decode side of a hand-over: the sequence is allocated; `need` prompt blocks await their KV."""
    request: GenerationRequest       # prompt_ids = the prompt + the prefill side's first token
    seq: Sequence                    # allocated, holding blocks for the prompt and the first token
    need: list[int]                  # prompt block indices to load, ascending
    skipped: int                     # prompt blocks already held here by key
    num_prompt_blocks: int           # ceil(len(prompt) / block_size)
    joined: bool = False             # set by the engine thread once the sequence runs (then abort frees it)


@dataclass
class ScoreRequest:
    """Log-probabilities of scored_ids after prompt_ids, computed in one prefill."""
    request_id: str
    prompt_ids: list[int]
    scored_ids: list[int]
    top_logprobs: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    n: int = 1                       # one result, so the engine loop counts it like one sequence
    adapter_name: str = ""           # a LoRA adapter to score with ("": the base model)
    adapter: LoraAdapter | None = None  # adapter_name resolved by Engine.validate


@dataclass
class TokenOutput:
    """One sequence's new token in one step."""
    request_id: str
    index: int                            # which of the request's n sequences
    token_id: int
    sample: Sample                        # carries logprobs when asked
    finish_reason: FinishReason | None
    aux: AuxInfo


@dataclass
class ScoreResult:
    """The finished answer to a ScoreRequest: one Sample per scored token, in order."""
    request_id: str
    logprobs: list[Sample]
    aux: AuxInfo
    finish_reason: FinishReason = FinishReason.STOP


@dataclass(frozen=True)
class CacheStatus:
    version: int
    is_diff: bool
    cached_keys: list[int]
    added_keys: list[int]
    removed_keys: list[int]
    block_size: int


class PoolTask(StrEnum):
    """What a PoolingRequest wants of each input (the model's kind decides which it may ask)."""
    EMBED = "embed"        # the pooled vector (normalised when the model's config says so)
    SPARSE = "sparse"      # BGE-M3 lexical weights: token id → weight
    COLBERT = "colbert"    # BGE-M3 multi-vector: one normalised vector per token after the first
    CLASSIFY = "classify"  # a cross-encoder's logits


@dataclass(frozen=True)
class PoolItem:
    """One input of a pooling request, tokenized by the frontend (special tokens included)."""
    token_ids: list[int]
    pair_start: int = 0              # cross-encoder pairs: where the second text starts (its segment id
                                     # is 1 from there on); 0 = one text


@dataclass
class PoolingRequest:
    """Pool each item through the model: embeddings, lexical weights, token vectors or logits."""
    request_id: str
    items: list[PoolItem]
    task: PoolTask
    arrival_time: float = field(default_factory=time.monotonic)
    n: int = 1                       # one result, so the engine loop counts it like one sequence


@dataclass
class Pooled:
    """One item's answer. EMBED/CLASSIFY: values. SPARSE: token_ids and their values. COLBERT: values
    holds `rows` vectors of len(values) / rows each, row-major."""
    values: list[float]
    token_ids: list[int] = field(default_factory=list)
    rows: int = 1


@dataclass
class PoolingResult:
    """The finished answer to a PoolingRequest: one Pooled per item, in order."""
    request_id: str
    outputs: list[Pooled]
    aux: AuxInfo
    finish_reason: FinishReason = FinishReason.STOP
