"""RoBERTa and CamemBERT directories (all-distilroberta-v1, the stsb/nli-roberta cross-encoders, sentence-camembert):
XLM-R's architecture under other names — positions after the padding index, one segment type, the classifier's
dense + out_proj head — against sentence-transformers and transformers on the same random weights (served through
the same path as XLM-R's, which tests/backend/test_gguf_encoder.py and tests/frontend/test_rerank.py serve)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvyard.pooling_model import ModelKind, load_pooling_spec, model_kind
from tests.backend.test_gguf_encoder import TEXTS, _embeds_as_sentence_transformers
from tests.support.cross_encoder_checks import assert_scores_as_transformers
from tests.support.tiny_encoders import tiny_encoder

pytestmark = pytest.mark.slow
QUERY = "what is the capital of france?"


@pytest.mark.parametrize("arch", ["RobertaModel", "CamembertModel"])
def test_embeds_as_sentence_transformers(tmp_path: Path, arch: str) -> None:
    hf = tiny_encoder(tmp_path / arch, arch=arch, unigram=True)
    spec = load_pooling_spec(hf)
    assert (model_kind(hf), spec.kind, spec.max_len) == (ModelKind.EMBED, ModelKind.EMBED, 256)  # 258 less pad + 1
    _embeds_as_sentence_transformers(hf, hf, TEXTS)  # served as XLM-R's are (the same EncoderModel path)


@pytest.mark.parametrize("arch, num_labels", [("RobertaForSequenceClassification", 1),
                                              ("CamembertForSequenceClassification", 3)])
def test_a_cross_encoder_scores_as_transformers(tmp_path: Path, arch: str, num_labels: int) -> None:
    hf = tiny_encoder(tmp_path / "ce", arch=arch, num_labels=num_labels, unigram=True)
    spec = load_pooling_spec(hf)
    assert (spec.kind, len(spec.labels)) == (ModelKind.CLASSIFY, num_labels)
    assert_scores_as_transformers(hf, arch, QUERY, TEXTS[:5])
