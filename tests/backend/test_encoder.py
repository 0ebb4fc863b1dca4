"""The encoder family (backend/encoder.py) and pooling against transformers and sentence-transformers on the
same weights: the embedded all-MiniLM-L6-v2, tiny random BERT / XLM-R checkpoints and their heads."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from backend.encoder import EncoderModel
from backend.engine_loop import EngineLoop
from backend.engine_types import PoolingRequest, PoolItem, PoolTask
from backend.pooling import run_task
from backend.pooling_engine import PoolingEngine
from kvyard.errors import ErrorCode, RequestError
from kvyard.pooling_model import ModelKind, embedded_embedding_path, load_pooling_spec
from tests.support.tiny_encoders import tiny_encoder

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SENTENCES = ["A man is eating food.", "The quick brown fox jumps over the lazy dog near the river bank.",
             "Sentence embeddings", "Ein Mann isst Essen; un homme mange. 你好，世界 🤖",
             "short", "word " * 40]


def _tokenizer(path: Path) -> Tokenizer:
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok


def _batch(tok: Tokenizer, texts: list[str], pairs: list[str] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    encs = [tok.encode(t, p) if pairs else tok.encode(t) for t, p in zip(texts, pairs or texts)]
    T = max(len(e.ids) for e in encs)
    ids = torch.zeros(len(encs), T, dtype=torch.long)
    types = torch.zeros_like(ids)
    mask = torch.zeros(len(encs), T, dtype=torch.bool)
    for b, e in enumerate(encs):
        ids[b, :len(e.ids)] = torch.tensor(e.ids)
        types[b, :len(e.ids)] = torch.tensor(e.type_ids)
        mask[b, :len(e.ids)] = True
    return ids, types, mask


def _values(pooled: list) -> torch.Tensor:
    return torch.tensor([p.values for p in pooled])


def test_embedded_minilm_matches_sentence_transformers() -> None:
    from sentence_transformers import SentenceTransformer
    path = embedded_embedding_path()
    spec = load_pooling_spec(path)
    assert (spec.kind, spec.pooling, spec.normalize, spec.max_len) == (ModelKind.EMBED, "mean", True, 256)
    ours = _values(run_task(EncoderModel(spec, torch.float32, torch.device("cpu")), PoolTask.EMBED,
                            *_batch(_tokenizer(path), SENTENCES)))
    theirs = torch.from_numpy(SentenceTransformer(str(path), device="cpu").encode(SENTENCES))
    assert ours.shape == theirs.shape == (len(SENTENCES), 384)
    assert F.cosine_similarity(ours, theirs).min() >= 0.9999
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)


def test_bfloat16_on_a_cpu_multiplies_in_bfloat16_and_keeps_the_rest_float32() -> None:
    """DTYPE=bfloat16 on a CPU: the layers' matrices in bfloat16 (AMX-BF16 tiles where the CPU has them), x
    rounded to bfloat16 for each GEMM with its rows padded to ROW_BUCKET (so batches reuse oneDNN's GEMMs), the
    rest float32. Within 1e-4 in cosine of sentence-transformers' float32 (measured 0.99998; whole-model
    bfloat16, as sentence-transformers or vLLM run it, gave 0.99994 on a longer corpus), and each row's answer
    the same alone as in the batch (the padding rows are zeros, never mixed into a real row)."""
    from sentence_transformers import SentenceTransformer

    from backend import encoder
    path = embedded_embedding_path()
    model = EncoderModel(load_pooling_spec(path), torch.bfloat16, torch.device("cpu"))
    assert model.w["encoder.layer.0.qkv.weight"].dtype == torch.bfloat16
    assert model.w["encoder.layer.0.qkv.bias"].dtype == model.w["embeddings.LayerNorm.weight"].dtype == torch.float32
    tok = _tokenizer(path)
    batch = _batch(tok, SENTENCES)
    assert int(batch[2].sum()) % encoder.ROW_BUCKET != 0  # the padding is exercised
    ours = _values(run_task(model, PoolTask.EMBED, *batch))
    theirs = torch.from_numpy(SentenceTransformer(str(path), device="cpu").encode(SENTENCES))
    assert F.cosine_similarity(ours, theirs).min() >= 0.9999
    assert F.cosine_similarity(ours, theirs).min() < 1 - 1e-7  # bfloat16 GEMMs: not float32's answer
    alone = _values(run_task(model, PoolTask.EMBED, *_batch(tok, SENTENCES[1:2])))
    assert F.cosine_similarity(alone, ours[1:2]).min() >= 0.99999


def _avx512_kernels():  # the compiled kernels where they run AVX-512, else None
    from backend import kernels
    module = kernels.load()
    return module if module is not None and module.has_avx512() else None


def test_the_fused_residual_step_matches_torch() -> None:
    """residual_norm_bf16: LayerNorm(bfloat16 GEMM output + bias + residual) in place, its bfloat16 copy the
    rounding torch gives the result, the padding rows zero; bad shapes and dtypes are refused."""
    module = _avx512_kernels()
    if module is None:
        pytest.skip("the kernels' AVX-512 code does not run here")
    g = torch.Generator().manual_seed(0)
    n, padded, D = 45, 64, 384
    y = (torch.randn(padded, D, generator=g) * 3).bfloat16()
    bias, x0, w, b = (torch.randn(D, generator=g), torch.randn(n, D, generator=g) * 5 + 2,
                      torch.randn(D, generator=g), torch.randn(D, generator=g))
    reference = F.layer_norm(y[:n].float() + bias + x0, (D,), w, b, 1e-12)
    x, xb = x0.clone(), torch.full((padded, D), 7.0, dtype=torch.bfloat16)
    module.residual_norm_bf16(y, bias, x, w, b, 1e-12, xb)
    assert torch.allclose(x, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(xb[:n], x.bfloat16()) and not xb[n:].any()
    x2 = x0.clone()
    module.residual_norm_bf16(y, bias, x2, w, b, 1e-12)  # no copy asked
    assert torch.equal(x2, x)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        module.residual_norm_bf16(y[:, :40].contiguous(), bias[:40], x0[:, :40].contiguous(), w[:40], b[:40], 1e-12)
    with pytest.raises(RuntimeError, match="bfloat16"):
        module.residual_norm_bf16(y.float(), bias, x0.clone(), w, b, 1e-12)
    with pytest.raises(RuntimeError, match="bfloat16"):
        module.residual_norm_bf16(y[:n - 1].contiguous(), bias, x0.clone(), w, b, 1e-12)


def test_bfloat16_layers_take_the_fused_residual_step_with_torchs_answer() -> None:
    """A CPU's DTYPE=bfloat16 BERT takes the one-pass residual step where the kernels run AVX-512. Its sums run
    in another order than torch's LayerNorm, so a few bfloat16 copies round the other way and the two paths
    differ at bfloat16's noise (cosine 0.99999 measured), each as close to float32 sentence-transformers as the
    other (0.999982 and 0.999981)."""
    from sentence_transformers import SentenceTransformer
    model = EncoderModel(load_pooling_spec(embedded_embedding_path()), torch.bfloat16, torch.device("cpu"))
    if _avx512_kernels() is None:
        assert model._fused_norm is None
        pytest.skip("the kernels' AVX-512 code does not run here")
    assert model._fused_norm is not None
    batch = _batch(_tokenizer(embedded_embedding_path()), SENTENCES)
    fused = _values(run_task(model, PoolTask.EMBED, *batch))
    model._fused_norm = None
    unfused = _values(run_task(model, PoolTask.EMBED, *batch))
    assert F.cosine_similarity(fused, unfused).min() >= 0.99998
    theirs = torch.from_numpy(SentenceTransformer(str(embedded_embedding_path()), device="cpu").encode(SENTENCES))
    assert F.cosine_similarity(fused, theirs).min() >= F.cosine_similarity(unfused, theirs).min() - 1e-5
    assert EncoderModel(load_pooling_spec(embedded_embedding_path()), torch.float32,
                        torch.device("cpu"))._fused_norm is None  # float32 matrices: torch's ops as before


@pytest.mark.parametrize(("arch", "unigram"), [("BertModel", False), ("XLMRobertaModel", True), ("GteModel", True),
                                               ("NomicBertModel", False), ("DistilBertModel", False),
                                               ("MPNetModel", False)])
def test_every_post_norm_family_takes_the_fused_step_alike(tmp_path: Path, arch: str, unigram: bool) -> None:
    """The families whose layers end in LayerNorm(x + sublayer) (biases or none, GeGLU / SwiGLU, rotary or
    learned positions, MPNet's relative bias) take the one-pass residual step in bfloat16 with torch's answer."""
    if _avx512_kernels() is None:
        pytest.skip("the kernels' AVX-512 code does not run here")
    path = tiny_encoder(tmp_path / "enc", arch=arch, unigram=unigram)
    model = EncoderModel(load_pooling_spec(path), torch.bfloat16, torch.device("cpu"))
    assert model._fused_norm is not None
    batch = _batch(_tokenizer(path), SENTENCES)
    fused = _values(run_task(model, PoolTask.EMBED, *batch))
    model._fused_norm = None
    assert F.cosine_similarity(fused, _values(run_task(model, PoolTask.EMBED, *batch))).min() >= 0.9999


@pytest.mark.parametrize("pooling", ["mean_tokens", "cls_token", "max_tokens", "mean_sqrt_len_tokens"])
def test_tiny_bert_pooling_matches_transformers(tmp_path: Path, pooling: str) -> None:
    import transformers
    path = tiny_encoder(tmp_path / "bert", pooling=pooling, normalize=False)
    spec = load_pooling_spec(path)
    ids, types, mask = _batch(_tokenizer(path), SENTENCES[:5], ["a second text"] * 5)  # pairs: segment ids
    ours = _values(run_task(EncoderModel(spec, torch.float32, torch.device("cpu")), PoolTask.EMBED,
                            ids, types, mask))
    with torch.no_grad():
        hidden = transformers.BertModel.from_pretrained(path).eval()(
            input_ids=ids, token_type_ids=types, attention_mask=mask.long()).last_hidden_state
    m = mask.unsqueeze(-1).float()
    ref = {"mean_tokens": (hidden * m).sum(1) / m.sum(1), "cls_token": hidden[:, 0],
           "max_tokens": hidden.masked_fill(~mask.unsqueeze(-1), -1e9).amax(1),
           "mean_sqrt_len_tokens": (hidden * m).sum(1) / m.sum(1).sqrt()}[pooling]
    assert F.cosine_similarity(ours, ref).min() >= 0.9999
    assert torch.allclose(ours, ref, atol=1e-4)


def test_tiny_xlm_roberta_matches_transformers(tmp_path: Path) -> None:
    import transformers
    path = tiny_encoder(tmp_path / "xlmr", arch="XLMRobertaModel", pooling="cls_token", normalize=True)
    ids, types, mask = _batch(_tokenizer(path), SENTENCES)
    ours = _values(run_task(EncoderModel(load_pooling_spec(path), torch.float32, torch.device("cpu")),
                            PoolTask.EMBED, ids, types, mask))
    with torch.no_grad():
        hidden = transformers.XLMRobertaModel.from_pretrained(path).eval()(
            input_ids=ids, attention_mask=mask.long()).last_hidden_state
    assert F.cosine_similarity(ours, F.normalize(hidden[:, 0], dim=-1)).min() >= 0.9999


def _engine(path: Path, max_num_seqs: int = 4, max_num_batched_tokens: int = 64) -> PoolingEngine:
    model = EncoderModel(load_pooling_spec(path), torch.float32, torch.device("cpu"))
    return PoolingEngine(model, "tiny", max_num_seqs, max_num_batched_tokens)


def test_engine_batches_inputs_across_requests_and_steps(tmp_path: Path) -> None:
    """Inputs of two requests share steps within the budget; each answer equals the input run alone."""
    path = tiny_encoder(tmp_path / "bert")
    engine = _engine(path)
    tok = _tokenizer(path)
    items = [PoolItem(tok.encode(t).ids) for t in SENTENCES[:5]]
    engine.add(PoolingRequest("a", items[:3], PoolTask.EMBED))
    engine.add(PoolingRequest("b", items[3:], PoolTask.EMBED))
    results, steps = {}, 0
    while engine.has_work:
        steps += 1
        results.update({r.request_id: r for r in engine.step()})
    assert 2 <= steps <= 5 and set(results) == {"a", "b"}
    assert results["a"].aux.iter_count >= 1 and results["a"].aux.input_len == sum(len(i.token_ids) for i in items[:3])
    alone = [run_task(engine.model, PoolTask.EMBED, torch.tensor([it.token_ids]), torch.zeros(1, len(it.token_ids),
                      dtype=torch.long), torch.ones(1, len(it.token_ids), dtype=torch.bool))[0] for it in items]
    got = [*results["a"].outputs, *results["b"].outputs]
    assert torch.allclose(_values(got), _values(alone), atol=1e-5)
    assert engine.worker_status(True).model_kind is ModelKind.EMBED


def test_engine_refuses_what_it_cannot_serve(tmp_path: Path) -> None:
    engine = _engine(tiny_encoder(tmp_path / "bert", max_seq_length=16))
    cases = [(PoolingRequest("x", [PoolItem(list(range(101, 120)))], PoolTask.EMBED), ErrorCode.CONTEXT_LENGTH_EXCEEDED),
             (PoolingRequest("x", [PoolItem([101, 10**6])], PoolTask.EMBED), ErrorCode.INVALID_ARGUMENT),
             (PoolingRequest("x", [PoolItem([])], PoolTask.EMBED), ErrorCode.INVALID_ARGUMENT),
             (PoolingRequest("x", [PoolItem([101, 102])], PoolTask.SPARSE), ErrorCode.INVALID_ARGUMENT),
             (PoolingRequest("x", [PoolItem([101, 102])], PoolTask.CLASSIFY), ErrorCode.INVALID_ARGUMENT)]
    for req, code in cases:
        with pytest.raises(RequestError) as info:
            engine.validate(req)
        assert info.value.code is code
    assert "sparse" in str(PoolTask.SPARSE) and engine.spec.heads == ("dense",)


def test_engine_loop_pools_and_aborts(tmp_path: Path) -> None:
    """Through the engine thread: a result; a caller that leaves takes its inputs out of the queue."""
    path = tiny_encoder(tmp_path / "bert")
    loop = EngineLoop(_engine(path, max_num_seqs=1), model_name="tiny")
    loop.start()

    async def main() -> None:
        result = await loop.pool(PoolingRequest("one", [PoolItem([101, 2023, 102])], PoolTask.EMBED))
        assert len(result.outputs) == 1 and len(result.outputs[0].values) == 32
        many = asyncio.create_task(loop.pool(PoolingRequest("many", [PoolItem([101, 2023, 102])] * 500,
                                                            PoolTask.EMBED)))
        await asyncio.sleep(0.05)
        many.cancel()
        with pytest.raises(asyncio.CancelledError):
            await many
        for _ in range(100):
            if loop.worker_status().waiting == 0:
                break
            await asyncio.sleep(0.02)
        assert loop.worker_status().waiting == 0
        with pytest.raises(RequestError, match="cannot generate"):
            from backend.engine_types import GenerationRequest
            from backend.sampler import SamplingParams
            from backend.sequence import StopConditions
            async for _ in loop.generate(GenerationRequest("g", [101], SamplingParams(), StopConditions(max_new_tokens=1))):
                pass

    try:
        asyncio.run(main())
    finally:
        loop.stop()


@pytest.mark.parametrize("arch", ["BertForSequenceClassification", "XLMRobertaForSequenceClassification"])
@pytest.mark.parametrize("num_labels", [1, 3])
def test_tiny_cross_encoder_logits_match_transformers(tmp_path: Path, arch: str, num_labels: int) -> None:
    """Query-document pairs (segment ids for BERT) → the classifier's logits, within 1e-4."""
    import transformers
    path = tiny_encoder(tmp_path / "ce", arch=arch, num_labels=num_labels)
    spec = load_pooling_spec(path)
    assert spec.kind is ModelKind.CLASSIFY and len(spec.labels) == num_labels
    ids, types, mask = _batch(_tokenizer(path), ["what is the capital of france?"] * 4, SENTENCES[:4])
    ours = _values(run_task(EncoderModel(spec, torch.float32, torch.device("cpu")), PoolTask.CLASSIFY,
                            ids, types, mask))
    ref_model = getattr(transformers, arch).from_pretrained(path).eval()
    extra = {"token_type_ids": types} if arch.startswith("Bert") else {}
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=mask.long(), **extra).logits
    assert ours.shape == ref.shape == (4, num_labels)
    assert torch.allclose(ours, ref, atol=1e-4)


def test_bge_m3_sparse_and_colbert_heads(tmp_path: Path) -> None:
    """BGE-M3's documented formulas, written out by hand: lexical weights = relu(sparse_linear(h)) per token,
    the largest per token id, zeros left out; ColBERT = normalize(colbert_linear(h[1:])) for the real tokens."""
    import transformers
    path = tiny_encoder(tmp_path / "m3", arch="XLMRobertaModel", pooling="cls_token", normalize=True, bge_m3=True)
    spec = load_pooling_spec(path)
    assert spec.heads == ("dense", "sparse", "colbert")
    model = EncoderModel(spec, torch.float32, torch.device("cpu"))
    texts = ["the the cat sat on the mat", "a dog"]
    ids, types, mask = _batch(_tokenizer(path), texts)
    with torch.no_grad():
        hidden = transformers.XLMRobertaModel.from_pretrained(path).eval()(
            input_ids=ids, attention_mask=mask.long()).last_hidden_state
    sparse_w = torch.load(path / "sparse_linear.pt")
    colbert_w = torch.load(path / "colbert_linear.pt")
    sparse = run_task(model, PoolTask.SPARSE, ids, types, mask)
    colbert = run_task(model, PoolTask.COLBERT, ids, types, mask)
    for b in range(len(texts)):
        n = int(mask[b].sum())
        weights = torch.relu(hidden[b, :n] @ sparse_w["weight"].T + sparse_w["bias"]).squeeze(-1)
        expected: dict[int, float] = {}
        for t, w in zip(ids[b, :n].tolist(), weights.tolist()):
            if w > expected.get(t, 0.0):
                expected[t] = w
        got = dict(zip(sparse[b].token_ids, sparse[b].values))
        assert got.keys() == expected.keys() and all(abs(got[k] - expected[k]) < 1e-4 for k in got)
        vecs = F.normalize(hidden[b, 1:n] @ colbert_w["weight"].T + colbert_w["bias"], dim=-1)
        assert colbert[b].rows == n - 1
        assert torch.allclose(torch.tensor(colbert[b].values).view(n - 1, -1), vecs, atol=1e-4)
