"""DistilBERT (msmarco-distilbert, distiluse-base-multilingual with its Dense projection,
distilbert-*-finetuned classifiers): BERT's post-norm layers under DistilBERT's own names, no segment embeddings,
and its classifier's ReLU pre-classifier over [CLS] — against sentence-transformers and transformers on the same
random weights, served."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from torch import nn

from backend.encoder import EncoderModel
from backend.engine_types import PoolTask
from backend.pooling import run_task
from kvyard.pooling_model import ModelKind, load_pooling_spec, model_kind
from kvyard.tokenizer import pooling_tokenizer
from tests.backend.test_encoder import _batch, _values
from tests.backend.test_gguf_encoder import TEXTS, _embeds_as_sentence_transformers
from tests.backend.test_st_dense import add_dense
from tests.support.procs import pdfusion
from tests.support.tiny_encoders import tiny_encoder

pytestmark = pytest.mark.slow
QUERY = "what is the capital of france?"


def test_embeds_as_sentence_transformers(tmp_path: Path) -> None:
    """distiluse-base-multilingual's shape: mean pooling, then a tanh Dense projection to another width."""
    from sentence_transformers.sentence_transformer.modules import Dense
    hf = tiny_encoder(tmp_path / "distiluse-tiny", arch="DistilBertModel", normalize=False)
    add_dense(hf, [Dense(32, 24, activation_function=nn.Tanh())])
    spec = load_pooling_spec(hf)
    assert (model_kind(hf), spec.model_type, spec.pooling, spec.dimensions) == (ModelKind.EMBED, "distilbert", "mean", 24)
    _embeds_as_sentence_transformers(hf, hf, TEXTS, served="distiluse-tiny")


@pytest.mark.parametrize("num_labels", [1, 2])
def test_a_classifier_scores_as_transformers(tmp_path: Path, num_labels: int) -> None:
    import transformers
    hf = tiny_encoder(tmp_path / "ce", arch="DistilBertForSequenceClassification", num_labels=num_labels)
    spec = load_pooling_spec(hf)
    assert (spec.kind, len(spec.labels)) == (ModelKind.CLASSIFY, num_labels)
    pairs = [(QUERY, t) for t in TEXTS[:5]]
    ids, types, mask = _batch(pooling_tokenizer(hf), [q for q, _ in pairs], [d for _, d in pairs])
    ours = _values(run_task(EncoderModel(spec, torch.float32, torch.device("cpu")), PoolTask.CLASSIFY, ids, types, mask))
    with torch.no_grad():
        ref = transformers.DistilBertForSequenceClassification.from_pretrained(hf).eval()(
            input_ids=ids, attention_mask=mask.long()).logits
    assert ours.shape == ref.shape and torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    if num_labels == 1:
        with pdfusion(hf, "distilbert-reranker", tmp_path / "pdfusion.log") as url:
            body = httpx.post(f"{url}/v1/rerank", json={"query": QUERY, "documents": TEXTS[:5]}, timeout=60).json()
            got = {r["index"]: r["relevance_score"] for r in body["results"]}
            assert max(abs(got[i] - float(torch.sigmoid(ref[i, 0]))) for i in range(5)) < 1e-4
