"""DistilBERT (msmarco-distilbert, distiluse-base-multilingual with its Dense projection,
distilbert-*-finetuned classifiers): BERT's post-norm layers under DistilBERT's own names, no segment embeddings,
and its classifier's ReLU pre-classifier over [CLS] — against sentence-transformers and transformers on the same
random weights, served."""
from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from kvyard.pooling_model import ModelKind, load_pooling_spec, model_kind
from tests.backend.test_gguf_encoder import TEXTS, _embeds_as_sentence_transformers
from tests.backend.test_st_dense import add_dense
from tests.support.cross_encoder_checks import assert_scores_as_transformers
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
    hf = tiny_encoder(tmp_path / "ce", arch="DistilBertForSequenceClassification", num_labels=num_labels)
    spec = load_pooling_spec(hf)
    assert (spec.kind, len(spec.labels)) == (ModelKind.CLASSIFY, num_labels)
    assert_scores_as_transformers(hf, "DistilBertForSequenceClassification", QUERY, TEXTS[:5])
