"""sentence-transformers' StaticEmbedding models (static-retrieval-mrl-en-v1's kind: a vector per token, averaged;
no config.json at the top): a random one over MiniLM's WordPiece vocabulary, with Normalize, against
sentence-transformers' own `encode` (no special tokens, the query prompt); with a Dense module after it; served
through the openai client with Matryoshka sizes from MATRYOSHKA_DIMENSIONS."""
from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
import torch.nn.functional as F

from backend.engine_types import PoolTask
from backend.pooling import run_task
from backend.static_embedding import StaticEmbeddingModel
from kvyard.pooling_model import ModelKind, embedded_embedding_path, load_pooling_spec, model_kind
from kvyard.tokenizer import TextTokenizer, pooling_tokenizer
from tests.backend.test_encoder import _batch, _values
from tests.backend.test_gguf_encoder import TEXTS
from tests.support.procs import pdfusion

pytestmark = pytest.mark.slow
PROMPTS = {"query": "query: "}


def static_model(path: Path, dense: int = 0) -> Path:
    """A StaticEmbedding of width 64 (random) saved by sentence-transformers, then Normalize (or, dense > 0, a
    tanh Dense to that width first)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, StaticEmbedding
    from tokenizers import Tokenizer
    torch.manual_seed(0)
    static = StaticEmbedding(Tokenizer.from_file(str(embedded_embedding_path() / "tokenizer.json")), embedding_dim=64)
    modules = [static, *([Dense(64, dense, activation_function=torch.nn.Tanh())] if dense else []), Normalize()]
    SentenceTransformer(modules=modules, device="cpu", prompts=PROMPTS).save(str(path))
    return path


def _st(path: Path, texts: list[str], prompt: str | None = None) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer
    return torch.from_numpy(SentenceTransformer(str(path), device="cpu").encode(texts, prompt=prompt))


@pytest.mark.parametrize("dense", [0, 24])
def test_embeds_as_sentence_transformers(tmp_path: Path, dense: int) -> None:
    path = static_model(tmp_path / "static", dense)
    assert not (path / "config.json").exists()
    spec = load_pooling_spec(path)
    assert (model_kind(path), spec.model_type, spec.pooling, spec.normalize, spec.dimensions) == \
        (ModelKind.EMBED, "static", "mean", True, dense or 64)
    tok = pooling_tokenizer(path)
    assert tok.encode("a man").ids == tok.encode("a man", add_special_tokens=False).ids  # no [CLS] / [SEP]
    assert TextTokenizer.from_path(path).vocab_size == 30522  # its module's tokenizer.json
    model = StaticEmbeddingModel(spec, torch.float32, torch.device("cpu"))
    for texts, prompt in ((TEXTS, None), (TEXTS[:3], PROMPTS["query"])):
        ours = _values(run_task(model, PoolTask.EMBED, *_batch(tok, [(prompt or "") + t for t in texts])))
        theirs = _st(path, texts, prompt)
        assert ours.shape == theirs.shape and (ours - theirs).abs().max() < 1e-5, (ours - theirs).abs().max()


def test_served_with_matryoshka_sizes(tmp_path: Path) -> None:
    path = static_model(tmp_path / "static-retrieval-tiny")
    theirs = _st(path, TEXTS[:3])
    with pdfusion(path, "static-tiny", tmp_path / "pdfusion.log", env={"MATRYOSHKA_DIMENSIONS": "32,16"}) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        got = torch.tensor([d.embedding for d in client.embeddings.create(model="static-tiny", input=TEXTS[:3]).data])
        assert got.shape == (3, 64) and F.cosine_similarity(got, theirs).min() >= 0.99999
        short = client.embeddings.create(model="static-tiny", input=TEXTS[:3], dimensions=16).data
        assert torch.allclose(torch.tensor([d.embedding for d in short]), F.normalize(theirs[:, :16], dim=-1), atol=1e-5)


def test_a_model2vec_directory_embeds_as_sentence_transformers(tmp_path: Path) -> None:
    """potion-base's layout: model2vec's own config.json, the StaticEmbedding module at "." and its file as
    `embeddings` (fewer rows than tokens), `mapping` (token id → row) and per-token `weights`."""
    import json

    from safetensors.torch import save_file
    path = static_model(tmp_path / "potion-tiny")
    modules = json.loads((path / "modules.json").read_text())
    folder = path / modules[0]["path"]
    table = torch.randn(500, 64)
    mapping = torch.randint(0, 500, (30522,))
    save_file({"embeddings": table, "mapping": mapping, "weights": torch.rand(30522) + 0.5},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "model2vec", "normalize": True, "hidden_dim": 64}))
    for f in folder.iterdir():
        f.rename(path / f.name)
    modules[0]["path"] = "."
    (path / "modules.json").write_text(json.dumps(modules))
    spec = load_pooling_spec(path)
    assert (model_kind(path), spec.model_type, spec.dimensions) == (ModelKind.EMBED, "static", 64)
    ours = _values(run_task(StaticEmbeddingModel(spec, torch.float32, torch.device("cpu")), PoolTask.EMBED,
                            *_batch(pooling_tokenizer(path), TEXTS)))
    theirs = _st(path, TEXTS)
    assert (ours - theirs).abs().max() < 1e-5, (ours - theirs).abs().max()
