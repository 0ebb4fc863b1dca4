"""The Engine on the real model (float32, CPU), stepped directly in the test thread.

Batching, chunked prefill, prefix-cache hits and preemption by recompute must never change what a
request gets: every test compares against the same request run alone on a fresh engine.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from backend.engine import Engine, GenerationRequest, TokenOutput
from backend.engine_loop import EngineLoop
from kvyard.limits import MAX_TOP_LOGPROBS
from kvyard.sampling_params import SamplingParams
from backend.scheduler import SchedulerOutput
from backend.sequence import FinishReason, Sequence as Seq, StopConditions
from kvyard.errors import ErrorCode, RequestError
from kvyard.limits import MAX_N
from kvyard.tokenizer import TextTokenizer
from tests.backend.conftest import run_on_loop

pytestmark = pytest.mark.slow

EngineFactory = Callable[..., Engine]
NEW_TOKENS = 24
# Eight different prompts cut from different offsets of the prose: none is a prefix of another.
PROMPT_LENGTHS = (5, 12, 33, 64, 101, 150, 222, 300)
PROMPT_OFFSETS = (0, 41, 83, 127, 170, 214, 255, 299)
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)


def request(request_id: str, ids: Sequence[int], max_new_tokens: int = NEW_TOKENS,
            sampling: SamplingParams = GREEDY, eos: frozenset[int] = frozenset()) -> GenerationRequest:
    """ignore_eos unless eos ids are given, so every run makes exactly max_new_tokens."""
    stop = StopConditions(max_new_tokens=max_new_tokens, eos_token_ids=eos, ignore_eos=not eos)
    return GenerationRequest(request_id, list(ids), sampling, stop)


def add(engine: Engine, req: GenerationRequest) -> Seq:
    """Validate and add; returns the Sequence the scheduler queued for it (n == 1)."""
    engine.validate(req)
    engine.add(req)
    seq = engine.scheduler.waiting[-1]
    assert seq.request_id == req.request_id
    return seq


def drain(engine: Engine, batches: list[SchedulerOutput] | None = None,
          max_steps: int = 2000) -> dict[str, list[TokenOutput]]:
    """Step until idle; each request's outputs in order (each finishes exactly once, at its last).
    With `batches`, every SchedulerOutput the engine executed is appended to it."""
    schedule = engine.scheduler.schedule
    if batches is not None:
        def spy() -> SchedulerOutput:
            out = schedule()
            batches.append(out)
            return out
        engine.scheduler.schedule = spy  # type: ignore[method-assign]
    outs: dict[str, list[TokenOutput]] = {}
    try:
        for _ in range(max_steps):
            if not engine.has_work:
                break
            for out in engine.step():
                assert isinstance(out, TokenOutput)
                got = outs.setdefault(out.request_id, [])
                assert not got or got[-1].finish_reason is None, f"{out.request_id} produced after finishing"
                got.append(out)
        else:
            pytest.fail(f"engine still busy after {max_steps} steps")
    finally:
        engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    for rid, got in outs.items():
        assert got[-1].finish_reason is not None, f"{rid} never finished"
    return outs


def tokens_of(outs: dict[str, list[TokenOutput]]) -> dict[str, list[int]]:
    return {rid: [o.token_id for o in got] for rid, got in outs.items()}


def run_alone(make_engine: EngineFactory, ids: Sequence[int], max_new_tokens: int = NEW_TOKENS,
              sampling: SamplingParams = GREEDY) -> list[int]:
    engine = make_engine(num_blocks=64)
    add(engine, request("alone", ids, max_new_tokens, sampling))
    tokens = tokens_of(drain(engine))["alone"]
    assert len(tokens) == max_new_tokens
    assert_pool_idle(engine)
    return tokens


def assert_pool_idle(engine: Engine) -> None:
    pool = engine.scheduler.block_pool
    assert not engine.scheduler.has_unfinished
    assert pool.num_free_blocks == pool.num_total_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


@pytest.fixture(scope="module")
def prompts(long_text_ids: list[int]) -> list[list[int]]:
    out = [long_text_ids[off:off + n] for off, n in zip(PROMPT_OFFSETS, PROMPT_LENGTHS)]
    assert [len(p) for p in out] == list(PROMPT_LENGTHS)
    return out


@pytest.fixture(scope="module")
def alone_tokens(make_engine: EngineFactory, prompts: list[list[int]]) -> list[list[int]]:
    """The greedy reference: each prompt alone on a fresh engine, its whole prompt in one step."""
    return [run_alone(make_engine, p) for p in prompts]


# ---- 1. batching and chunked prefill --------------------------------------------------------------

def test_concurrent_requests_match_alone_runs(make_engine: EngineFactory, prompts: list[list[int]],
                                              alone_tokens: list[list[int]]) -> None:
    # A small token budget with a prefill cap: long prompts are cut into chunks that start mid-block
    # and share steps with other prompts' chunks and with decodes.
    engine = make_engine(num_blocks=128, max_num_batched_tokens=160, long_prefill_token_threshold=72)
    for i, p in enumerate(prompts):
        add(engine, request(f"r{i}", p))
    batches: list[SchedulerOutput] = []
    got = tokens_of(drain(engine, batches))
    assert any(any(s.num_new_tokens == 1 for s in b.scheduled) and any(s.num_new_tokens > 1 for s in b.scheduled)
               for b in batches), "no step mixed decodes with prefill chunks"
    assert max(len(b.scheduled) for b in batches) >= 6
    for i, expected in enumerate(alone_tokens):
        assert got[f"r{i}"] == expected, (
            f"prompt {i} ({PROMPT_LENGTHS[i]} tokens) diverges at output {first_mismatch(got[f'r{i}'], expected)}")
    assert_pool_idle(engine)


# ---- 2. prefix-cache hits -------------------------------------------------------------------------

def test_prefix_cache_hit_matches_cold_prefill(make_engine: EngineFactory, long_text_ids: list[int],
                                               record_logits: Callable[[Engine], Any]) -> None:
    block = 16
    prompt_a = long_text_ids[500:560]                                  # 3 full blocks + 12 tokens
    prompt_b = prompt_a[:3 * block] + long_text_ids[700:720]           # shares A's first 3 blocks
    warm = make_engine(num_blocks=32, block_size=block)
    add(warm, request("a", prompt_a, max_new_tokens=2))
    drain(warm)
    recorder = record_logits(warm)
    seq_b = add(warm, request("b", prompt_b, max_new_tokens=8))
    warm_tokens = tokens_of(drain(warm))["b"]
    assert seq_b.num_cached_tokens == 3 * block

    cold = make_engine(num_blocks=32, block_size=block)
    cold_recorder = record_logits(cold)
    cold_seq = add(cold, request("b", prompt_b, max_new_tokens=8))
    cold_tokens = tokens_of(drain(cold))["b"]
    assert cold_seq.num_cached_tokens == 0

    warm_logits, cold_logits = recorder.by_request["b"], cold_recorder.by_request["b"]
    assert len(warm_logits) == len(cold_logits) == 8
    diff = float((warm_logits[0] - cold_logits[0]).abs().max())
    assert diff <= 1e-4, f"prefill logits after a prefix hit differ from a cold prefill by {diff:.2e}"
    for step, (w, c) in enumerate(zip(warm_logits, cold_logits)):
        assert float((w - c).abs().max()) <= 1e-4, f"decode step {step}"
    assert warm_tokens == cold_tokens


# ---- 3. preemption by recompute -------------------------------------------------------------------

def test_preemption_keeps_outputs_identical(make_engine: EngineFactory, prompts: list[list[int]],
                                            alone_tokens: list[list[int]]) -> None:
    chosen = range(6)  # 5..150 tokens; the biggest request is 150 + 24 = 174 tokens = 11 blocks
    block = 16
    biggest = max(-(-(PROMPT_LENGTHS[i] + NEW_TOKENS) // block) for i in chosen)
    engine = make_engine(num_blocks=biggest + 1, block_size=block)
    seqs = [add(engine, request(f"r{i}", prompts[i])) for i in chosen]
    batches: list[SchedulerOutput] = []
    got = tokens_of(drain(engine, batches))
    preempted = [s for b in batches for s in b.preempted]
    assert preempted, "the pool was meant to be too small to run every request at once"
    assert sum(s.num_preemptions for s in seqs) == len(preempted)
    for i in chosen:
        assert got[f"r{i}"] == alone_tokens[i], (
            f"prompt {i} diverges at output {first_mismatch(got[f'r{i}'], alone_tokens[i])} "
            f"after {seqs[i].num_preemptions} preemptions")
    assert_pool_idle(engine)


# ---- 4. seeded sampling ---------------------------------------------------------------------------

def test_seeded_sampling_is_reproducible_in_mixed_batches(make_engine: EngineFactory,
                                                          long_text_ids: list[int]) -> None:
    n = 16
    seeded_prompt = long_text_ids[600:640]
    alone = run_alone(make_engine, seeded_prompt, n, SEEDED)
    assert run_alone(make_engine, seeded_prompt, n, SEEDED) == alone

    engine = make_engine(num_blocks=64)
    others = [
        ("g0", long_text_ids[20:50], GREEDY),
        ("u0", long_text_ids[60:75], SamplingParams(temperature=1.0)),
        ("seeded", seeded_prompt, SEEDED),
        ("g1", long_text_ids[300:380], GREEDY),
        ("u1", seeded_prompt, SamplingParams(temperature=0.8, top_p=0.9)),  # same prompt, no seed
        ("s2", long_text_ids[400:410], SamplingParams(temperature=0.8, top_p=0.9, seed=99)),
    ]
    for rid, ids, sampling in others:
        add(engine, request(rid, ids, n, sampling))
    got = tokens_of(drain(engine))
    assert got["seeded"] == alone
    assert all(len(t) == n for t in got.values())


# ---- 5. aux info ----------------------------------------------------------------------------------

def test_aux_reports_prefix_reuse(make_engine: EngineFactory, long_text_ids: list[int]) -> None:
    prompt = long_text_ids[100:140]  # 40 tokens: 2 full blocks can be reused, the rest is computed
    engine = make_engine(num_blocks=16)
    add(engine, request("first", prompt, max_new_tokens=3))
    first = drain(engine)["first"]
    add(engine, request("second", prompt, max_new_tokens=3))
    second = drain(engine)["second"]
    assert all(o.aux.reuse_len == 0 for o in first)
    assert all(o.aux.reuse_len == 32 for o in second)
    assert [o.token_id for o in first] == [o.token_id for o in second]
    last = second[-1].aux
    assert (last.input_len, last.output_len) == (40, 3)
    assert last.iter_count == 3 and second[-1].finish_reason is FinishReason.LENGTH


def test_n_sequences_share_the_prompt_blocks(make_engine: EngineFactory, long_text_ids: list[int]) -> None:
    """n > 1: the siblings reuse the first sequence's prompt blocks instead of recomputing them."""
    prompt = long_text_ids[200:270]  # 70 tokens: 4 full blocks
    engine = make_engine(num_blocks=32)
    req = request("fan", prompt, max_new_tokens=4)
    req.n = 3
    engine.validate(req)
    engine.add(req)
    by_index: dict[int, list[TokenOutput]] = {}
    for _ in range(200):
        if not engine.has_work:
            break
        for o in engine.step():
            by_index.setdefault(o.index, []).append(o)
    assert sorted(by_index) == [0, 1, 2]
    assert by_index[0][-1].aux.reuse_len == 0
    assert by_index[1][-1].aux.reuse_len == 64 and by_index[2][-1].aux.reuse_len == 64
    tokens = [[o.token_id for o in by_index[i]] for i in range(3)]
    assert tokens[0] == tokens[1] == tokens[2]  # greedy: siblings agree
    assert [sum(o.finish_reason is not None for o in by_index[i]) for i in range(3)] == [1, 1, 1]
    assert engine.scheduler.block_pool.num_free_blocks == engine.scheduler.block_pool.num_total_blocks


# ---- 6. validation --------------------------------------------------------------------------------

def test_validate_rejects_bad_input(make_engine: EngineFactory, model_config: Any) -> None:
    engine = make_engine(num_blocks=4, block_size=16, max_model_len=100)  # 64 KV slots, context 100
    vocab = model_config.vocab_size

    def code_of(req: GenerationRequest) -> ErrorCode:
        with pytest.raises(RequestError) as info:
            engine.validate(req)
        return info.value.code

    engine.validate(request("ok", [1] * 63))  # 63 + 1 generated token fill the 64 slots exactly
    assert code_of(request("empty", [])) is ErrorCode.INVALID_ARGUMENT
    assert code_of(request("big-id", [1, vocab, 2])) is ErrorCode.INVALID_ARGUMENT
    assert code_of(request("neg-id", [1, -1])) is ErrorCode.INVALID_ARGUMENT
    assert code_of(request("long", [1] * 100)) is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    assert code_of(request("kv", [1] * 64)) is ErrorCode.OUT_OF_KV_CACHE
    assert code_of(request("top", [1, 2], sampling=SamplingParams(logprobs=True,
                                                                   top_logprobs=MAX_TOP_LOGPROBS + 1))) \
        is ErrorCode.INVALID_ARGUMENT
    assert MAX_TOP_LOGPROBS == 20
    assert code_of(request("temp", [1, 2], sampling=SamplingParams(temperature=-0.5))) is ErrorCode.INVALID_ARGUMENT
    # n past the frontend's cap: a direct gRPC caller may not fan one request out to hundreds of sequences.
    many = request("many", [1, 2])
    many.n = MAX_N + 1
    assert code_of(many) is ErrorCode.INVALID_ARGUMENT
    many.n = MAX_N
    engine.validate(many)
    assert not engine.has_work  # validate never queues anything


# ---- 7. cancellation through the engine loop ------------------------------------------------------

def test_cancel_through_engine_loop_frees_everything(make_engine: EngineFactory, france_prompt_ids: list[int],
                                                     tokenizer: TextTokenizer, eos_id: int) -> None:
    engine = make_engine(num_blocks=64)
    loop = EngineLoop(engine)

    async def scenario() -> None:
        stream = loop.generate(request("long", france_prompt_ids, max_new_tokens=500))
        steps = 0
        async for outs in stream:
            assert [o.request_id for o in outs] == ["long"]
            steps += 1
            if steps == 3:
                break
        await stream.aclose()  # what a disconnecting client does: the generator's finally aborts
        pool = engine.scheduler.block_pool
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if not engine.scheduler.has_unfinished and pool.num_free_blocks == pool.num_total_blocks:
                break
            await asyncio.sleep(0.01)
        assert not engine.scheduler.has_unfinished, "the cancelled request is still scheduled"
        assert pool.num_free_blocks == pool.num_total_blocks, "KV blocks leaked by the cancelled request"

        tokens: list[int] = []
        finish = None
        async for outs in loop.generate(request("after", france_prompt_ids, max_new_tokens=16,
                                                eos=frozenset({eos_id}))):
            tokens.extend(o.token_id for o in outs)
            finish = outs[-1].finish_reason
        assert finish is FinishReason.STOP and tokens[-1] == eos_id
        assert "Paris" in tokenizer.decode(tokens)

    run_on_loop(loop, lambda: asyncio.wait_for(scenario(), timeout=60))
    assert not loop.alive
    assert_pool_idle(engine)


# ---- 8. logprobs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [SamplingParams(logprobs=True, top_logprobs=5),
                                      SamplingParams(temperature=0.8, seed=7, logprobs=True, top_logprobs=5)],
                         ids=["greedy", "seeded"])
def test_logprobs_match_reference_logits(make_engine: EngineFactory, france_prompt_ids: list[int],
                                         reference_logits: Callable[[Sequence[int]], torch.Tensor],
                                         sampling: SamplingParams) -> None:
    n = 6
    engine = make_engine(num_blocks=16)
    add(engine, request("lp", france_prompt_ids, n, sampling))
    # A second request in the batch, so the logprob rows are picked out of a multi-row step.
    add(engine, request("other", france_prompt_ids[:20], n))
    outs = drain(engine)["lp"]
    tokens = [o.token_id for o in outs]
    # Position p's logits predict token p + 1: the logits of output k sit at row len(prompt) - 1 + k.
    ref = torch.log_softmax(reference_logits(france_prompt_ids + tokens[:-1]), dim=-1)
    for k, out in enumerate(outs):
        row = ref[len(france_prompt_ids) - 1 + k]
        smp = out.sample
        assert smp.token_id == out.token_id
        assert smp.logprob is not None and abs(smp.logprob - float(row[out.token_id])) <= 1e-4, k
        assert smp.top_logprobs is not None and len(smp.top_logprobs) == 5
        top_ids = [t for t, _ in smp.top_logprobs]
        top_vals = [v for _, v in smp.top_logprobs]
        assert top_vals == sorted(top_vals, reverse=True)
        assert top_ids[0] == int(row.argmax())
        ref_vals, _ = row.topk(5)
        assert max(abs(a - b) for a, b in zip(top_vals, ref_vals.tolist())) <= 1e-4
        for t, v in smp.top_logprobs:
            assert abs(v - float(row[t])) <= 1e-4
        if sampling.greedy:
            assert top_ids[0] == out.token_id and smp.logprob == top_vals[0]
