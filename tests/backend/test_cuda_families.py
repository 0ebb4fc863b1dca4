"""The model paths on a CUDA GPU against transformers on the CPU, same random weights, no embedded model
needed (skipped without a GPU; `make test-cuda` runs them with tests/backend/test_cuda.py and the served
model tests with DEVICE=cuda):

- Llama 3.1, Qwen2.5 and Mistral from their Hugging Face directories through the Engine in float32: the same
  greedy tokens and logits within 2e-3, cold and from the prefix cache;
- the same in bfloat16 (what DEVICE=cuda serves by default), teacher-forced over prompt and continuation;
- LoRA adapters beside the base in one batch against PEFT (float32);
- a BERT encoder's pooled embeddings against transformers (float32), and Nomic BERT (rotary, SwiGLU), XLM-R (a
  Unigram vocabulary) and ModernBERT (windowed layers, GeGLU) as llama.cpp's GGUFs;
- a Qwen2.5-VL image prompt (tower, M-RoPE, then decode) against transformers (float32);
- `kvyard serve` with DEVICE=cuda and its defaults (bfloat16) answering the official openai client.

KVYARD_TEST_DEVICE=cpu runs the file on the CPU (a dry run where no GPU is)."""
from __future__ import annotations

import os
from pathlib import Path

import openai

import pytest
import torch
import torch.nn.functional as F

from backend.encoder import EncoderModel
from backend.gemma_encoder import GemmaEncoderModel
from backend.engine_types import PoolTask
from backend.vision_tower import load_vision_tower
from backend.lora_weights import load_adapter
from backend.model import LlamaModel
from backend.model_runner import DirectChunk, DirectSeq, ModelRunner
from backend.attention import KVCache
from backend.pooling import run_task
from backend.weights import load_weights
from kvyard.model_config import load_model_config
from kvyard.pooling_model import load_pooling_spec
from tests.backend.conftest import build_engine, full_logits
from tests.backend.test_cuda_graphs import decode_all
from tests.backend.test_encoder import SENTENCES, _batch, _tokenizer
from tests.backend.test_lora import ADAPTERS, Setup, prompt
from tests.backend.test_model_families import CASES, STEPS, Case, _build, engine_run, prompt_ids
from tests.backend.test_vision_qwen import Served, assert_close
from tests.backend.test_vision_qwen import engine_run as vision_run
from tests.backend.test_vision_qwen import hf_greedy as vision_greedy
from kvyard.tokenizer import pooling_tokenizer
from tests.support.tiny_embedding_gemma import tiny_embedding_gemma
from tests.support.tiny_encoders import tiny_encoder, write_bert_gguf
from tests.support.procs import RoleProcess, free_port_block
from tests.support.tiny_models import EXACT_TYPES, hf_greedy, save_hf_dir, tiny_model
from tests.support.tiny_qwen_vl import save_qwen_vl_dir, tiny_qwen_vl
from tests.support.tiny_vision import png_bytes

DEVICE = torch.device(os.environ.get("KVYARD_TEST_DEVICE", "cuda"))

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ATOL = 2e-3  # float32, as on the CPU
# bfloat16 weights and activations against float32. Measured with KVYARD_TEST_DEVICE=cpu: agreement 0.96-0.98,
# largest error 0.022-0.026 of the largest logit.
BF16_AGREEMENT, BF16_REL = 0.9, 0.08


def load(path: Path, dtype: torch.dtype) -> LlamaModel:
    config = load_model_config(path)
    model = LlamaModel(config, load_weights(path, config, dtype, DEVICE, progress=False))
    assert model.device.type == DEVICE.type and model.dtype == dtype
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    return _build(request.param, tmp_path_factory.mktemp(request.param), EXACT_TYPES)


def test_float32_engine_matches_transformers(case: Case) -> None:
    model = load(case.hf_dir, torch.float32)
    ids = prompt_ids(case.tiny)
    theirs, their_logits = hf_greedy(case.tiny.hf_model, ids, STEPS)
    engine = build_engine(model, model.config, num_blocks=32, block_size=16, max_num_batched_tokens=24,
                          long_prefill_token_threshold=16)
    assert engine.runner.cache.data.device.type == DEVICE.type
    for request_id, reused in (("cold", 0), ("cached", 32)):
        ours, our_logits, reuse = engine_run(engine, request_id, ids, STEPS)
        assert (ours, reuse) == (theirs, reused), request_id
        diff = max(float((a.float().cpu() - b).abs().max()) for a, b in zip(our_logits, their_logits))
        assert diff <= ATOL, f"{request_id}: max |logit diff| {diff:.2e}"
    if DEVICE.type == "cuda":  # the decode steps above replayed CUDA graphs
        assert model.graphs is not None and model.graphs.enabled and model.graphs.num_graphs > 0


def test_cuda_graphs_replay_the_eager_steps(tmp_path: Path) -> None:
    """Five sequences of different lengths decoding together (batches padded to 8 and 4 rows, block tables
    to powers of two, a sliding window) through CUDA graphs and op by op: the same tokens and logits."""
    if DEVICE.type != "cuda":
        pytest.skip("CUDA graphs need the GPU (tests/backend/test_cuda_graphs.py runs the padding on the CPU)")
    path = save_hf_dir(tiny_model("mistral", sliding_window=24, max_positions=128), tmp_path / "mistral")
    config = load_model_config(path)
    weights = load_weights(path, config, torch.float32, DEVICE, progress=False)
    graphed, eager = LlamaModel(config, weights), LlamaModel(config, dict(weights), cuda_graphs=False)
    assert eager.graphs is None and graphed.graphs is not None
    want_tokens, want_logits = decode_all(build_engine(eager, config, num_blocks=64))
    tokens, logits = decode_all(build_engine(graphed, config, num_blocks=64))
    assert graphed.graphs.enabled and graphed.graphs.num_graphs >= 4, graphed.graphs._graphs.keys()
    assert tokens == want_tokens
    worst = max(float((a - b).abs().max()) for r in want_logits for a, b in zip(want_logits[r], logits[r]))
    print(f"CUDA graphs against eager steps: {graphed.graphs.num_graphs} graphs, max |logit diff| {worst:.2e}")
    assert worst <= ATOL


def test_bfloat16_teacher_forced(case: Case) -> None:
    """Every position of the prompt and transformers' greedy continuation in one cold bfloat16 prefill:
    top-1 agreement and the largest logit error against the largest logit."""
    model = load(case.hf_dir, torch.bfloat16)
    ids = prompt_ids(case.tiny)
    ids += hf_greedy(case.tiny.hf_model, ids, STEPS)[0]
    with torch.inference_mode():
        theirs = case.tiny.hf_model(input_ids=torch.tensor([ids])).logits[0].float()
    ours = full_logits(model, model.config, ids).float().cpu()
    agreement = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    rel = float((ours - theirs).abs().max() / theirs.abs().max())
    print(f"{case.hf_dir.name} bfloat16 on {DEVICE.type}: agreement {agreement:.3f}, max error {rel:.3f} of the largest logit")
    assert agreement >= BF16_AGREEMENT and rel <= BF16_REL


def test_lora_batch_matches_peft(tmp_path: Path) -> None:
    """Each adapter and the base in one batch: a 24-token prefill per row, then four decode steps."""
    setup = Setup(tmp_path)
    model = load(setup.hf_dir, torch.float32)
    adapters = {n: load_adapter(n, p, model.config, torch.float32, DEVICE) for n, p in setup.paths.items()}
    names: list[str | None] = [*ADAPTERS, None]
    c, n_prompt, steps = model.config, 24, 4
    runner = ModelRunner(model, KVCache(c.num_layers, 4 * len(names), 16, c.num_kv_heads, c.head_dim, torch.float32,
                                        DEVICE))
    seqs = [DirectSeq(prompt(j, n_prompt + steps, c.vocab_size), list(range(4 * j, 4 * j + 4)),
                      () if name is None else (adapters[name],)) for j, name in enumerate(names)]
    prefill = runner.run([DirectChunk(s, 0, n_prompt) for s in seqs], [list(range(n_prompt))] * len(seqs)).cpu()
    decodes = [runner.run([DirectChunk(s, n_prompt + t, 1) for s in seqs]).cpu() for t in range(steps)]
    for j, (name, seq) in enumerate(zip(names, seqs)):
        ours = torch.cat([prefill[j * n_prompt:(j + 1) * n_prompt], *(d[j:j + 1] for d in decodes)])
        diff = float((ours - setup.reference(name, seq.token_ids)).abs().max())
        assert diff <= ATOL, f"{name}: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("arch, as_gguf", [("BertModel", False), ("NomicBertModel", True),
                                           ("XLMRobertaModel", True), ("ModernBertModel", True), ("MPNetModel", False),
                                           ("DistilBertModel", False), ("GteModel", False)])
def test_encoders_match_transformers(tmp_path: Path, arch: str, as_gguf: bool) -> None:
    """Each encoder family's steps on the device: BERT from its directory; as llama.cpp's GGUFs, rotary positions
    and SwiGLU (Nomic BERT), the Unigram vocabulary's ids and one segment type (XLM-R), pre-norm, windowed layers
    and GeGLU (ModernBERT); MPNet's relative-position bias, DistilBERT's names, GTE's rotary GeGLU layers from their
    directories; mean-pooled and normalised, against transformers on the CPU."""
    import transformers
    hf = tiny_encoder(tmp_path / "hf", arch=arch, unigram=arch.startswith(("XLM", "Gte")))
    path = write_bert_gguf(hf, tmp_path / "model.gguf") if as_gguf else hf
    ids, types, mask = _batch(pooling_tokenizer(path) if as_gguf else _tokenizer(path), SENTENCES)
    pooled = run_task(EncoderModel(load_pooling_spec(path), torch.float32, DEVICE), PoolTask.EMBED,
                      ids.to(DEVICE), types.to(DEVICE), mask.to(DEVICE))
    ours = torch.tensor([p.values for p in pooled])
    with torch.no_grad():
        hidden = transformers.AutoModel.from_pretrained(hf).eval()(
            input_ids=ids, attention_mask=mask.long(),
            **({"token_type_ids": types} if arch in ("BertModel", "NomicBertModel", "XLMRobertaModel") else {})).last_hidden_state
    m = mask.unsqueeze(-1).float()
    ref = F.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)
    assert F.cosine_similarity(ours, ref).min() >= 0.99999
    assert torch.allclose(ours, ref, atol=1e-4)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.03)])
def test_embedding_gemma_matches_sentence_transformers(tmp_path: Path, dtype: torch.dtype, atol: float) -> None:
    """EmbeddingGemma's encoder (grouped heads, the window, Gemma's norms, two Dense projections) on the device,
    float32 and bfloat16, against sentence-transformers on the CPU in float32."""
    from sentence_transformers import SentenceTransformer
    hf = tiny_embedding_gemma(tmp_path / "gemma")
    ids, types, mask = _batch(pooling_tokenizer(hf), SENTENCES)
    pooled = run_task(GemmaEncoderModel(load_pooling_spec(hf), dtype, DEVICE), PoolTask.EMBED,
                      ids.to(DEVICE), types.to(DEVICE), mask.to(DEVICE))
    ours = torch.tensor([p.values for p in pooled])
    ref = torch.from_numpy(SentenceTransformer(str(hf), device="cpu").encode(SENTENCES))
    assert F.cosine_similarity(ours, ref).min() >= (0.99999 if dtype == torch.float32 else 0.999)
    assert (ours - ref).abs().max() < atol


def test_a_modernbert_classifier_matches_transformers(tmp_path: Path) -> None:
    import transformers
    hf = tiny_encoder(tmp_path / "ce", arch="ModernBertForSequenceClassification", num_labels=3, classifier_pooling="mean")
    ids, types, mask = _batch(pooling_tokenizer(hf), SENTENCES[:3], SENTENCES[3:6])
    logits = run_task(EncoderModel(load_pooling_spec(hf), torch.float32, DEVICE), PoolTask.CLASSIFY,
                      ids.to(DEVICE), types.to(DEVICE), mask.to(DEVICE))
    ours = torch.tensor([p.values for p in logits])
    with torch.no_grad():
        ref = transformers.ModernBertForSequenceClassification.from_pretrained(hf).eval()(
            input_ids=ids, attention_mask=mask.long()).logits
    assert torch.allclose(ours, ref, atol=1e-4)


class DeviceServed(Served):
    """The tiny Qwen2.5-VL loaded on DEVICE (float32), as a backend with DEVICE set loads it."""

    def __init__(self, path: Path) -> None:
        self.tiny, self.path = tiny_qwen_vl("qwen2_5_vl"), path
        save_qwen_vl_dir(self.tiny, path)
        self.config = load_model_config(path)
        self.model = load(path, torch.float32)
        self.tower = load_vision_tower(path, self.config, torch.float32, DEVICE)
        self.vision = self.config.vision


def test_qwen_vl_image_prompt_matches_transformers(tmp_path: Path) -> None:
    served = DeviceServed(tmp_path / "qwen2_5_vl")
    data = png_bytes(140, 84, seed=1)
    ids = served.prompt(data)
    theirs, their_logits = vision_greedy(served, ids, data)
    ours, our_logits, _ = vision_run(served.engine(), "cold", ids, [served.image(data)])
    assert_close([x.float().cpu() for x in our_logits], their_logits, "cold")
    assert ours == theirs


def test_served_with_its_defaults(tmp_path: Path) -> None:
    """A user's `DEVICE=cuda kvyard serve`: bfloat16 weights and cache on the GPU, chat and streaming answered."""
    path = save_hf_dir(tiny_model("qwen2", tie=True), tmp_path / "tiny-qwen2")
    port = free_port_block()
    proc = RoleProcess({"CHECKPOINT_PATH": str(path), "START_PORT": str(port), "KV_CACHE_MB": "64",
                        "DEVICE": DEVICE.type}, tmp_path / "serve.log")
    try:
        proc.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=180)
        want = "float32" if DEVICE.type == "cpu" else "bfloat16"
        proc.wait_for_log(f"activations, on {DEVICE.type} in {want}")
        if DEVICE.type == "cuda":
            proc.wait_for_log("decode steps: CUDA graphs")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        kwargs = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
                  "temperature": 0, "extra_body": {"ignore_eos": True}}
        body = client.chat.completions.create(**kwargs)
        assert body.usage.completion_tokens == 8 and body.choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                           if c.choices)
        assert streamed == body.choices[0].message.content
    finally:
        proc.stop()
