"""The engine in bfloat16 on a CUDA GPU (skipped without one): a right answer, and batching that does
not change the first tokens of confident answers.

bfloat16 logits are coarse and GPU kernels may pick a different reduction order for a different
batch shape, so unlike the float32 CPU tests this one compares only the first 8 greedy tokens of
prompts whose answers the model is sure of.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from backend.engine import Engine, GenerationRequest, TokenOutput
from backend.model import LlamaModel
from kvyard.sampling_params import SamplingParams
from backend.sequence import FinishReason, StopConditions
from backend.weights import load_weights
from kvyard.model_config import ModelConfig
from kvyard.tokenizer import TextTokenizer

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Picked for wide greedy margins (top-1 minus top-2 logit >= 0.75 over the first 8 tokens in
# bfloat16 on CPU), so a last-bit difference between batch shapes cannot flip a token.
QUESTIONS = (
    "What is the capital of Japan?",
    "What is the capital of Germany?",
    "What is the largest planet in our solar system?",
    "What is the chemical symbol for water?",
)
FIRST_TOKENS = 8


@pytest.fixture(scope="module")
def model_bf16(model_path: Path, model_config: ModelConfig) -> LlamaModel:
    device = torch.device("cuda")
    return LlamaModel(model_config, load_weights(model_path, model_config, torch.bfloat16, device))


@pytest.fixture
def make_cuda_engine(model_bf16: LlamaModel, model_config: ModelConfig,
                     engine_builder: Callable[..., Engine]) -> Callable[[], Engine]:
    def make() -> Engine:
        engine = engine_builder(model_bf16, model_config, num_blocks=64, block_size=16)
        assert engine.runner.cache.data.device.type == "cuda"
        assert engine.runner.cache.data.dtype == torch.bfloat16
        return engine
    return make


def generate(engine: Engine, prompts: dict[str, Sequence[int]], max_new_tokens: int,
             eos_id: int | None = None) -> dict[str, list[TokenOutput]]:
    for rid, ids in prompts.items():
        eos = frozenset() if eos_id is None else frozenset({eos_id})
        req = GenerationRequest(rid, list(ids), SamplingParams(),
                                StopConditions(max_new_tokens=max_new_tokens, eos_token_ids=eos,
                                               ignore_eos=eos_id is None))
        engine.validate(req)
        engine.add(req)
    outs: dict[str, list[TokenOutput]] = {}
    for _ in range(10 * max_new_tokens + 100):
        if not engine.has_work:
            break
        for out in engine.step():
            assert isinstance(out, TokenOutput)
            outs.setdefault(out.request_id, []).append(out)
    assert not engine.has_work
    return outs


def test_answers_france_with_paris(make_cuda_engine: Callable[[], Engine], france_prompt_ids: list[int],
                                   tokenizer: TextTokenizer, eos_id: int) -> None:
    outs = generate(make_cuda_engine(), {"fr": france_prompt_ids}, 24, eos_id)["fr"]
    text = tokenizer.decode([o.token_id for o in outs], skip_special_tokens=True)
    assert "Paris" in text, text
    assert outs[-1].finish_reason is FinishReason.STOP


def test_concurrent_prompts_match_alone_runs(make_cuda_engine: Callable[[], Engine],
                                             chat_ids: Callable[[str], list[int]],
                                             tokenizer: TextTokenizer) -> None:
    prompts = {f"q{i}": chat_ids(q) for i, q in enumerate(QUESTIONS)}
    alone = {rid: [o.token_id for o in generate(make_cuda_engine(), {rid: ids}, FIRST_TOKENS)[rid]]
             for rid, ids in prompts.items()}
    together = generate(make_cuda_engine(), prompts, FIRST_TOKENS)
    for rid, expected in alone.items():
        got = [o.token_id for o in together[rid]]
        assert got == expected, (f"{QUESTIONS[int(rid[1:])]!r}: batched {tokenizer.decode(got)!r} "
                                 f"vs alone {tokenizer.decode(expected)!r}")
