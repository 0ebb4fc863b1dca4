"""sentence-transformers' Dense modules after the pooling (LaBSE's tanh projection, stella's and EmbeddingGemma's
projections; kvyard/st_files.py, backend/st_dense.py): a tiny BERT and a tiny Qwen3 embedder with Dense modules
added as sentence-transformers saves them, against its own `encode` on the same weights, served with the Dense
module's width; the modules it cannot honour refused at load by name."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backend.decoder_pooling import DecoderPoolingModel
from backend.encoder import EncoderModel
from backend.engine_types import PoolTask
from backend.pooling import run_task
from kvyard.model_path import ModelFileError
from kvyard.pooling_model import ModelKind, load_pooling_spec
from kvyard.tokenizer import pooling_tokenizer
from tests.backend.test_encoder import SENTENCES, _batch, _values
from tests.support.procs import pdfusion
from tests.support.tiny_decoder_poolers import tiny_decoder_pooler
from tests.support.tiny_encoders import tiny_encoder

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")


def add_dense(path: Path, layers: list[nn.Module]) -> Path:
    """Each sentence-transformers Dense saved in its own folder, listed in modules.json after the Pooling module
    (before Normalize, if the checkpoint has one), as sentence-transformers saves such a model."""
    modules = json.loads((path / "modules.json").read_text())
    at = next(i for i, m in enumerate(modules) if m["type"].endswith("Pooling")) + 1
    for n, layer in enumerate(layers):
        folder = f"{at + n}_Dense"
        (path / folder).mkdir()
        layer.save(str(path / folder))
        modules.insert(at + n, {"idx": at + n, "name": str(at + n), "path": folder,
                                "type": f"{type(layer).__module__}.{type(layer).__name__}"})
    for i, m in enumerate(modules):
        m["idx"], m["name"] = i, str(i)
    (path / "modules.json").write_text(json.dumps(modules))
    return path


def _layers(width: int, seed: int = 0) -> list[nn.Module]:
    from sentence_transformers.sentence_transformer.modules import Dense
    torch.manual_seed(seed)
    return [Dense(width, 24, activation_function=nn.Tanh()),  # LaBSE's kind
            Dense(24, 16, bias=False, activation_function=nn.GELU(), use_residual=True)]  # a projected residual


def _st(path: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer
    return torch.from_numpy(SentenceTransformer(str(path), device="cpu").encode(texts))


def test_a_bert_with_dense_modules_embeds_as_sentence_transformers(tmp_path: Path) -> None:
    hf = add_dense(tiny_encoder(tmp_path / "labse-tiny"), _layers(32))
    spec = load_pooling_spec(hf)
    assert (spec.kind, spec.pooling, spec.normalize, spec.hidden_size, spec.dimensions) == \
        (ModelKind.EMBED, "mean", True, 32, 16)
    tok = pooling_tokenizer(hf)
    tok.no_padding()
    ours = _values(run_task(EncoderModel(spec, torch.float32, CPU), PoolTask.EMBED, *_batch(tok, SENTENCES)))
    theirs = _st(hf, SENTENCES)
    assert ours.shape == theirs.shape == (len(SENTENCES), 16)
    assert (ours - theirs).abs().max() < 1e-5 and F.cosine_similarity(ours, theirs).min() >= 0.99999
    with pdfusion(hf, "labse-tiny", tmp_path / "pdfusion.log") as url:  # as a user runs it
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        got = torch.tensor([d.embedding for d in client.embeddings.create(model="labse-tiny", input=SENTENCES[:3]).data])
        assert got.shape == (3, 16) and F.cosine_similarity(got, theirs[:3]).min() >= 0.99999
        with pytest.raises(openai.BadRequestError, match="16"):  # its size is the Dense module's, not the encoder's
            client.embeddings.create(model="labse-tiny", input="x", dimensions=32)


def test_a_decoder_embedder_with_a_dense_module_embeds_as_sentence_transformers(tmp_path: Path) -> None:
    """stella's kind: a decoder's pooled token projected to another width (no Normalize between)."""
    from sentence_transformers.sentence_transformer.modules import Dense
    torch.manual_seed(1)
    hf = add_dense(tiny_decoder_pooler(tmp_path / "stella-tiny"), [Dense(128, 48, activation_function=nn.Identity())])
    spec = load_pooling_spec(hf)
    assert (spec.kind, spec.is_decoder, spec.dimensions) == (ModelKind.EMBED, True, 48)
    ours = _values(run_task(DecoderPoolingModel(spec, torch.float32, CPU), PoolTask.EMBED,
                            *_batch(pooling_tokenizer(hf), SENTENCES)))
    theirs = _st(hf, SENTENCES)
    assert ours.shape == theirs.shape == (len(SENTENCES), 48)
    assert torch.allclose(ours, theirs, atol=2e-3) and F.cosine_similarity(ours, theirs).min() >= 0.9999


def test_dense_modules_it_cannot_honour_are_refused(tmp_path: Path) -> None:
    from sentence_transformers.sentence_transformer.modules import Dense
    base = tiny_encoder(tmp_path / "base")

    def variant(name: str, layers: list[nn.Module], edit=None) -> Path:  # type: ignore[no-untyped-def]
        path = tmp_path / name
        shutil.copytree(base, path)
        add_dense(path, layers)
        if edit:
            edit(path)
        return path

    def config(path: Path, **changes: object) -> None:
        cfg = json.loads((path / "2_Dense" / "config.json").read_text())
        (path / "2_Dense" / "config.json").write_text(json.dumps({**cfg, **changes}))

    def before_pooling(path: Path) -> None:
        modules = json.loads((path / "modules.json").read_text())
        modules[1], modules[2] = modules[2], modules[1]
        (path / "modules.json").write_text(json.dumps(modules))

    for path, message in (
            (variant("act", [Dense(32, 8)], lambda p: config(p, activation_function="my.own.Swish")), "my.own.Swish"),
            (variant("tokens", [Dense(32, 8)], lambda p: config(p, module_input_name="token_embeddings")),
             "token_embeddings"),
            (variant("width", [Dense(32, 8), Dense(16, 8)]), "reads 16 features"),
            (variant("order", [Dense(32, 8)], before_pooling), "Dense after either"),
            (variant("weights", [Dense(32, 8)], lambda p: (p / "2_Dense" / "model.safetensors").unlink()),
             "model.safetensors")):
        with pytest.raises(ModelFileError, match=message):
            spec = load_pooling_spec(path)
            EncoderModel(spec, torch.float32, CPU)
