"""A BERT encoder shipped as a GGUF, as llama.cpp's converter writes one (its `bert` architecture, the
WordPiece vocabulary in llama.cpp's spelling, the pooling type from 1_Pooling): the embedded all-MiniLM-L6-v2
converted here (tests/support/tiny_encoders.py write_bert_gguf). Tokenized as its Hugging Face tokenizer does,
embedded as sentence-transformers does, served through the openai client. A BERT cross-encoder as a GGUF
(pooling type rank, its pooler and classifier as `cls` / `cls.output`) scores pairs as transformers does and
answers /v1/rerank. An XLM-RoBERTa encoder (BGE-M3's, bge-reranker's kind) as the converter writes it: its
SentencePiece Unigram vocabulary as `t5`, tokenized as transformers' XLM-R tokenizer does; embedded and scored
as transformers does. A Nomic BERT (nomic-embed-text's kind: `nomic-bert`, rotary positions, SwiGLU, one
q/k/v matrix, no biases) embeds as sentence-transformers does over transformers' own Nomic BERT; so does a
ModernBERT directory (pre-norm, windowed layers, GeGLU)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
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
from tests.support.tiny_encoders import tiny_encoder, write_bert_gguf

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
    """A tensor the encoder has no place for is a load error naming it, never silently dropped."""
    import gguf
    bad = tmp_path / "extra.gguf"
    w = gguf.GGUFWriter(str(bad), "bert")
    reader = gguf.GGUFReader(str(minilm))
    for field in reader.fields.values():
        if field.name.startswith(("bert.", "tokenizer.")):
            w.add_key_value(field.name, field.contents(), field.types[0], field.types[1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data)
    w.add_tensor("blk.0.attn_norm_2.weight", torch.zeros(384).numpy())  # jina-bert-v2's second norm
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="blk.0.attn_norm_2.weight"):
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


@pytest.mark.parametrize("num_labels", [1, 3])
def test_a_cross_encoder_scores_pairs_as_transformers(tmp_path: Path, num_labels: int) -> None:
    """Query-document pairs with their segment ids → the classifier's logits, within 1e-4; id2label as the
    converter writes it (classifier.output_labels)."""
    import transformers
    labels = {0: "neg", 1: "neutral", 2: "pos"} if num_labels == 3 else None
    hf = tiny_encoder(tmp_path / "ce", arch="BertForSequenceClassification", num_labels=num_labels, id2label=labels)
    path = write_bert_gguf(hf, tmp_path / "ce.gguf")
    spec = load_pooling_spec(path)
    assert (model_kind(path), spec.kind, spec.labels) == \
        (ModelKind.CLASSIFY, ModelKind.CLASSIFY, ("neg", "neutral", "pos") if labels else ("LABEL_0",))
    tok = pooling_tokenizer(path)
    pairs = [("what is the capital of france?", t) for t in TEXTS[:4]]
    ids, types, mask = _batch(tok, [q for q, _ in pairs], [d for _, d in pairs])
    assert types.any()  # the documents are segment 1
    ours = _values(run_task(EncoderModel(spec, torch.float32, CPU), PoolTask.CLASSIFY, ids, types, mask))
    with torch.no_grad():
        ref = transformers.BertForSequenceClassification.from_pretrained(hf).eval()(
            input_ids=ids, attention_mask=mask.long(), token_type_ids=types).logits
    assert ours.shape == ref.shape == (4, num_labels)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_a_served_cross_encoder_reranks(tmp_path: Path) -> None:
    import transformers
    hf = tiny_encoder(tmp_path / "ce", arch="BertForSequenceClassification", num_labels=1)
    path = write_bert_gguf(hf, tmp_path / "ms-marco-tiny.gguf")
    query, docs = "what is the capital of france?", TEXTS[:5]
    batch = transformers.AutoTokenizer.from_pretrained(hf)([query] * len(docs), docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = torch.sigmoid(transformers.BertForSequenceClassification.from_pretrained(hf).eval()(**batch).logits[:, 0])
    with pdfusion(path, "rerank-gguf", tmp_path / "pdfusion.log") as url:
        body = httpx.post(f"{url}/v1/rerank", json={"query": query, "documents": docs, "top_n": 3}, timeout=60).json()
        assert [r["index"] for r in body["results"]] == expected.argsort(descending=True)[:3].tolist()
        assert all(abs(r["relevance_score"] - float(expected[r["index"]])) < 1e-4 for r in body["results"])
        bad = httpx.post(f"{url}/v1/embeddings", json={"input": "x"}, timeout=60)
        assert bad.status_code == 400 and "classify" in bad.json()["error"]["message"]


@pytest.fixture(scope="module")
def xlmr(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    hf = tiny_encoder(tmp_path_factory.mktemp("xlmr") / "xlmr", arch="XLMRobertaModel", unigram=True)
    return hf, write_bert_gguf(hf, hf.parent / "xlmr.gguf")


# Runs of spaces at either end and inside, NFKC's full-width letters, circled digit and ligature, wide and
# no-break spaces, a character no piece spells (unknown: fused with its neighbour), special tokens as text.
UNIGRAM_TEXTS = [*TEXTS, "  lead and trail  ", "Ｆｕｌｌ width ① ﬁne", "\u3000wide\u00a0space", "<s> and </s> and <mask>",
                 "Berlin ist die Hauptstadt 𝔘𝔘 von Deutschland."]


def test_a_unigram_vocabulary_tokenizes_as_xlm_roberta(xlmr: tuple[Path, Path]) -> None:
    import transformers
    hf, path = xlmr
    ours, theirs = pooling_tokenizer(path), transformers.AutoTokenizer.from_pretrained(hf)
    assert theirs.backend_tokenizer.model.__class__.__name__ == "Unigram"
    for text in UNIGRAM_TEXTS:
        assert ours.encode(text).ids == theirs(text)["input_ids"], text
    assert ours.encode("hello", "world").ids == theirs("hello", "world")["input_ids"]  # <s> A </s></s> B </s>
    assert theirs.unk_token_id in ours.encode(UNIGRAM_TEXTS[-1]).ids
    assert set(ours.encode("hello", "world").type_ids) == {0}  # XLM-R has one segment type


def test_an_xlm_roberta_gguf_embeds_as_sentence_transformers(xlmr: tuple[Path, Path]) -> None:
    from sentence_transformers import SentenceTransformer
    hf, path = xlmr
    spec = load_pooling_spec(path)
    assert (spec.kind, spec.pooling, spec.max_len) == (ModelKind.EMBED, "mean", 256)  # positions from 0, as cut
    ours = _values(run_task(EncoderModel(spec, torch.float32, CPU), PoolTask.EMBED,
                            *_batch(pooling_tokenizer(path), UNIGRAM_TEXTS)))
    theirs = torch.from_numpy(SentenceTransformer(str(hf), device="cpu").encode(UNIGRAM_TEXTS))
    assert F.cosine_similarity(ours, theirs).min() >= 0.99999
    assert (ours - theirs).abs().max() < 1e-4


def test_an_xlm_roberta_cross_encoder_gguf_scores_pairs_as_transformers(tmp_path: Path) -> None:
    """bge-reranker-v2-m3's kind: XLM-R's classification head (dense, tanh, out_proj) as `cls` / `cls.output`."""
    import transformers
    hf = tiny_encoder(tmp_path / "ce", arch="XLMRobertaForSequenceClassification", unigram=True)
    path = write_bert_gguf(hf, tmp_path / "ce.gguf")
    query, docs = "what is the capital of france?", UNIGRAM_TEXTS[:5]
    ids, types, mask = _batch(pooling_tokenizer(path), [query] * len(docs), docs)
    ours = _values(run_task(EncoderModel(load_pooling_spec(path), torch.float32, CPU), PoolTask.CLASSIFY, ids, types, mask))
    theirs = transformers.AutoTokenizer.from_pretrained(hf)
    assert [row[m].tolist() for row, m in zip(ids, mask)] == [theirs(query, d)["input_ids"] for d in docs]
    batch = theirs([query] * len(docs), docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = transformers.XLMRobertaForSequenceClassification.from_pretrained(hf).eval()(**batch).logits
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    expected = torch.sigmoid(ref[:, 0])
    with pdfusion(path, "bge-reranker-tiny", tmp_path / "pdfusion.log") as url:  # the frontend's pairs too
        body = httpx.post(f"{url}/v1/rerank", json={"query": query, "documents": docs}, timeout=60).json()
        assert [r["index"] for r in body["results"]] == expected.argsort(descending=True).tolist()
        assert all(abs(r["relevance_score"] - float(expected[r["index"]])) < 1e-4 for r in body["results"])


def _embeds_as_sentence_transformers(path: Path, hf: Path, texts: list[str], cosine: float = 0.99999,
                                     served: str | None = None) -> None:
    """path (a GGUF or a directory) pooled here against sentence-transformers' encode of the directory hf: the
    lowest cosine at least `cosine`, within 1e-4 when that is 0.99999; served under that name too when given."""
    from sentence_transformers import SentenceTransformer
    spec = load_pooling_spec(path)
    tok = pooling_tokenizer(path)
    tok.no_padding()  # a directory's tokenizer.json may pad (MiniLM's: to 128); the frontend sends inputs as they are
    tok.no_truncation()
    ours = _values(run_task(EncoderModel(spec, torch.float32, CPU), PoolTask.EMBED, *_batch(tok, texts)))
    theirs = torch.from_numpy(SentenceTransformer(str(hf), device="cpu").encode(texts))
    similarity = F.cosine_similarity(ours, theirs)
    print(f"{path.name}: lowest cosine {similarity.min():.6f}, largest difference {(ours - theirs).abs().max():.2e}")
    assert similarity.min() >= cosine
    if cosine >= 0.99999:
        assert (ours - theirs).abs().max() < 1e-4
    if served:
        with pdfusion(path, served, path.parent / f"{served}.log") as url:  # as a user runs it
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            got = torch.tensor([d.embedding for d in client.embeddings.create(model=served, input=texts[:4]).data])
            assert F.cosine_similarity(got, theirs[:4]).min() >= 0.99999


@pytest.mark.parametrize("qtype, cosine", [("F32", 0.99999), ("Q8_0", 0.999)])
def test_a_nomic_bert_gguf_embeds_as_sentence_transformers(tmp_path: Path, qtype: str, cosine: float) -> None:
    """Rotary positions (a text's tokens in another order embed otherwise), [gate; up] SwiGLU, fused q/k/v."""
    hf = tiny_encoder(tmp_path / "nomic", arch="NomicBertModel")
    path = write_bert_gguf(hf, tmp_path / f"nomic-embed-tiny.{qtype}.gguf", qtype)
    spec = load_pooling_spec(path)
    assert (model_kind(path), spec.kind, spec.model_type, spec.pooling, spec.is_decoder) == \
        (ModelKind.EMBED, ModelKind.EMBED, "nomic-bert", "mean", False)
    texts = [t for t in TEXTS if len(pooling_tokenizer(path).encode(t).ids) <= spec.max_len]
    assert len(texts) >= 8
    _embeds_as_sentence_transformers(path, hf, texts, cosine, served="nomic-embed-tiny" if qtype == "F32" else None)


def test_a_nomic_bert_directory_embeds_as_sentence_transformers(tmp_path: Path) -> None:
    """The same model as a Hugging Face directory (nomic-embed-text's checkpoint names, as transformers saves them)."""
    hf = tiny_encoder(tmp_path / "nomic", arch="NomicBertModel")
    spec = load_pooling_spec(hf)
    assert (model_kind(hf), spec.model_type, spec.pooling, spec.max_len, spec.is_decoder) == \
        (ModelKind.EMBED, "nomic_bert", "mean", 64, False)
    tok = pooling_tokenizer(hf)
    tok.no_padding()
    texts = [t for t in TEXTS if len(tok.encode(t).ids) <= spec.max_len]
    assert len(texts) >= 8
    _embeds_as_sentence_transformers(hf, hf, texts)


def test_a_nomic_bert_kind_it_does_not_run_is_refused(tmp_path: Path) -> None:
    """v2's mixture of experts, or biases on q/k/v: a load error naming the key, never wrong vectors."""
    import json
    hf = tiny_encoder(tmp_path / "nomic", arch="NomicBertModel")
    cfg = json.loads((hf / "config.json").read_text())
    for key, value in (("moe_every_n_layers", 2), ("qkv_proj_bias", True), ("rotary_emb_interleaved", True)):
        (hf / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ModelFileError, match=key):
            load_pooling_spec(hf)


def test_a_modernbert_directory_embeds_as_sentence_transformers(tmp_path: Path) -> None:
    """Pre-norm layers, rotary at a base per layer kind, two of every three layers attending within 4 positions
    (texts of up to 30 tokens: the window cuts), GeGLU, a final norm; against transformers' own ModernBERT."""
    hf = tiny_encoder(tmp_path / "modernbert", arch="ModernBertModel")
    spec = load_pooling_spec(hf)
    assert (model_kind(hf), spec.model_type, spec.pooling, spec.max_len, spec.is_decoder) == \
        (ModelKind.EMBED, "modernbert", "mean", 256, False)
    _embeds_as_sentence_transformers(hf, hf, TEXTS, served="modernbert-tiny")


@pytest.mark.parametrize("qtype, cosine", [("F32", 0.99999), ("Q8_0", 0.999)])
def test_a_modernbert_gguf_embeds_as_sentence_transformers(tmp_path: Path, qtype: str, cosine: float) -> None:
    """llama.cpp's `modern-bert`: its byte-level BPE vocabulary (pre-tokenizer `modern-bert`) with [CLS] and [SEP]
    added, the window and the pattern of global layers from `attention.sliding_window(_pattern)`, both rotary
    bases, the pre-norms and final norm under llama.cpp's names."""
    hf = tiny_encoder(tmp_path / "modernbert", arch="ModernBertModel")
    path = write_bert_gguf(hf, tmp_path / f"modernbert-tiny.{qtype}.gguf", qtype)
    spec = load_pooling_spec(path)
    assert (model_kind(path), spec.model_type, spec.pooling, spec.is_decoder) == \
        (ModelKind.EMBED, "modern-bert", "mean", False)
    reference = Tokenizer.from_file(str(hf / "tokenizer.json"))
    assert all(pooling_tokenizer(path).encode(t).ids == reference.encode(t).ids for t in TEXTS)
    _embeds_as_sentence_transformers(path, hf, TEXTS, cosine)
