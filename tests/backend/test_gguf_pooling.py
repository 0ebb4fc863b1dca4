"""A decoder embedding model shipped as a GGUF, as llama.cpp's converter writes Qwen3-Embedding: the `qwen3`
architecture, `qwen3.pooling_type` LAST and `tokenizer.ggml.add_eos_token`. Its metadata makes it an embed model;
its inputs end with the eos llama.cpp appends; it pools on the chat engine's weights (dense, or the GGUF's blocks
with the C++ kernels, as a backend serves it). Against transformers on the same weights (the writer sets the
model's weights to what the file holds), then served: as CHECKPOINT_PATH through the official openai client."""
from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import gguf
import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from backend import kernels
from backend.decoder_pooling import DecoderPoolingModel
from backend.engine_types import PoolTask
from backend.model import default_ops
from backend.pooling import run_task
from backend.weights import load_weights
from kvyard.model_config import load_model_config
from kvyard.model_path import ModelFileError
from kvyard.pooling_model import (ModelKind, embedding_model_name, load_pooling_spec, model_kind, qwen3_reranker_prompt,
                                  resolve_embedding_path)
from kvyard.tokenizer import pooling_tokenizer
from tests.backend.test_encoder import _batch, _values
from tests.support.procs import pdfusion
from tests.support.tiny_models import EXACT_TYPES, TinyModel, tiny_model, write_gguf

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
TEXTS = ["A man is eating food.", "short", "The capital of France is Paris, and it sits on the Seine river."]


@pytest.fixture(scope="module")
def tiny() -> TinyModel:
    return tiny_model("qwen3", max_positions=256)


@pytest.fixture(scope="module")
def embedder(tiny: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf-embedder")
    return write_gguf(tiny, root / "tiny-qwen3-embedding.Q8_0.gguf", EXACT_TYPES, pooling=gguf.PoolingType.LAST,
                      add_eos=True)


def reference(tiny: TinyModel, texts: list[str], pooling: str = "last") -> torch.Tensor:
    """transformers' final hidden states of each text + the eos, pooled and L2-normalised."""
    eos = tiny.tokenizer.id(tiny.tokenizer.specials["eos"])
    out = []
    with torch.inference_mode():
        for text in texts:
            ids = tiny.tokenizer.reference.encode(text, add_special_tokens=False).ids + [eos]
            hidden = tiny.hf_model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            out.append(hidden[-1] if pooling == "last" else hidden.mean(dim=0))
    return F.normalize(torch.stack(out), dim=-1)


def test_the_metadata_names_the_kind(embedder: Path, tiny: TinyModel, tmp_path: Path) -> None:
    spec = load_pooling_spec(embedder)
    assert (model_kind(embedder), spec.kind, spec.pooling, spec.normalize, spec.is_decoder) == \
        (ModelKind.EMBED, ModelKind.EMBED, "last", True, True)
    assert (spec.model_type, spec.hidden_size, spec.max_len) == ("qwen3", 256, 256)
    assert resolve_embedding_path(str(embedder)) == embedder  # EMBEDDING_MODEL_PATH takes it too
    assert embedding_model_name(embedder) == "tiny-qwen3-embedding"
    chat = write_gguf(tiny, tmp_path / "chat.gguf", EXACT_TYPES)
    assert model_kind(chat) is ModelKind.GENERATE
    with pytest.raises(ModelFileError, match="is not a pooling model"):
        resolve_embedding_path(str(chat))
    mean = write_gguf(tiny, tmp_path / "mean.gguf", EXACT_TYPES, pooling=gguf.PoolingType.MEAN)
    assert load_pooling_spec(mean).pooling == "mean"
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(12))  # a truncated header: a one-line error naming the file, never a traceback
    with pytest.raises(ModelFileError, match="junk.gguf"):
        model_kind(junk)


def test_inputs_end_with_the_eos_the_gguf_asks_for(embedder: Path, tiny: TinyModel, tmp_path: Path) -> None:
    plain = tiny.tokenizer.reference.encode(TEXTS[0], add_special_tokens=False).ids
    eos = tiny.tokenizer.id(tiny.tokenizer.specials["eos"])
    assert pooling_tokenizer(embedder).encode(TEXTS[0]).ids == plain + [eos]
    without = write_gguf(tiny, tmp_path / "no-eos.gguf", EXACT_TYPES, pooling=gguf.PoolingType.LAST)
    assert pooling_tokenizer(without).encode(TEXTS[0]).ids == plain


@pytest.mark.parametrize("weights", ["dense", "blocks"])
def test_pooled_as_transformers(embedder: Path, tiny: TinyModel, weights: str) -> None:
    """Dense float32, and the GGUF's blocks on the C++ kernels with int16 activations (as a backend with
    WEIGHT_FORMAT=gguf runs them by default): within 2e-3 of transformers, cosine ≥ 0.9999."""
    spec = load_pooling_spec(embedder)
    if weights == "blocks":
        if kernels.load() is None:
            pytest.skip("C++ kernels unavailable")
        loaded = load_weights(embedder, load_model_config(embedder), torch.float32, CPU, keep_blocks=True,
                              block_layout="n16")  # int16 activations: what ACTIVATIONS=auto serves
        model = DecoderPoolingModel(spec, torch.float32, CPU, loaded, default_ops(CPU, torch.float32, "float32"))
    else:
        model = DecoderPoolingModel(spec, torch.float32, CPU)
    ours = _values(run_task(model, PoolTask.EMBED, *_batch(pooling_tokenizer(embedder), TEXTS)))
    theirs = reference(tiny, TEXTS)
    assert ours.shape == theirs.shape == (len(TEXTS), 256)
    assert (ours - theirs).abs().max() < 2e-3, (ours - theirs).abs().max()
    assert F.cosine_similarity(ours, theirs).min() >= 0.9999


@pytest.fixture(scope="module")
def served(embedder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with pdfusion(embedder, "qwen3-emb", tmp_path_factory.mktemp("served") / "pdfusion.log") as url:
        yield url


def test_served_through_the_openai_client(served: str, tiny: TinyModel) -> None:
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=60)
    data = client.embeddings.create(model="qwen3-emb", input=TEXTS).data
    ours = torch.tensor([d.embedding for d in data])
    assert F.cosine_similarity(ours, reference(tiny, TEXTS)).min() >= 0.9999
    assert abs(math.sqrt(sum(x * x for x in data[0].embedding)) - 1) < 1e-4
    resp = httpx.post(f"{served}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert resp.status_code == 400 and "embed model" in resp.json()["error"]["message"], resp.text


def yes_no(tiny: TinyModel) -> tuple[int, int]:
    """Two ordinary tokens standing in for "yes" and "no" (the reranker's head is their LM-head rows)."""
    return tiny.tokenizer.reference.encode(" yes", add_special_tokens=False).ids[-1], \
        tiny.tokenizer.reference.encode(" no", add_special_tokens=False).ids[-1]


def reference_rerank(tiny: TinyModel, query: str, documents: list[str]) -> torch.Tensor:
    """transformers' LM logits at the prompt's last token: softmax over (yes, no), P(yes) — llama.cpp's score."""
    yes, no = yes_no(tiny)
    out = []
    with torch.inference_mode():
        for doc in documents:
            ids = tiny.tokenizer.reference.encode(qwen3_reranker_prompt(query, doc), add_special_tokens=False).ids
            logits = tiny.hf_model(input_ids=torch.tensor([ids])).logits[0, -1]
            out.append(torch.softmax(torch.stack([logits[yes], logits[no]]), dim=0)[0])
    return torch.stack(out)


def test_a_qwen3_reranker_gguf_scores_as_llama_cpp(tmp_path: Path) -> None:
    """llama.cpp's Qwen3-Reranker conversion (rank, cls.output = the head's yes/no rows, the card's rerank
    template): one logit yes − no at the last token of the card's prompt, served as /v1/rerank's P(yes)."""
    tiny = tiny_model("qwen3", max_positions=1024)  # the card's prompt is ~230 of this tokenizer's tokens
    path = write_gguf(tiny, tmp_path / "qwen3-reranker.gguf", EXACT_TYPES, rerank=yes_no(tiny))
    spec = load_pooling_spec(path)
    assert (model_kind(path), spec.kind, spec.labels, spec.two_way, spec.template) == \
        (ModelKind.CLASSIFY, ModelKind.CLASSIFY, ("yes",), True, "qwen3-reranker")
    query, docs = "what is the capital of france?", TEXTS
    expected = reference_rerank(tiny, query, docs)
    # The three prompts (~700 rows) are a prefill-sized step: on an AMX CPU the default PREFILL_GEMM multiplies
    # it in bfloat16 (P(yes) within ~6e-3, measured); float32 tiles check the formula to the bound below.
    with pdfusion(path, "rerank", tmp_path / "pdfusion.log", env={"PREFILL_GEMM": "float32"}) as url:
        resp = httpx.post(f"{url}/v1/rerank", json={"query": query, "documents": docs}, timeout=60)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    scores = torch.tensor([r["relevance_score"] for r in sorted(body["results"], key=lambda r: r["index"])])
    assert (scores - expected).abs().max() < 2e-3, (scores, expected)
    assert [r["index"] for r in body["results"]] == expected.argsort(descending=True).tolist()


def test_other_decoder_rerankers_are_refused_by_name(tiny: TinyModel, tmp_path: Path) -> None:
    path = write_gguf(tiny, tmp_path / "r.gguf", EXACT_TYPES, pooling=gguf.PoolingType.RANK)
    assert model_kind(path) is ModelKind.CLASSIFY
    with pytest.raises(ModelFileError, match="as llama.cpp writes Qwen3-Reranker"):
        load_pooling_spec(path)
