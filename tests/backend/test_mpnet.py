"""MPNet (all-mpnet-base-v2, multi-qa-mpnet: the most used sentence-transformers models): BERT's post-norm layers
with positions counted from 2 and a learned relative-position bias per head, shared by every layer, over T5's
buckets of key - query distance; RoBERTa's classifier head — against sentence-transformers and transformers on
the same random weights, texts long enough for the logarithmic buckets, served."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from backend.encoder import EncoderModel, _relative_bucket
from backend.engine_types import PoolTask
from backend.pooling import run_task
from kvyard.pooling_model import ModelKind, load_pooling_spec, model_kind
from kvyard.tokenizer import pooling_tokenizer
from tests.backend.test_encoder import _batch, _values
from tests.backend.test_gguf_encoder import TEXTS, _embeds_as_sentence_transformers
from tests.support.cross_encoder_checks import assert_scores_as_transformers
from tests.support.tiny_encoders import tiny_encoder

pytestmark = pytest.mark.slow
QUERY = "what is the capital of france?"
LONG = " ".join(TEXTS * 3)  # past 8 tokens either way: the logarithmic buckets


def test_buckets_are_transformers(tmp_path: Path) -> None:
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder
    i = torch.arange(300)
    relative = i[None, :] - i[:, None]
    assert torch.equal(_relative_bucket(relative, 32), MPNetEncoder.relative_position_bucket(relative, num_buckets=32))


def test_embeds_as_sentence_transformers(tmp_path: Path) -> None:
    hf = tiny_encoder(tmp_path / "mpnet-tiny", arch="MPNetModel")
    spec = load_pooling_spec(hf)
    assert (model_kind(hf), spec.model_type, spec.pooling, spec.max_len) == (ModelKind.EMBED, "mpnet", "mean", 256)
    assert len(pooling_tokenizer(hf).encode(LONG).ids) > 100
    _embeds_as_sentence_transformers(hf, hf, [*TEXTS, LONG], served="mpnet-tiny")


def test_the_relative_bias_matters(tmp_path: Path) -> None:
    """The comparison above can tell: zeroing the bias table moves the vectors far past its tolerance."""
    hf = tiny_encoder(tmp_path / "mpnet-tiny", arch="MPNetModel")
    spec = load_pooling_spec(hf)
    tok = pooling_tokenizer(hf)
    model = EncoderModel(spec, torch.float32, torch.device("cpu"))
    before = _values(run_task(model, PoolTask.EMBED, *_batch(tok, [LONG])))
    model.w["encoder.relative_attention_bias.weight"].zero_()
    after = _values(run_task(model, PoolTask.EMBED, *_batch(tok, [LONG])))
    assert (before - after).abs().max() > 1e-3


def test_a_classifier_scores_as_transformers(tmp_path: Path) -> None:
    hf = tiny_encoder(tmp_path / "ce", arch="MPNetForSequenceClassification", num_labels=1)
    assert json.loads((hf / "config.json").read_text())["model_type"] == "mpnet"
    assert_scores_as_transformers(hf, "MPNetForSequenceClassification", QUERY, [*TEXTS[:4], LONG])
