"""A decoder (backend/model.py's LlamaModel: Llama, Mistral, Qwen2, Qwen3) as a pooling model, for
Qwen3-Embedding-style embedders (last-token pooling; from a directory or a GGUF) and *ForSequenceClassification
scorers. The pooling engine drives it as it drives backend/encoder.py's EncoderModel (forward → hidden
states [B, T, D], then backend/pooling.py), over the decoder's own weights loader, layers and step tensors
(ModelRunner.prepare).

Each input is one causal prefill starting at position 0 on a scratch KV cache whose layers all share one
buffer (a layer's keys are read only within that layer), so a step holds one layer's K/V, not a cache."""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from backend.attention import KVCache
from backend.model import LlamaModel
from backend.ops import TorchOps, Weight
from backend.model_runner import DirectChunk, DirectSeq, ModelRunner
from backend.st_dense import dense_bytes, load_dense
from backend.weights import load_weights
from kvyard.model_config import load_model_config
from kvyard.model_path import ModelFileError, is_gguf
from kvyard.pooling_model import ModelKind, PoolingSpec

BLOCK_SIZE = 16


@dataclass(frozen=True)
class DecoderPoolingConfig:
    """What the pooling engine reads of a model's config (as EncoderConfig's)."""
    vocab_size: int
    type_vocab_size: int = 1  # no segment ids: a pair is one causal sequence


class _SharedLayerCache(KVCache):
    """A KVCache whose every layer is the same [2, slots, Hkv, d] buffer (a stride-0 layer dimension)."""

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.block_size = BLOCK_SIZE
        self.num_blocks = num_blocks
        one = torch.empty((1, 2, num_blocks * BLOCK_SIZE, num_kv_heads, head_dim), dtype=dtype, device=device)
        self.data = one.expand(num_layers, -1, -1, -1, -1)
        self._scratch = {}


class DecoderPoolingModel:
    def __init__(self, spec: PoolingSpec, dtype: torch.dtype, device: torch.device,
                 weights: dict[str, Weight] | None = None, ops: TorchOps | None = None) -> None:
        """weights, ops: as the backend loads a chat model's (a GGUF's blocks with the C++ kernels); by default
        dense in `dtype`."""
        self.spec = spec
        config = load_model_config(spec.path)
        weights = load_weights(spec.path, config, dtype, device) if weights is None else weights
        if spec.score_from_tokens:
            weights["score"] = _score_from_lm_head(weights, spec)
        elif spec.two_way and isinstance(rows := weights.get("score"), torch.Tensor):  # a rank GGUF's [yes, no]
            weights["score"] = (rows[:1].float() - rows[1:2].float()).to(rows.dtype).contiguous()  # rows: yes - no
        if spec.kind is ModelKind.CLASSIFY and "score" not in weights:
            raise ModelFileError(f"{spec.path}: a sequence classifier without its `score.weight`")
        self.llama = LlamaModel(config, weights, ops=ops, max_positions=spec.max_len, cuda_graphs=False)  # no decode steps
        self.cfg = DecoderPoolingConfig(config.vocab_size)
        self.dense = load_dense(spec.dense, dtype, device)
        self.device, self.dtype = self.llama.device, self.llama.dtype
        pad = None if is_gguf(spec.path) else json.loads((spec.path / "config.json").read_text()).get("pad_token_id")
        self.pad_token_id: int | None = pad if isinstance(pad, int) else None  # classify only (never a GGUF)
        self._cache: _SharedLayerCache | None = None

    def weight_bytes(self) -> int:
        return self.llama.weight_bytes() + dense_bytes(self.dense)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, type_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids [B, T], mask [B, T] bool (padding on the right; type_ids unused) → the final-normed hidden
        states [B, T, D] (zeros at padding), as transformers' base model outputs them."""
        lengths = mask.sum(dim=1).tolist()
        chunks, first = [], 0
        for row, n in zip(ids.tolist(), lengths):
            blocks = -(-n // BLOCK_SIZE)
            chunks.append(DirectChunk(DirectSeq(row[:n], list(range(first, first + blocks))), 0, n))
            first += blocks
        cache = self._scratch(first)
        t = ModelRunner(self.llama, cache).prepare(chunks, [[] for _ in chunks])
        llama = self.llama
        x = llama.hidden_states(t.input_ids, t.positions, cache, t.meta)          # [N, D]: the real tokens
        x = llama.ops.rms_norm(x, llama.w["norm"], llama.config.rms_norm_eps)
        out = x.new_zeros((*ids.shape, x.shape[-1]))
        out[mask] = x
        return out

    def classify(self, hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`score` over each input's last token that is not the pad token (transformers' rule) → [B, labels]."""
        real = mask if self.pad_token_id is None else mask & (ids != self.pad_token_id)
        last = (torch.arange(ids.shape[1], device=ids.device) * real).argmax(dim=-1)   # [B]
        score = self.llama.w["score"]
        assert isinstance(score, torch.Tensor)
        return F.linear(hidden[torch.arange(ids.shape[0], device=ids.device), last], score)

    def _scratch(self, num_blocks: int) -> _SharedLayerCache:
        """Kept across steps, grown (doubling) when a step needs more blocks."""
        if self._cache is None or self._cache.num_blocks < num_blocks:
            c = self.llama.config
            grown = max(num_blocks, 2 * (self._cache.num_blocks if self._cache else 0))
            self._cache = _SharedLayerCache(c.num_layers, grown, c.num_kv_heads, c.head_dim, self.dtype, self.device)
        return self._cache


def _score_from_lm_head(weights: dict[str, torch.Tensor], spec: PoolingSpec) -> torch.Tensor:
    """The LM head's rows for spec.score_from_tokens as a `score` head (the LM head itself is then dropped):
    two-way, one row, yes minus no, so sigmoid(score) is softmax([no, yes])[yes] (vLLM's from_2_way_softmax)."""
    head = weights.pop("lm_head", None)
    rows = (head if head is not None else weights["embed"])[list(spec.score_from_tokens)].float()
    return (rows[1:] - rows[:1] if spec.two_way else rows).to(weights["embed"].dtype).contiguous()
