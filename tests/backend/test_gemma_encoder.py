"""EmbeddingGemma (backend/gemma_encoder.py): a tiny random Gemma3TextModel with bidirectional attention and
EmbeddingGemma's sentence-transformers pipeline against sentence-transformers' own `encode` over transformers on
the same weights — texts longer than the sliding layers' window, a batch with padding, the query prompt — and
served through the openai client; a causal Gemma 3 refused by name. The same as llama.cpp's converter writes it
(`gemma-embedding`: norms as 1 + w, the Dense matrices as dense_2 / dense_3, a byte-level vocabulary)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import openai
import pytest
import torch
import torch.nn.functional as F

from backend.engine_types import PoolTask
from backend.gemma_encoder import GemmaEncoderConfig, GemmaEncoderModel
from backend.pooling import run_task
from kvyard.model_path import ModelFileError
from kvyard.pooling_model import ModelKind, load_pooling_spec, model_kind
from kvyard.tokenizer import pooling_tokenizer
from tests.backend.test_encoder import _batch, _values
from tests.support.procs import pdfusion
from tests.support.tiny_embedding_gemma import PROMPTS, tiny_embedding_gemma, write_embedding_gemma_gguf

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
TEXTS = ["A man is eating food.", "The quick brown fox jumps over the lazy dog; then it naps, and the dog, "
         "unimpressed, sleeps on.", "x=3.14, y=[1,2]; z?", "Paris", "def f(x):\n    return x ** 2\n"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_embedding_gemma(tmp_path_factory.mktemp("embeddinggemma") / "embeddinggemma-tiny")


def _st(path: Path, texts: list[str], prompt: str | None = None) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer
    return torch.from_numpy(SentenceTransformer(str(path), device="cpu").encode(texts, prompt=prompt))


def test_embeds_as_sentence_transformers(gemma: Path) -> None:
    spec = load_pooling_spec(gemma)
    assert (model_kind(gemma), spec.model_type, spec.pooling, spec.normalize, spec.dimensions, spec.is_decoder) == \
        (ModelKind.EMBED, "gemma3_text", "mean", True, 64, False)
    assert spec.prompts == PROMPTS
    tok = pooling_tokenizer(gemma)
    model = GemmaEncoderModel(spec, torch.float32, CPU)
    ids, types, mask = _batch(tok, TEXTS)
    assert mask.sum(dim=1).max() > 9 and not mask.all()  # past the window (4 either side), and padded
    for texts, prompt in ((TEXTS, None), (TEXTS[:2], PROMPTS["query"])):
        ours = _values(run_task(model, PoolTask.EMBED, *_batch(tok, [(prompt or "") + t for t in texts])))
        theirs = _st(gemma, texts, prompt)
        assert ours.shape == theirs.shape == (len(texts), 64)
        assert (ours - theirs).abs().max() < 1e-5, (ours - theirs).abs().max()


def test_the_window_and_both_rope_bases_matter(gemma: Path, tmp_path: Path) -> None:
    """The comparison above can tell: without the window, or with one base for every layer, it fails."""
    spec = load_pooling_spec(gemma)
    tok = pooling_tokenizer(gemma)
    theirs = _st(gemma, TEXTS[1:2])
    model = GemmaEncoderModel(spec, torch.float32, CPU)
    for change in ({"window": 10_000}, {"local_rope_theta": model.cfg.rope_theta}):
        model.cfg = type(model.cfg)(**{**model.cfg.__dict__, **change})
        model._inv_freq = [1.0 / t ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
                           for t in (model.cfg.rope_theta, model.cfg.local_rope_theta)]
        ours = _values(run_task(model, PoolTask.EMBED, *_batch(tok, TEXTS[1:2])))
        assert (ours - theirs).abs().max() > 1e-3, change
        model = GemmaEncoderModel(spec, torch.float32, CPU)


def test_transformers_4_keys_read_the_same(gemma: Path, tmp_path: Path) -> None:
    """EmbeddingGemma as published (transformers 4.56's config): rope_theta / rope_local_base_freq, the pattern
    of sliding layers as _sliding_window_pattern."""
    cfg = json.loads((gemma / "config.json").read_text())
    old = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling=None, _sliding_window_pattern=3)
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert GemmaEncoderConfig.from_dir(tmp_path) == GemmaEncoderConfig.from_dir(gemma)
    assert GemmaEncoderConfig.from_dir(gemma).sliding == (0, 1) and GemmaEncoderConfig.from_dir(gemma).window == 4


def test_served_through_the_openai_client(gemma: Path) -> None:
    """With MATRYOSHKA_DIMENSIONS (EmbeddingGemma's files do not list its sizes): `dimensions` 32 is the vector's
    first 32 values, renormalised, as sentence-transformers' truncate_dim gives them; 24 is a 400."""
    from sentence_transformers import SentenceTransformer
    theirs = _st(gemma, TEXTS[:3])
    short = torch.from_numpy(SentenceTransformer(str(gemma), device="cpu", truncate_dim=32).encode(
        TEXTS[:3], normalize_embeddings=True))
    with pdfusion(gemma, "embeddinggemma-tiny", gemma.parent / "pdfusion.log",
                  env={"MATRYOSHKA_DIMENSIONS": "32,16"}) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        got = torch.tensor([d.embedding for d in client.embeddings.create(model="embeddinggemma-tiny", input=TEXTS[:3]).data])
        assert got.shape == (3, 64) and F.cosine_similarity(got, theirs).min() >= 0.99999
        cut = client.embeddings.create(model="embeddinggemma-tiny", input=TEXTS[:3], dimensions=32).data
        got = torch.tensor([d.embedding for d in cut])
        assert got.shape == (3, 32) and (got - short).abs().max() < 1e-5
        with pytest.raises(openai.BadRequestError, match="16, 32, 64"):
            client.embeddings.create(model="embeddinggemma-tiny", input="x", dimensions=24)


def test_matryoshka_dimensions_a_frontend_cannot_honour_stop_the_start(gemma: Path) -> None:
    from frontend.config import FrontendConfig
    env = {"CHECKPOINT_PATH": str(gemma), "START_PORT": "7000"}
    assert FrontendConfig.from_env(env).embedding.matryoshka_dimensions is None  # type: ignore[union-attr]
    assert FrontendConfig.from_env({**env, "MATRYOSHKA_DIMENSIONS": "any"}).embedding.matryoshka_dimensions == ()  # type: ignore[union-attr]
    for bad, message in (("128", "1..64"), ("0", "1..64"), ("half", "any")):
        with pytest.raises(ValueError, match=message):
            FrontendConfig.from_env({**env, "MATRYOSHKA_DIMENSIONS": bad})


def test_a_gemma_it_does_not_run_is_refused(gemma: Path, tmp_path: Path) -> None:
    cfg = json.loads((gemma / "config.json").read_text())
    for key, value in (("use_bidirectional_attention", False), ("attn_logit_softcapping", 50.0),
                       ("hidden_activation", "silu"), ("rope_scaling", {"rope_type": "linear", "factor": 8.0})):
        path = tmp_path / key
        path.mkdir()
        for f in gemma.iterdir():
            if f.is_file():
                (path / f.name).symlink_to(f)
        (path / "config.json").unlink()
        (path / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ModelFileError, match=key):
            load_pooling_spec(path)


@pytest.mark.parametrize("qtype, cosine", [("F32", 0.99999), ("Q8_0", 0.999)])
def test_a_gguf_embeds_as_sentence_transformers(gemma: Path, tmp_path: Path, qtype: str, cosine: float) -> None:
    path = write_embedding_gemma_gguf(gemma, tmp_path / f"embeddinggemma-tiny.{qtype}.gguf", qtype)
    spec = load_pooling_spec(path)
    assert (model_kind(path), spec.model_type, spec.pooling, spec.normalize, spec.dimensions, spec.is_decoder) == \
        (ModelKind.EMBED, "gemma-embedding", "mean", True, 64, False)
    assert [(d.in_features, d.out_features, d.tensor) for d in spec.dense] == [(64, 96, "dense_2.weight"),
                                                                              (96, 64, "dense_3.weight")]
    reference = pooling_tokenizer(gemma)
    tok = pooling_tokenizer(path)
    assert all(tok.encode(t).ids == reference.encode(t).ids for t in TEXTS)  # <bos> ... <eos>, as the directory's
    model = GemmaEncoderModel(spec, torch.float32, CPU)
    assert model.cfg.eps == pytest.approx(1e-6)  # stored as a float32
    assert replace(model.cfg, eps=1e-6) == GemmaEncoderConfig.from_dir(gemma)  # scale: key_length^-1/2, 16 both
    ours = _values(run_task(model, PoolTask.EMBED, *_batch(tok, TEXTS)))
    theirs = _st(gemma, TEXTS)
    assert F.cosine_similarity(ours, theirs).min() >= cosine
    if qtype == "F32":
        assert (ours - theirs).abs().max() < 1e-5
        with pdfusion(path, "embeddinggemma-gguf", tmp_path / "pdfusion.log") as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            got = client.embeddings.create(model="embeddinggemma-gguf", input=TEXTS[:2]).data
            assert F.cosine_similarity(torch.tensor([d.embedding for d in got]), theirs[:2]).min() >= 0.99999


def test_a_gguf_without_the_pattern_takes_llama_cpps(gemma: Path, tmp_path: Path) -> None:
    """No sliding_window_pattern (as the converter writes EmbeddingGemma): every sixth layer full, as llama.cpp
    reads it — the published 24-layer model's layer_types."""
    import gguf
    import numpy as np
    path = write_embedding_gemma_gguf(gemma, tmp_path / "with.gguf")
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "without.gguf"), "gemma-embedding")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "gemma-embedding.attention.sliding_window_pattern"):
            continue
        value = field.contents()
        if field.name == "gemma-embedding.block_count":
            value = 24
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(field.name, value, kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(field.name, value, kind)
    writer.add_tensor("token_embd.weight", np.zeros((8, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg = GemmaEncoderConfig.from_gguf(tmp_path / "without.gguf")
    assert cfg.num_layers == 24 and [i for i in range(24) if i not in cfg.sliding] == [5, 11, 17, 23]
