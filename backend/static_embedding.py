"""A sentence-transformers StaticEmbedding model (static-retrieval-mrl-en-v1, static-similarity-mrl-multilingual-v1,
model2vec's potion models in their sentence-transformers layout):
one learned vector per token, no transformer; backend/pooling.py averages the real tokens' vectors (its
EmbeddingBag's mean) and applies the checkpoint's Dense and Normalize modules, as for the other pooling models."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from backend.st_dense import dense_bytes, load_dense
from kvyard.pooling_model import PoolingSpec
from kvyard.st_files import static_embedding


@dataclass(frozen=True)
class StaticConfig:
    vocab_size: int
    type_vocab_size: int = 1  # no segments


class StaticEmbeddingModel:
    def __init__(self, spec: PoolingSpec, dtype: torch.dtype, device: torch.device) -> None:
        folder = static_embedding(spec.path)
        assert folder is not None
        self.spec, self.dtype, self.device = spec, dtype, device
        self.embed = _table(load_file(str(folder / "model.safetensors"))).to(device=device, dtype=dtype)
        self.cfg = StaticConfig(self.embed.shape[0])
        self.dense = load_dense(spec.dense, dtype, device)

    def weight_bytes(self) -> int:
        return self.embed.numel() * self.embed.element_size() + dense_bytes(self.dense)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, type_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, mask [B, T] → each token's vector [B, T, D], zeros at padding (type_ids unused)."""
        return self.embed[ids] * mask.unsqueeze(-1).to(self.dtype)


def _table(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """One row per token id: sentence-transformers' `embedding.weight`, or a model2vec file's `embeddings` picked
    by its `mapping` and scaled by its per-token `weights` (what model2vec averages; sentence-transformers folds
    them the same way)."""
    if "embedding.weight" in weights:
        return weights["embedding.weight"]
    table = weights["embeddings"]
    if "mapping" in weights:
        table = table[weights["mapping"].long()]
    if "weights" in weights:
        table = table.float() * weights["weights"].float()[:, None]
    return table.contiguous()
