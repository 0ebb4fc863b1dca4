"""A BERT encoder shipped as a GGUF, as llama.cpp's converter writes one (its `bert` architecture, the
WordPiece vocabulary in llama.cpp's spelling, the pooling type from 1_Pooling): the embedded all-MiniLM-L6-v2
converted here (tests/support/tiny_encoders.py write_bert_gguf). Tokenized as its Hugging Face tokenizer does,
embedded as sentence-transformers does, served through the openai client."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from backend.encoder import EncoderModel
from backend.engine_types import PoolTask
from backend.pooling import run_task
from kvyard.model_path import ModelFileError
from kvyard.pooling_model import ModelKind, embedded_embedding_path, load_pooling_spec, model_kind
from kvyard.tokenizer import pooling_tokenizer
from tests.backend.test_encoder import _batch, _values
from tests.support.procs import pdfusion
from tests.support.tiny_encoders import write_bert_gguf

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
# Casing, accents, punctuation, CJK, digits, a character outside the vocabulary, a word past 100 characters,
# control characters and runs of spaces, a bracketed word that is not a control token.
TEXTS = ["A man is eating food.", "Café naïve résumé — ÉCOLE!", "東京は日本の首都です。", "x=3.14, y=[1,2]; z?",
         "emoji 🙂 here", "a" * 120 + " tail", "tab\there  two\u0007spaces", "[CLS] is text here",
         "The quick brown fox jumps over the lazy dog's back; it's well-known."]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bert_gguf(embedded_embedding_path(), tmp_path_factory.mktemp("bert-gguf") / "all-MiniLM-L6-v2.F32.gguf")


def test_the_wordpiece_vocabulary_tokenizes_as_the_original(minilm: Path) -> None:
    ours = pooling_tokenizer(minilm)
    theirs = Tokenizer.from_file(str(embedded_embedding_path() / "tokenizer.json"))
    theirs.no_padding()
    theirs.no_truncation()
    for text in TEXTS:
        assert ours.encode(text).ids == theirs.encode(text).ids, text
    assert ours.encode("hello", "world").ids == theirs.encode("hello", "world").ids


def test_the_metadata_names_the_pooling(minilm: Path, tmp_path: Path) -> None:
    spec = load_pooling_spec(minilm)
    assert (model_kind(minilm), spec.kind, spec.model_type, spec.pooling, spec.normalize, spec.hidden_size,
            spec.max_len, spec.is_decoder) == (ModelKind.EMBED, ModelKind.EMBED, "bert", "mean", True, 384, 512, False)


@pytest.mark.parametrize("qtype, cosine", [("F32", 0.99999), ("Q8_0", 0.999)])
def test_embeds_as_sentence_transformers(minilm: Path, tmp_path: Path, qtype: str, cosine: float) -> None:
    """F32: the same numbers (cosine ≥ 0.99999, within 1e-4); Q8_0: the file's rounding of every matrix."""
    from sentence_transformers import SentenceTransformer
    path = minilm if qtype == "F32" else write_bert_gguf(embedded_embedding_path(), tmp_path / f"m.{qtype}.gguf", qtype)
    model = EncoderModel(load_pooling_spec(path), torch.float32, CPU)
    ours = _values(run_task(model, PoolTask.EMBED, *_batch(pooling_tokenizer(path), TEXTS)))
    theirs = torch.from_numpy(SentenceTransformer(str(embedded_embedding_path()), device="cpu").encode(TEXTS))
    similarity = F.cosine_similarity(ours, theirs)
    print(f"{qtype}: lowest cosine {similarity.min():.6f}, largest difference {(ours - theirs).abs().max():.2e}")
    assert similarity.min() >= cosine
    if qtype == "F32":
        assert (ours - theirs).abs().max() < 1e-4


def test_a_tensor_it_cannot_place_is_refused_by_name(minilm: Path, tmp_path: Path) -> None:
    """A reranker converted with its `cls` head (pooling type rank) never gets this far (pooling_model); any other
    tensor the encoder has no place for is a load error naming it, never silently dropped."""
    import gguf
    bad = tmp_path / "extra.gguf"
    w = gguf.GGUFWriter(str(bad), "bert")
    reader = gguf.GGUFReader(str(minilm))
    for field in reader.fields.values():
        if field.name.startswith(("bert.", "tokenizer.")):
            w.add_key_value(field.name, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data)
    w.add_tensor("cls.output.weight", torch.zeros(2, 384).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="cls.output.weight"):
        EncoderModel(load_pooling_spec(bad), torch.float32, CPU)


@pytest.fixture(scope="module")
def served(minilm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with pdfusion(minilm, "minilm-gguf", tmp_path_factory.mktemp("served") / "pdfusion.log") as url:
        yield url


def test_served_through_the_openai_client(served: str) -> None:
    from sentence_transformers import SentenceTransformer
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=60)
    data = client.embeddings.create(model="minilm-gguf", input=TEXTS[:4]).data
    theirs = torch.from_numpy(SentenceTransformer(str(embedded_embedding_path()), device="cpu").encode(TEXTS[:4]))
    assert F.cosine_similarity(torch.tensor([d.embedding for d in data]), theirs).min() >= 0.99999
