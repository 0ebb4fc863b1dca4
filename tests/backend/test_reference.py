"""Our model against Hugging Face transformers' LlamaForCausalLM loaded from the same GGUF (float32).

Both get the same token ids (from our TextTokenizer: transformers' GGUF tokenizer splits digits
differently), so any difference is in the network: weight loading (GGUF dequantization and the
Q/K row un-permutation), RoPE, GQA, RMSNorm, paged attention, chunked prefill and decode.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.engine import Engine, GenerationRequest
from kvyard.sampling_params import SamplingParams
from backend.sequence import StopConditions
from kvyard.tokenizer import TextTokenizer
from tests.support.tiny_models import hf_greedy

pytestmark = pytest.mark.slow

ATOL = 2e-3
GREEDY_STEPS = 32


@pytest.fixture(scope="module")
def hf_model(model_path: Path) -> Iterator[Any]:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32)
    model.eval()
    yield model


def hf_logits(hf_model: Any, ids: Sequence[int]) -> torch.Tensor:
    """[len(ids), V] float32 logits of every position, one full forward without a cache."""
    with torch.inference_mode():
        out = hf_model(input_ids=torch.tensor([list(ids)]), use_cache=False)
    return out.logits[0].float()


def engine_greedy(engine: Engine, record_logits: Callable[[Engine], Any], ids: Sequence[int],
                  steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens through the Engine (paged KV, chunked prefill per its budget) and their logits."""
    recorder = record_logits(engine)
    req = GenerationRequest("ref", list(ids), SamplingParams(),
                            StopConditions(max_new_tokens=steps, ignore_eos=True))
    engine.validate(req)
    engine.add(req)
    tokens: list[int] = []
    while engine.has_work:
        tokens.extend(o.token_id for o in engine.step())
    recorder.close()
    return tokens, recorder.by_request["ref"]


@pytest.fixture(scope="module")
def prompts(tokenizer: TextTokenizer, france_prompt_ids: list[int], long_text_ids: list[int]) -> dict[str, list[int]]:
    out = {
        "chat": france_prompt_ids,
        "tiny": tokenizer.encode("Once upon a time"),
        "digits": tokenizer.encode("In 1969, 3 astronauts flew 384400 km; 2 + 2 = 4 and 12 * 12 = 144."),
        "prose_64": long_text_ids[30:94],
        "prose_180": long_text_ids[200:380],
    }
    assert len(out["tiny"]) <= 5 and len(out["prose_180"]) > 100
    return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def test_logits_match_transformers_every_position(
        hf_model: Any, reference_logits: Callable[[Sequence[int]], torch.Tensor],
        prompts: dict[str, list[int]]) -> None:
    """A cold prefill: the logits of every position of every prompt (lengths 4 to 180)."""
    for name, ids in prompts.items():
        ours, theirs = reference_logits(ids), hf_logits(hf_model, ids)
        assert ours.shape == (len(ids), hf_model.config.vocab_size)
        diff = max_diff(ours, theirs)
        assert diff <= ATOL, f"{name} ({len(ids)} tokens): max |logit diff| {diff:.2e} > {ATOL}"
        # Not vacuous: the logits are of a real model, not all zeros or equal.
        assert float(theirs[-1].std()) > 1.0


def test_chunked_prefill_last_logits_match_transformers(
        hf_model: Any, make_engine: Callable[..., Engine], record_logits: Callable[[Engine], Any],
        prompts: dict[str, list[int]]) -> None:
    """Through the Engine with 40-token prefill chunks: the 180-token prompt takes 5 steps over paged
    KV (block size 16), so chunks start mid-block and attend to keys cached by earlier steps."""
    for name in ("prose_180", "chat"):
        ids = prompts[name]
        engine = make_engine(num_blocks=32, block_size=16, max_num_batched_tokens=48,
                             long_prefill_token_threshold=40)
        _, captured = engine_greedy(engine, record_logits, ids, steps=1)
        diff = max_diff(captured[0], hf_logits(hf_model, ids)[-1])
        assert diff <= ATOL, f"{name}: max |logit diff| {diff:.2e} > {ATOL}"


@pytest.mark.parametrize("name", ["chat", "prose_64"])
def test_greedy_decode_matches_transformers(
        hf_model: Any, make_engine: Callable[..., Engine], record_logits: Callable[[Engine], Any],
        prompts: dict[str, list[int]], name: str) -> None:
    ids = prompts[name]
    theirs, their_logits = hf_greedy(hf_model, ids, GREEDY_STEPS)
    engine = make_engine(num_blocks=16, block_size=16)
    ours, our_logits = engine_greedy(engine, record_logits, ids, GREEDY_STEPS)
    assert len(our_logits) == GREEDY_STEPS
    for step, (a, b) in enumerate(zip(our_logits, their_logits)):
        if ours[:step] != theirs[:step]:
            break  # diverged: the token assert below reports it
        diff = max_diff(a, b)
        assert diff <= ATOL, f"step {step}: max |logit diff| {diff:.2e} > {ATOL}"
    assert ours == theirs


def test_france_answer(make_engine: Callable[..., Engine], france_prompt_ids: list[int],
                       tokenizer: TextTokenizer, eos_id: int) -> None:
    engine = make_engine(num_blocks=8)
    req = GenerationRequest("fr", france_prompt_ids, SamplingParams(),
                            StopConditions(max_new_tokens=16, eos_token_ids=frozenset({eos_id})))
    engine.add(req)
    tokens: list[int] = []
    while engine.has_work:
        tokens.extend(o.token_id for o in engine.step())
    assert tokens[-1] == eos_id
    assert tokenizer.decode(tokens[:-1]) == "The capital of France is Paris."
