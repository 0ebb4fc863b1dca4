"""The default CPU serving format (the GGUF's own Q4_1/Q8_0 blocks, C++ kernels, float32 activations)
keeps the model's answers: same numbers as the float32 reference up to rounding, ~5x less memory."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from backend import kernels, ops
from backend.attention import KVCache
from backend.engine import Engine, GenerationRequest
from backend.engine_types import TokenOutput
from backend.model import LlamaModel
from backend.model_runner import DirectChunk, DirectSeq, ModelRunner
from backend.ops import TorchOps
from kvyard.sampling_params import SamplingParams
from backend.sequence import StopConditions
from backend.weights import load_weights
from kvyard.model_config import ModelConfig
from kvyard.tokenizer import TextTokenizer
from tests.backend.conftest import BLOCK_LAYOUTS, CPU, full_logits

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(kernels.load() is None, reason="C++ kernels unavailable")]

TEXT = Path(__file__).parent / "data" / "ordinary_text.txt"
FLOAT16_KV_MAX_LOGIT_DIFF = 0.05  # measured 0.020 (agreement 1.00, KL 3e-7 over 610 positions), 2026-11-24
# How far each activation format's logits may stray from the float32 reference. float32: the same numbers
# up to the order of additions (measured 6e-5). int16 (each 32 activations rounded to 16 bits with their
# own scale, the default where the CPU has AVX-512 VNNI): measured 0.019 prefill and 0.022 decoding with
# the float16 KV cache, top-1 agreement 1.00, KL 4e-7 over 626 tokens (2026-11-24); bound at ~2.5x.
MAX_LOGIT_DIFF = {"rows": 2e-3, "n16": 0.05}
# measured 0.30, top-1 agreement 0.995 over 640 tokens (2026-11-26); 0.48 and 0.994 with the attention of chunks
# of 256 rows or more on bfloat16 tiles as well (2026-11-28)
BF16_PREFILL_MAX_LOGIT_DIFF = 0.75


@pytest.fixture(scope="module", params=BLOCK_LAYOUTS)
def model_blocks(request: pytest.FixtureRequest, model_path: Path, model_config: ModelConfig) -> LlamaModel:
    """The GGUF blocks as the kernels read them: "rows" (float32 activations) and, where the CPU has
    AVX-512 VNNI, "n16" (int16 activations, the default there)."""
    return LlamaModel(model_config, load_weights(model_path, model_config, torch.float32, CPU, keep_blocks=True,
                                                 block_layout=request.param))


def layout_of(model: LlamaModel) -> str:
    return model.w["layers.0.qkv"].layout  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def model_reference(model_config: ModelConfig, weights_f32: dict[str, torch.Tensor]) -> LlamaModel:
    """Dense float32 weights through plain PyTorch ops: what transformers computes (test_reference.py)."""
    return LlamaModel(model_config, weights_f32, ops=TorchOps())


def test_blocks_are_kept_and_small(model_blocks: LlamaModel, model_reference: LlamaModel) -> None:
    assert type(model_blocks.ops).__name__ == "KernelOps"
    assert model_blocks.weight_bytes() * 4 < model_reference.weight_bytes()


def test_teacher_forced_agreement_with_float32(model_blocks: LlamaModel, model_reference: LlamaModel,
                                              model_config: ModelConfig, tokenizer: TextTokenizer) -> None:
    """Top-1 agreement >= 0.98 over >= 500 tokens of ordinary text (the issue's quality bar); in fact
    1.00 for both activation formats with float32 prefill tiles (0.998, logits within 0.019, where the CPU's
    default PREFILL_GEMM is int16), with the logits as close as MAX_LOGIT_DIFF says."""
    ids = tokenizer.encode(TEXT.read_text())[:640]
    assert len(ids) >= 500
    assert model_blocks.attention_tiles == (max_logit_diff(model_blocks) == BF16_PREFILL_MAX_LOGIT_DIFF)
    got = full_logits(model_blocks, model_config, ids)
    want = full_logits(model_reference, model_config, ids)
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agreement >= 0.98, agreement
    assert (got - want).abs().max().item() < max_logit_diff(model_blocks)


def max_logit_diff(model: LlamaModel) -> float:
    """The bound for the model's own prefill path: an AMX CPU's default PREFILL_GEMM multiplies n16 prefill
    chunks in bfloat16 (measured there 0.33, agreement 0.998), elsewhere its layout's bound."""
    if layout_of(model) == "n16" and getattr(model.ops, "n16_gemm", None) is torch.bfloat16:
        return BF16_PREFILL_MAX_LOGIT_DIFF
    return MAX_LOGIT_DIFF[layout_of(model)]


@pytest.mark.parametrize("gemm, max_diff", [("bfloat16", BF16_PREFILL_MAX_LOGIT_DIFF), ("int16", MAX_LOGIT_DIFF["n16"])])
def test_prefill_gemm_keeps_the_answers(model_blocks: LlamaModel, model_reference: LlamaModel,
                                        model_config: ModelConfig, tokenizer: TextTokenizer, gemm: str,
                                        max_diff: float) -> None:
    """PREFILL_GEMM=bfloat16 (the default where the CPU has AMX-BF16: prefill chunks multiply x and each
    dequantized weight tile in bfloat16, oneDNN; emulated, slowly, elsewhere) and PREFILL_GEMM=int16 (the
    default on Sapphire/Emerald Rapids without AMX: the decode kernels at prefill sizes, each group's weights
    decoded once). The same bar over a >= 500-token prefill, which takes that path in every layer."""
    if layout_of(model_blocks) != "n16":
        pytest.skip("PREFILL_GEMM applies to the int16-activation (n16) layout")
    model = LlamaModel(model_config, model_blocks.w, ops=ops.KernelOps(kernels.load(), gemm))
    # Long chunks attend on bfloat16 tiles too where the linears multiply there (AMX-BF16).
    assert model.attention_tiles == (gemm == "bfloat16" and model.ops.bf16_tiles)
    ids = tokenizer.encode(TEXT.read_text())[:640]
    assert len(ids) >= ops.N16_GEMM_ROWS and len(ids) >= 500
    got = full_logits(model, model_config, ids)
    want = full_logits(model_reference, model_config, ids)
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    diff = (got - want).abs().max().item()
    print(f"{gemm} prefill GEMM: top-1 agreement {agreement:.4f}, max logit diff {diff:.3f}")
    assert agreement >= 0.98, agreement
    assert diff < max_diff, diff


def decode_logits(model: LlamaModel, config: ModelConfig, token_ids: list[int], start: int,
                  kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits [len - start, V] of positions start.. computed the way one stream decodes: a prefill of
    token_ids[:start], then one single-row step per token (the kernels' one-row linears and decode
    attention, not the prefill's dequantize-and-GEMM)."""
    block_size = 16
    num_blocks = -(-len(token_ids) // block_size)
    cache = KVCache(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                    kv_dtype, model.device)
    runner, seq = ModelRunner(model, cache), DirectSeq(list(token_ids), list(range(num_blocks)))
    runner.run([DirectChunk(seq, 0, start, samples=False)], [[]])
    return torch.cat([runner.run([DirectChunk(seq, i, 1)]) for i in range(start, len(token_ids))])


def test_decode_steps_agree_with_float32(model_blocks: LlamaModel, model_reference: LlamaModel,
                                         model_config: ModelConfig, tokenizer: TextTokenizer) -> None:
    """The same bar for the single-stream decode path: top-1 agreement >= 0.98 over >= 500 decoded
    positions, logits as close as the prefill's."""
    ids = tokenizer.encode(TEXT.read_text())[:640]
    start = 16
    got = decode_logits(model_blocks, model_config, ids, start)
    want = full_logits(model_reference, model_config, ids)[start:]
    assert len(got) >= 500
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agreement >= 0.98, agreement
    assert (got - want).abs().max().item() < MAX_LOGIT_DIFF[layout_of(model_blocks)]  # a 16-token prefill: no GEMM path


def test_float16_kv_cache_keeps_the_answers(model_blocks: LlamaModel, model_reference: LlamaModel,
                                            model_config: ModelConfig, tokenizer: TextTokenizer) -> None:
    """What a CPU backend serves by default: the blocks and a float16 KV cache (KV_CACHE_DTYPE=auto).
    Keys and values keep 11 significant bits: the same bar, top-1 agreement >= 0.98 over >= 500
    decoded positions, with logits within a few hundredths of float32."""
    ids = tokenizer.encode(TEXT.read_text())[:640]
    start = 16
    got = decode_logits(model_blocks, model_config, ids, start, kv_dtype=torch.float16)
    want = full_logits(model_reference, model_config, ids)[start:]
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agreement >= 0.98, agreement
    assert (got - want).abs().max().item() < max(FLOAT16_KV_MAX_LOGIT_DIFF, MAX_LOGIT_DIFF[layout_of(model_blocks)])


def _engine(model: LlamaModel, config: ModelConfig, engine_builder: Callable[..., Engine]) -> Engine:
    return engine_builder(model, config, kv_dtype=torch.float16)  # the CPU serving default


def _greedy(engine: Engine, prompts: list[list[int]], max_new: int, eos_id: int) -> list[list[int]]:
    for i, ids in enumerate(prompts):
        engine.add(GenerationRequest(request_id=f"r{i}", prompt_ids=ids, sampling=SamplingParams(),
                                     stop=StopConditions(max_new_tokens=max_new, eos_token_ids=frozenset({eos_id}))))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work:
        for t in engine.step():
            if isinstance(t, TokenOutput):
                out[t.request_id].append(t.token_id)
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_france_answer_in_serving_format(model_blocks: LlamaModel, model_config: ModelConfig,
                                         engine_builder: Callable[..., Engine], france_prompt_ids: list[int],
                                         tokenizer: TextTokenizer, eos_id: int) -> None:
    engine = _engine(model_blocks, model_config, engine_builder)
    [tokens] = _greedy(engine, [france_prompt_ids], 20, eos_id)
    assert tokenizer.decode([t for t in tokens if t != eos_id]) == "The capital of France is Paris."


def test_batched_equals_alone_in_serving_format(model_blocks: LlamaModel, model_config: ModelConfig,
                                                engine_builder: Callable[..., Engine],
                                                chat_ids: Callable[[str], list[int]], eos_id: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode batches on both sides of the kernel/GEMM switch (lowered to 8 rows here, so 12 prompts run
    on the GEMM and drop onto the kernel as they finish): the same greedy tokens as alone."""
    monkeypatch.setattr(ops, "DENSE_ROWS", 8)
    questions = [f"Name a famous scientist whose surname starts with the letter {c}." for c in "ABCDEFGHIJKL"]
    prompts = [chat_ids(q) for q in questions]
    alone = [_greedy(_engine(model_blocks, model_config, engine_builder), [p], 12, eos_id)[0] for p in prompts[:4]]
    batched = _greedy(_engine(model_blocks, model_config, engine_builder), prompts, 12, eos_id)
    assert batched[:4] == alone
