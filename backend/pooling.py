"""Pooling: a padded batch's hidden states → one answer per input (the pooling engine's postprocess)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backend.decoder_pooling import DecoderPoolingModel
from backend.encoder import EncoderModel
from backend.engine_types import Pooled, PoolTask
from backend.st_dense import apply_dense


def pool(hidden: torch.Tensor, mask: torch.Tensor, method: str) -> torch.Tensor:
    """hidden: [B, T, D]; mask: [B, T] bool, padding on the right → [B, D] (sentence-transformers' modes)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)                        # [B, T, 1]
    lengths = mask.sum(dim=1)                                      # [B]
    if method == "cls":
        return hidden[:, 0]
    if method == "last":
        return hidden[torch.arange(hidden.shape[0]), lengths - 1]
    if method == "max":
        return hidden.masked_fill(~mask.unsqueeze(-1), torch.finfo(hidden.dtype).min).amax(dim=1)
    summed = (hidden * m).sum(dim=1)                               # [B, D]
    count = lengths.clamp(min=1).unsqueeze(-1).to(hidden.dtype)    # [B, 1]
    if method == "mean":
        return summed / count
    if method == "mean_sqrt_len":
        return summed / count.sqrt()
    raise ValueError(f"unknown pooling method {method!r}")


def run_task(model: EncoderModel | DecoderPoolingModel, task: PoolTask, ids: torch.Tensor, type_ids: torch.Tensor,
             mask: torch.Tensor) -> list[Pooled]:
    """One padded batch through the model and the task's head: ids, type_ids [B, T], mask [B, T]."""
    spec = model.spec
    hidden = model.forward(ids, type_ids, mask)                    # [B, T, D]
    lengths = mask.sum(dim=1).tolist()
    if task is PoolTask.CLASSIFY:
        logits = model.classify(hidden, ids, mask).float()                    # [B, labels]
        return [Pooled(row) for row in logits.tolist()]
    if task is PoolTask.SPARSE:
        weights = model.sparse(hidden).float()                     # [B, T]
        return [_lexical(ids[b, :n].tolist(), weights[b, :n].tolist()) for b, n in enumerate(lengths)]
    if task is PoolTask.COLBERT:
        vecs = model.colbert(hidden).float()                       # [B, T - 1, D']
        return [Pooled(vecs[b, :n - 1].flatten().tolist(), rows=n - 1) for b, n in enumerate(lengths)]
    pooled = apply_dense(model.dense, pool(hidden, mask, spec.pooling))  # [B, D], or the last Dense's [B, D']
    if spec.normalize:
        pooled = F.normalize(pooled, dim=-1)
    return [Pooled(row) for row in pooled.float().tolist()]


def _lexical(ids: list[int], weights: list[float]) -> Pooled:
    """Each token id's largest weight over its occurrences; ids whose weight is 0 are left out (BGE-M3).
    The frontend drops special tokens (it knows the tokenizer)."""
    best: dict[int, float] = {}
    for t, w in zip(ids, weights):
        if w > best.get(t, 0.0):
            best[t] = w
    return Pooled(list(best.values()), list(best.keys()))
