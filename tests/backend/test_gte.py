"""GTE (gte-multilingual-base, its reranker, gte-*-en-v1.5): post-norm layers with rotary positions and a gated GELU,
as transformers' GteModel computes them and saves them (in Alibaba's own `new` tensor names), with XLM-R's kind of
vocabulary; Alibaba's own `new` config keys, its fixed NTK scaling included; the sequence classifier; served."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from backend.encoder import EncoderModel
from backend.engine_types import PoolTask
from backend.pooling import run_task
from kvyard.model_path import ModelFileError
from kvyard.pooling_model import ModelKind, load_pooling_spec, model_kind
from kvyard.tokenizer import pooling_tokenizer
from tests.backend.test_encoder import _batch, _values
from tests.backend.test_gguf_encoder import TEXTS, _embeds_as_sentence_transformers
from tests.support.cross_encoder_checks import assert_scores_as_transformers, assert_served_rerank
from tests.support.tiny_encoders import tiny_encoder

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
QUERY = "what is the capital of france?"


@pytest.fixture(scope="module")
def gte(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_encoder(tmp_path_factory.mktemp("gte") / "gte-tiny", arch="GteModel", unigram=True)


def _as_new(hf: Path, path: Path, **keys: object) -> Path:
    """The directory with Alibaba's own config (model_type `new`, NewModel), the same weights."""
    path.mkdir()
    for f in hf.iterdir():
        if f.name != "config.json":
            (path / f.name).symlink_to(f)
    cfg = json.loads((hf / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.update({"model_type": "new", "architectures": ["NewModel"], "rope_theta": 1000.0, "rope_scaling": None,
                "position_embedding_type": "rope", "layer_norm_type": "layer_norm", "logn_attention_scale": False,
                "pack_qkv": True, "unpad_inputs": False, **keys})
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _ours(path: Path, texts: list[str]) -> torch.Tensor:
    tok = pooling_tokenizer(path)
    return _values(run_task(EncoderModel(load_pooling_spec(path), torch.float32, CPU), PoolTask.EMBED, *_batch(tok, texts)))


def test_embeds_as_sentence_transformers(gte: Path) -> None:
    spec = load_pooling_spec(gte)
    assert (model_kind(gte), spec.model_type, spec.pooling, spec.is_decoder) == (ModelKind.EMBED, "gte", "mean", False)
    _embeds_as_sentence_transformers(gte, gte, TEXTS, served="gte-tiny")


def test_alibabas_own_config_reads_the_same(gte: Path, tmp_path: Path) -> None:
    assert torch.allclose(_ours(_as_new(gte, tmp_path / "new"), TEXTS), _ours(gte, TEXTS), atol=1e-6)


def test_fixed_ntk_scaling_as_alibabas_code_scales(gte: Path, tmp_path: Path) -> None:
    """`rope_scaling: {type: ntk, factor: f}`: base θ·f and every frequency divided by f^(2/d) — the same angles
    as transformers' GteModel at base θ·f reading positions scaled by f^(-2/d)."""
    import transformers
    new = _as_new(gte, tmp_path / "ntk", rope_scaling={"type": "ntk", "factor": 4.0})
    ids, _, mask = _batch(pooling_tokenizer(gte), TEXTS)
    ours = _values(run_task(EncoderModel(load_pooling_spec(new), torch.float32, CPU), PoolTask.EMBED, ids,
                            torch.zeros_like(ids), mask))
    model = transformers.GteModel.from_pretrained(gte, rope_parameters={"rope_type": "default", "rope_theta": 4000.0}).eval()
    d = 32 // 4
    positions = torch.arange(ids.shape[1], dtype=torch.float32)[None].expand(ids.shape[0], -1) * 4.0 ** (-2 / d)
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).last_hidden_state
    m = mask.unsqueeze(-1).float()
    ref = F.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)
    assert (ours - ref).abs().max() < 1e-5
    assert (ours - _ours(gte, TEXTS)).abs().max() > 2e-4  # the scaling moves the vectors 20x past the tolerance


@pytest.mark.parametrize("num_labels", [1, 3])
def test_a_cross_encoder_scores_pairs_as_transformers(tmp_path: Path, num_labels: int) -> None:
    hf = tiny_encoder(tmp_path / "gte-reranker", arch="GteForSequenceClassification", num_labels=num_labels, unigram=True)
    spec = load_pooling_spec(hf)
    assert (spec.kind, spec.model_type, len(spec.labels)) == (ModelKind.CLASSIFY, "gte", num_labels)
    ref = assert_scores_as_transformers(hf, "GteForSequenceClassification", QUERY, TEXTS[:5])
    if num_labels == 1:
        assert_served_rerank(hf, QUERY, TEXTS[:5], ref, tmp_path / "pdfusion.log")


def test_a_gte_it_does_not_run_is_refused(gte: Path, tmp_path: Path) -> None:
    for n, (key, value) in enumerate((("rope_scaling", {"type": "ntk", "factor": 2.0, "mixed_b": 0.6}),
                                      ("logn_attention_scale", True), ("layer_norm_type", "rms_norm"),
                                      ("position_embedding_type", "absolute"), ("hidden_act", "relu"))):
        with pytest.raises(ModelFileError, match=key):
            load_pooling_spec(_as_new(gte, tmp_path / str(n), **{key: value}))
