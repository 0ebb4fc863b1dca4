"""A ModernBERT cross-encoder (ModernBertForSequenceClassification: gte-reranker-modernbert's kind): the encoder's
last hidden states pooled at [CLS] or averaged over the real tokens (`classifier_pooling`), then its `head` (a
dense layer, `classifier_activation`, a norm) and `classifier` — against transformers' own on the same random
weights, and served on /v1/rerank and /v1/classifier."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from backend.encoder import EncoderModel
from backend.engine_types import PoolTask
from backend.pooling import run_task
from kvyard.model_path import ModelFileError
from kvyard.pooling_model import ModelKind, load_pooling_spec, model_kind
from kvyard.tokenizer import pooling_tokenizer
from tests.backend.test_encoder import _batch, _values
from tests.support.procs import pdfusion
from tests.support.tiny_encoders import tiny_encoder

pytestmark = pytest.mark.slow
QUERY = "what is the capital of france?"
# Short and long documents: pairs past the 4-position window of the local layers, and padding in every batch.
DOCS = ["Paris is the capital of France.", "Berlin.", "The quick brown fox jumps over the lazy dog, twice over, "
        "and then once more for the window's sake.", "x=3.14, y=[1,2]; z?", "Café naïve résumé"]
LABELS = {0: "neg", 1: "neutral", 2: "pos"}


def _reference(hf: Path, pairs: list[tuple[str, str]]) -> torch.Tensor:
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    batch = tok([q for q, _ in pairs], [d for _, d in pairs], padding=True, return_tensors="pt")
    with torch.no_grad():
        model = transformers.ModernBertForSequenceClassification.from_pretrained(hf).eval()
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@pytest.mark.parametrize("pooling, num_labels, act", [("cls", 1, "gelu"), ("mean", 3, "gelu"), ("mean", 1, "silu")])
def test_scores_pairs_as_transformers(tmp_path: Path, pooling: str, num_labels: int, act: str) -> None:
    hf = tiny_encoder(tmp_path / "ce", arch="ModernBertForSequenceClassification", num_labels=num_labels,
                      id2label=LABELS if num_labels == 3 else None, classifier_pooling=pooling)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "classifier_activation": act}))
    spec = load_pooling_spec(hf)
    assert (model_kind(hf), spec.kind, spec.model_type, spec.labels) == \
        (ModelKind.CLASSIFY, ModelKind.CLASSIFY, "modernbert", tuple(LABELS.values()) if num_labels == 3 else ("LABEL_0",))
    pairs = [(QUERY, d) for d in DOCS]
    ids, types, mask = _batch(pooling_tokenizer(hf), [q for q, _ in pairs], [d for _, d in pairs])
    assert not mask.all() and mask.sum(dim=1).max() > 8  # padded, and longer than the local layers' window
    ours = _values(run_task(EncoderModel(spec, torch.float32, torch.device("cpu")), PoolTask.CLASSIFY, ids, types, mask))
    ref = _reference(hf, pairs)
    assert ours.shape == ref.shape == (len(DOCS), num_labels)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_a_head_it_does_not_run_is_refused(tmp_path: Path) -> None:
    hf = tiny_encoder(tmp_path / "ce", arch="ModernBertForSequenceClassification")
    cfg = json.loads((hf / "config.json").read_text())
    for key, value in (("classifier_pooling", "max"), ("classifier_activation", "mish")):
        (hf / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ModelFileError, match=key):
            load_pooling_spec(hf)


def test_served_on_rerank_and_classifier(tmp_path: Path) -> None:
    hf = tiny_encoder(tmp_path / "rerank", arch="ModernBertForSequenceClassification", num_labels=3, id2label=LABELS,
                      classifier_pooling="mean")
    one = tiny_encoder(tmp_path / "rerank1", arch="ModernBertForSequenceClassification", num_labels=1)
    with pdfusion(one, "modernbert-reranker", tmp_path / "one.log") as url:
        expected = torch.sigmoid(_reference(one, [(QUERY, d) for d in DOCS])[:, 0])
        body = httpx.post(f"{url}/v1/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 3}, timeout=60).json()
        assert [r["index"] for r in body["results"]] == expected.argsort(descending=True)[:3].tolist()
        assert all(abs(r["relevance_score"] - float(expected[r["index"]])) < 1e-4 for r in body["results"])
        bad = httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, timeout=60)
        assert bad.status_code == 400 and "classify" in bad.json()["error"]["message"]
    with pdfusion(hf, "modernbert-classifier", tmp_path / "three.log") as url:
        probs = torch.softmax(_reference(hf, [(QUERY, DOCS[0]), (QUERY, DOCS[2])]), dim=-1)
        body = httpx.post(f"{url}/v1/classifier", json={"input": [[QUERY, DOCS[0]], [QUERY, DOCS[2]]]}, timeout=60).json()
        for i, item in enumerate(body["data"]):
            assert item["labels"] == list(LABELS.values()) and item["label"] == LABELS[int(probs[i].argmax())]
            assert max(abs(a - b) for a, b in zip(item["probs"], probs[i].tolist())) < 1e-4
