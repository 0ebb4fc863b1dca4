"""The checks every cross-encoder family's test makes: its logits for query-document pairs against transformers'
own *ForSequenceClassification on the same weights, and /v1/rerank's scores from a served PDFUSION cluster."""
from __future__ import annotations

from pathlib import Path

import httpx
import torch

from backend.encoder import EncoderModel
from backend.engine_types import PoolTask
from backend.pooling import run_task
from kvyard.pooling_model import load_pooling_spec
from kvyard.tokenizer import pooling_tokenizer
from tests.backend.test_encoder import _batch, _values
from tests.support.procs import pdfusion


def assert_scores_as_transformers(hf: Path, arch: str, query: str, docs: list[str], atol: float = 1e-4) -> torch.Tensor:
    """Our logits for (query, doc) pairs, padded in one batch, within atol of transformers' `arch`; returns theirs."""
    import transformers
    ids, types, mask = _batch(pooling_tokenizer(hf), [query] * len(docs), docs)
    ours = _values(run_task(EncoderModel(load_pooling_spec(hf), torch.float32, torch.device("cpu")), PoolTask.CLASSIFY,
                            ids, types, mask))
    with torch.no_grad():
        ref = getattr(transformers, arch).from_pretrained(hf).eval()(input_ids=ids, attention_mask=mask.long()).logits
    assert ours.shape == ref.shape and torch.allclose(ours, ref, atol=atol), (ours - ref).abs().max()
    return ref


def assert_served_rerank(hf: Path, query: str, docs: list[str], ref: torch.Tensor, log: Path) -> None:
    """/v1/rerank's relevance scores: sigmoid of the one-logit reference, within 1e-4."""
    with pdfusion(hf, "reranker", log) as url:
        body = httpx.post(f"{url}/v1/rerank", json={"query": query, "documents": docs}, timeout=60).json()
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert max(abs(got[i] - float(torch.sigmoid(ref[i, 0]))) for i in range(len(docs))) < 1e-4
