"""Grammar-constrained decoding in the engine (backend/constraints.py, the sampler's masks): constrained rows follow
their grammar, unconstrained rows in the same batch get exactly their unconstrained answers, each of n sequences
has its own grammar state, preemption keeps it, and the compiler caches, shares and refuses as it should."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
import torch

from backend.constraints import GrammarCompiler, mask_words
from backend.engine import Engine, GenerationRequest
from backend.sampler import SampleRow, make_generator, sample
from kvyard.sampling_params import SamplingParams
from backend.sequence import StopConditions
from kvyard.constraint import Constraint, ConstraintKind
from kvyard.errors import ErrorCode, RequestError
from kvyard.tokenizer import TextTokenizer
from tests.backend.conftest import EngineFactory
from tests.backend.test_engine_model import drain, tokens_of

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
YES_NO = Constraint(ConstraintKind.REGEX, "(yes|no)")
COLORS = Constraint(ConstraintKind.LARK, 'start: "red" | "green" | "blue"')


@pytest.fixture(scope="module")
def compiler(tokenizer: TextTokenizer, eos_id: int) -> Iterator[GrammarCompiler]:
    grammars = GrammarCompiler(tokenizer.to_json(), tokenizer.vocab_size, frozenset({eos_id}))
    yield grammars
    grammars.close()


def chat(tokenizer: TextTokenizer, question: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n", parse_special=True)


def req(request_id: str, ids: list[int], eos_id: int, compiler: GrammarCompiler, constraint: Constraint | None = None,
        sampling: SamplingParams = SamplingParams(), n: int = 1, max_new: int = 24) -> GenerationRequest:
    r = GenerationRequest(request_id, ids, sampling, StopConditions(max_new, frozenset({eos_id})), n=n,
                          constraint=constraint)
    if constraint is not None:
        r.grammar = compiler.compile_now(constraint)
    return r


def run(engine: Engine, reqs: list[GenerationRequest]) -> dict[str, list[int]]:
    for r in reqs:
        engine.validate(r)
        engine.add(r)
    out = tokens_of(drain(engine))
    assert not engine.failed
    return out


def text(tokenizer: TextTokenizer, ids: list[int], eos_id: int) -> str:
    assert ids[-1] == eos_id, "a complete grammar ends the answer with eos"
    return tokenizer.decode(ids[:-1])


@pytest.mark.slow
def test_mixed_batch_keeps_unconstrained_answers_and_constrains_the_rest(
        make_engine: EngineFactory, tokenizer: TextTokenizer, eos_id: int, compiler: GrammarCompiler) -> None:
    questions = ["What is the capital of France?", "Name three fruits.", "What is 2+2?", "Say hi."]
    plain = [chat(tokenizer, q) for q in questions]
    alone = run(make_engine(num_blocks=128), [req(f"u{i}", ids, eos_id, compiler) for i, ids in enumerate(plain)])
    person = Constraint.json_schema(PERSON)
    mixed = run(make_engine(num_blocks=128), [
        *(req(f"u{i}", ids, eos_id, compiler) for i, ids in enumerate(plain)),
        req("json", chat(tokenizer, "Describe a person."), eos_id, compiler, person),
        req("drawn", chat(tokenizer, "Describe a sailor."), eos_id, compiler, person,
            SamplingParams(temperature=1.0, seed=3)),
        req("filtered", chat(tokenizer, "Describe a cook."), eos_id, compiler, person,
            SamplingParams(temperature=0.9, top_k=40, seed=5)),
        req("regex", chat(tokenizer, "Is the sky blue?"), eos_id, compiler, YES_NO),
    ])
    for i in range(len(plain)):
        assert mixed[f"u{i}"] == alone[f"u{i}"]  # greedy, byte for byte
    for name in ("json", "drawn", "filtered"):
        value = json.loads(text(tokenizer, mixed[name], eos_id))
        assert set(value) == {"name", "age"} and isinstance(value["name"], str) and 0 <= value["age"] <= 120
    assert re.fullmatch("yes|no", text(tokenizer, mixed["regex"], eos_id))


@pytest.mark.slow
def test_each_sequence_has_its_own_grammar_and_preemption_keeps_it(
        make_engine: EngineFactory, tokenizer: TextTokenizer, eos_id: int, compiler: GrammarCompiler) -> None:
    engine = make_engine(num_blocks=64)
    engine.add(req("n", chat(tokenizer, "Pick a color."), eos_id, compiler, COLORS,
                   SamplingParams(temperature=1.5, seed=11), n=6))
    answers: dict[int, list[int]] = {}
    while engine.has_work:
        for out in engine.step():
            answers.setdefault(out.index, []).append(out.token_id)
    assert not engine.failed and len(answers) == 6
    colors = {text(tokenizer, ids, eos_id) for ids in answers.values()}
    assert colors <= {"red", "green", "blue"} and len(colors) > 1  # drawn apart, each within the grammar
    person = Constraint.json_schema(PERSON)
    prompts = [chat(tokenizer, f"Describe person number {i}, who lives in a town by the sea.") for i in range(4)]
    alone = {f"p{i}": run(make_engine(num_blocks=64), [req(f"p{i}", p, eos_id, compiler, person, max_new=40)])[f"p{i}"]
             for i, p in enumerate(prompts)}
    engine = make_engine(num_blocks=8, block_size=16)  # too small for all four: some are recomputed
    batches: list = []
    for i, p in enumerate(prompts):
        engine.add(req(f"p{i}", p, eos_id, compiler, person, max_new=40))
    got = tokens_of(drain(engine, batches))
    assert any(b.preempted for b in batches)
    assert got == alone
    for ids_ in got.values():
        json.loads(text(tokenizer, ids_, eos_id))


def test_compiler_shares_one_compile_and_refuses_bad_grammars(compiler: GrammarCompiler, eos_id: int) -> None:
    a, b = compiler.compile_now(YES_NO), compiler.compile_now(YES_NO)
    assert compiler._template(YES_NO) is compiler._template(YES_NO)  # one compiled grammar, cached by its text
    assert a.advance_all([]) and not a.done and not b.done
    with pytest.raises(RequestError) as info:
        compiler.compile_now(Constraint(ConstraintKind.LARK, 'start: missing_rule'))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT and "lark" in info.value.message
    bad = Constraint.json_schema({"type": "array", "uniqueItems": True})
    with pytest.raises(RequestError, match="uniqueItems"):
        compiler.compile_now(bad)
    assert bad not in compiler._cache  # a failed compile is not kept


def test_deep_grammars_are_refused_before_llguidance_compiles_them(compiler: GrammarCompiler) -> None:
    """A caller with the cluster token reaches the backend's compiler directly: the same depth budget
    (kvyard/limits.py) holds there, and the compiler works on afterwards."""
    from tests.frontend.test_guided import ref_chain, rule_chain
    deep_schema = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(ref_chain(1000)))
    for constraint, piece in [(deep_schema, "more than 200 levels"),
                              (Constraint(ConstraintKind.LARK, rule_chain(3000)), "more than 400 deep")]:
        with pytest.raises(RequestError, match=piece) as info:
            compiler.compile_now(constraint)
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert compiler.compile_now(COLORS).advance_all([])


def test_a_compile_past_its_budget_fails_its_request_and_the_shared_compile_goes_on(
        tokenizer: TextTokenizer, eos_id: int) -> None:
    """The backend's compile has a time budget too (kvyard/limits.GRAMMAR_BUDGET_S): a request whose grammar
    takes longer gets a 400, while another request for the same grammar, with more time, still gets it."""
    import asyncio
    import threading
    release = threading.Event()

    class SlowCompiler(GrammarCompiler):
        def _build(self, constraint: Constraint):  # type: ignore[no-untyped-def]
            release.wait(10)
            return super()._build(constraint)

    slow = SlowCompiler(tokenizer.to_json(), tokenizer.vocab_size, frozenset({eos_id}))

    async def scenario() -> None:
        patient = asyncio.ensure_future(slow.compile(YES_NO, budget_s=30))
        with pytest.raises(RequestError, match="did not compile within 0.2 s") as info:
            await slow.compile(YES_NO, budget_s=0.2)
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
        release.set()
        assert (await patient).advance_all([])  # the shared compile was not cancelled by the other's timeout
    try:
        asyncio.run(scenario())
    finally:
        release.set()
        slow.close()


def test_a_complete_grammar_allows_only_eos(compiler: GrammarCompiler, tokenizer: TextTokenizer, eos_id: int) -> None:
    state = compiler.compile_now(YES_NO)
    mask = torch.zeros(mask_words(tokenizer.vocab_size), dtype=torch.int32)
    state.fill_mask(mask)
    assert allowed(mask, tokenizer.vocab_size) and eos_id not in allowed(mask, tokenizer.vocab_size)
    assert state.advance_all(tokenizer.encode("yes")) and state.done
    state.fill_mask(mask)
    assert allowed(mask, tokenizer.vocab_size) == [eos_id]
    other = compiler.compile_now(YES_NO)
    assert not other.advance(tokenizer.encode("maybe")[0]) and other.error


def allowed(mask: torch.Tensor, vocab: int) -> list[int]:
    return [t for t in range(vocab) if (int(mask[t // 32]) >> (t % 32)) & 1]


def test_masks_in_the_sampler_kernel_and_torch_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Masked tokens never come up (greedy, drawn by the kernel, drawn through top_k's PyTorch path, with
    or without the kernels), and the rows without a mask keep exactly their logits."""
    torch.manual_seed(0)
    V = 1000
    logits = torch.randn(4, V) * 3
    mask = torch.zeros(mask_words(V), dtype=torch.int32)
    keep = [5, 77, 640, 999]  # not the argmax of any row
    for t in keep:
        mask[t // 32] |= (1 << (t % 32)) if t % 32 != 31 else -(1 << 31)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, top_k=50, seed=2),
              SamplingParams()]
    for kernels_on in (True, False):
        if not kernels_on:
            monkeypatch.setattr("backend.sampler._cpu_kernels", lambda _: None)
        rows = [SampleRow(p, make_generator(p, torch.device("cpu")), [], [], mask if i < 3 else None)
                for i, p in enumerate(params)]
        for _ in range(50):
            work = logits.clone()
            picked = [s.token_id for s in sample(work, rows)]
            assert all(t in keep for t in picked[:3]) and picked[3] == int(logits[3].argmax())
            assert torch.equal(work[3], logits[3])  # the unconstrained row is untouched
        assert picked[0] == max(keep, key=lambda t: float(logits[0, t]))  # greedy: the best allowed token
