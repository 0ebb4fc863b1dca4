"""RoBERTa and CamemBERT directories (all-distilroberta-v1, the stsb/nli-roberta cross-encoders, sentence-camembert):
XLM-R's architecture under other names — positions after the padding index, one segment type, the classifier's
dense + out_proj head — against sentence-transformers and transformers on the same random weights, served."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from backend.encoder import EncoderModel
from backend.engine_types import PoolTask
from backend.pooling import run_task
from kvyard.pooling_model import ModelKind, load_pooling_spec, model_kind
from kvyard.tokenizer import pooling_tokenizer
from tests.backend.test_encoder import _batch, _values
from tests.backend.test_gguf_encoder import TEXTS, _embeds_as_sentence_transformers
from tests.support.procs import pdfusion
from tests.support.tiny_encoders import tiny_encoder

pytestmark = pytest.mark.slow
QUERY = "what is the capital of france?"


@pytest.mark.parametrize("arch", ["RobertaModel", "CamembertModel"])
def test_embeds_as_sentence_transformers(tmp_path: Path, arch: str) -> None:
    hf = tiny_encoder(tmp_path / arch, arch=arch, unigram=True)
    spec = load_pooling_spec(hf)
    assert (model_kind(hf), spec.kind, spec.max_len) == (ModelKind.EMBED, ModelKind.EMBED, 256)  # 258 less pad + 1
    _embeds_as_sentence_transformers(hf, hf, TEXTS, served="roberta-tiny" if arch == "RobertaModel" else None)


@pytest.mark.parametrize("arch, num_labels", [("RobertaForSequenceClassification", 1),
                                              ("CamembertForSequenceClassification", 3)])
def test_a_cross_encoder_scores_as_transformers(tmp_path: Path, arch: str, num_labels: int) -> None:
    import transformers
    hf = tiny_encoder(tmp_path / "ce", arch=arch, num_labels=num_labels, unigram=True)
    spec = load_pooling_spec(hf)
    assert (spec.kind, len(spec.labels)) == (ModelKind.CLASSIFY, num_labels)
    pairs = [(QUERY, t) for t in TEXTS[:5]]
    ids, types, mask = _batch(pooling_tokenizer(hf), [q for q, _ in pairs], [d for _, d in pairs])
    ours = _values(run_task(EncoderModel(spec, torch.float32, torch.device("cpu")), PoolTask.CLASSIFY, ids, types, mask))
    with torch.no_grad():
        ref = getattr(transformers, arch).from_pretrained(hf).eval()(input_ids=ids, attention_mask=mask.long()).logits
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    if num_labels == 1:
        with pdfusion(hf, "roberta-ce", tmp_path / "pdfusion.log") as url:
            body = httpx.post(f"{url}/v1/rerank", json={"query": QUERY, "documents": TEXTS[:5]}, timeout=60).json()
            got = {r["index"]: r["relevance_score"] for r in body["results"]}
            assert max(abs(got[i] - float(torch.sigmoid(ref[i, 0]))) for i in range(5)) < 1e-4
