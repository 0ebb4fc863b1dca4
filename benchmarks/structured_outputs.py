"""Structured outputs: what a JSON schema costs (issue 13's benchmark).

1. The grammar library alone, on the embedded model's tokenizer: building its token tables, compiling a
   50-property schema (fresh text each time, so nothing is cached), one row's token mask along a valid
   answer; llguidance (what kvyard uses) and, when importable, xgrammar for comparison.
2. The engine at 32 streams, every request under a JSON schema vs none, alternating in the same process:
   aggregate output tok/s (prefills included), decode tok/s (streams / ITL p50), and the share of the steps'
   time spent on grammars (filling, applying and advancing masks), which shared machines' noise leaves alone.

    .venv/bin/python benchmarks/structured_outputs.py [--streams 32] [--out 96] [--rounds 2]

xgrammar is not a kvyard dependency: put it on PYTHONPATH to compare (`pip install --target DIR xgrammar`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import backend.sampler  # noqa: E402
from backend.config import BackendConfig  # noqa: E402
from backend.constraints import GrammarCompiler, mask_words  # noqa: E402
from backend.engine import Engine, GenerationRequest  # noqa: E402
from backend.main import build_engine_loop  # noqa: E402
from kvyard.sampling_params import SamplingParams  # noqa: E402
from backend.sequence import StopConditions  # noqa: E402
from benchmarks.engine_throughput import Result, make_prompts, pct  # noqa: E402
from kvyard.constraint import JSON_STYLE, Constraint  # noqa: E402
from kvyard.model_path import embedded_model_path  # noqa: E402
from kvyard.tokenizer import TextTokenizer  # noqa: E402

KINDS = [{"type": "integer", "minimum": 0, "maximum": 10_000}, {"type": "string", "maxLength": 24},
         {"type": "boolean"}, {"type": "number"}, {"enum": ["low", "medium", "high"]}]


def schema_50(tag: str = "") -> dict[str, Any]:
    """50 required properties of five kinds; `tag` renames one so each compile sees new text."""
    props = {f"field_{i}{tag if i == 0 else ''}": KINDS[i % len(KINDS)] for i in range(50)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def instance_50() -> str:
    """A valid answer to schema_50(), written in kvyard's JSON style."""
    values = [7, "abc", True, 1.5, "low"]
    obj = {f"field_{i}": values[i % len(values)] for i in range(50)}
    return json.dumps(obj, separators=(JSON_STYLE["item_separator"], JSON_STYLE["key_separator"]))


def median_ms(fn: Any, reps: int) -> float:
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_llguidance(tokenizer: TextTokenizer, eos: frozenset[int], reps: int) -> None:
    from llguidance import LLMatcher, LLTokenizer

    t0 = time.perf_counter()
    llt = LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size, eos_token=sorted(eos))
    tables = (time.perf_counter() - t0) * 1e3

    def compile_one(i: int) -> LLMatcher:
        grammar = Constraint.json_schema(schema_50(f"_{i}_{time.monotonic_ns()}")).llguidance_grammar()
        matcher = LLMatcher(llt, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher
    compile_ms = median_ms(compile_one, reps)

    grammars = GrammarCompiler(tokenizer.to_json(), tokenizer.vocab_size, eos)
    constraint = Constraint.json_schema(schema_50())
    grammars.compile_now(constraint)
    cached_ms = median_ms(lambda _: grammars.compile_now(constraint), reps)  # the cache hit + deep copy
    state = grammars.compile_now(constraint)
    mask = torch.empty(mask_words(tokenizer.vocab_size), dtype=torch.int32)
    ids = tokenizer.encode(instance_50())
    times = []
    for t in ids:
        t1 = time.perf_counter()
        state.fill_mask(mask)
        times.append((time.perf_counter() - t1) * 1e6)
        assert state.advance(t), state.error
    grammars.close()
    print(f"llguidance: token tables {tables:.0f} ms; 50-property schema compile {compile_ms:.2f} ms (median of "
          f"{reps}), cached {cached_ms:.3f} ms; mask per row {statistics.median(times):.1f} us median, "
          f"{pct(times, 99):.0f} us p99 over {len(ids)} tokens")


def bench_xgrammar(tokenizer: TextTokenizer, eos: frozenset[int], reps: int) -> None:
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        print("xgrammar: not importable (not a kvyard dependency; see the docstring to compare)")
        return
    from tokenizers import Tokenizer
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer.to_json()))
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.vocab_size, stop_token_ids=sorted(eos))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compiler.compile_builtin_json_grammar()  # warm its own tables
    tables = (time.perf_counter() - t0) * 1e3
    style = dict(separators=(JSON_STYLE["item_separator"], JSON_STYLE["key_separator"]), any_whitespace=False)
    compile_ms = median_ms(lambda i: compiler.compile_json_schema(
        json.dumps(schema_50(f"_{i}_{time.monotonic_ns()}")), **style), reps)
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema_50()), **style))
    bitmask = xgr.allocate_token_bitmask(1, tokenizer.vocab_size)
    ids = tokenizer.encode(instance_50())
    times = []
    for t in ids:
        t1 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        times.append((time.perf_counter() - t1) * 1e6)
        assert matcher.accept_token(t)
    print(f"xgrammar:   token tables {tables:.0f} ms; 50-property schema compile {compile_ms:.2f} ms (median of "
          f"{reps}); mask per row {statistics.median(times):.1f} us median, {pct(times, 99):.0f} us p99 over "
          f"{len(ids)} tokens")


def timed(owner: Any, names: tuple[str, ...], spent: list[float]) -> None:
    """Wraps owner's functions so their time adds up in spent[0] (what the constraints cost the steps)."""
    for name in names:
        inner = getattr(owner, name)

        def wrapper(*args: Any, _inner: Any = inner) -> Any:
            t0 = time.perf_counter()
            try:
                return _inner(*args)
            finally:
                spent[0] += time.perf_counter() - t0
        setattr(owner, name, wrapper)


def run_engine(engine: Engine, grammars: GrammarCompiler, prompts: list[list[int]], out: int,
               constraint: Constraint | None, eos: frozenset[int], grammar_s: list[float]) -> tuple[Result, float]:
    """The run's Result, and the share of its step time the grammars took (masks, advancing, in the sampler)."""
    reqs = []
    for i, prompt in enumerate(prompts):
        # eos ends a constrained answer only once its grammar is complete (50 required fields: past `out`).
        r = GenerationRequest(f"s{i}-{time.monotonic_ns()}", prompt, SamplingParams(),
                              StopConditions(max_new_tokens=out, eos_token_ids=eos, ignore_eos=constraint is None),
                              constraint=constraint)
        if constraint is not None:
            r.grammar = grammars.compile_now(constraint)
        reqs.append(r)
    last: dict[str, float] = {}
    ttft, itl, tokens, step_s = [], [], 0, 0.0
    grammar_s[0] = 0.0
    arrival = time.perf_counter()
    for r in reqs:
        engine.add(r)
    while engine.has_work:
        t0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        step_s += now - t0
        for o in outs:
            (itl if o.request_id in last else ttft).append(now - last.get(o.request_id, arrival))
            last[o.request_id] = now
            tokens += 1
    assert not engine.failed, engine.failed
    name = "JSON schema" if constraint is not None else "unconstrained"
    return Result(name, tokens, time.perf_counter() - arrival, ttft, itl), grammar_s[0] / step_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--out", type=int, default=96, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=2, help="unconstrained/constrained pairs, order alternating")
    ap.add_argument("--compile-reps", type=int, default=20)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()

    tokenizer = TextTokenizer.from_path(embedded_model_path())
    eos = frozenset(t for t in (tokenizer.eos_token_id,) if t is not None)
    bench_llguidance(tokenizer, eos, args.compile_reps)
    bench_xgrammar(tokenizer, eos, args.compile_reps)
    if args.skip_engine:
        return

    cfg = BackendConfig.from_env({"KV_CACHE_MB": "4096", "MAX_NUM_SEQS": str(args.streams), "START_PORT": "1"})
    constraint = Constraint.json_schema(schema_50())

    def engine_runs() -> None:
        # One thread builds and drives the engine: one OpenMP master (see engine_throughput.py).
        engine_loop, model_eos, _, grammars = build_engine_loop(cfg)
        engine = engine_loop.engine
        print(f"engine: torch {torch.get_num_threads()} threads, {type(engine.runner.model.ops).__name__}, "
              f"{args.streams} streams, prompts of 100-500 random tokens, {args.out} out each, greedy")
        grammar_s = [0.0]
        # The masks' whole cost: filling them (_constrain), applying them (the sampler), advancing the states.
        timed(engine, ("_constrain", "_advance_grammars"), grammar_s)
        timed(backend.sampler, ("_apply_masks",), grammar_s)  # sample() looks it up at each call
        print(f"{'run':16} {'tok/s':>8} {'decode tok/s':>13} {'ITL p50':>8} {'p99':>8} {'grammar share':>14}")
        seeds = iter(range(100, 1000))
        ratios = []
        for k in range(args.rounds):
            order = [None, constraint] if k % 2 == 0 else [constraint, None]
            pair: dict[bool, Result] = {}
            for c in order:
                r, share = run_engine(engine, grammars, make_prompts(args.streams, engine.vocab_size, next(seeds)),
                                      args.out, c, model_eos, grammar_s)
                pair[c is not None] = r
                decode = args.streams / pct(r.itl_s, 50)
                print(f"{r.name:16} {r.tok_s:8.1f} {decode:13.1f} {pct(r.itl_s, 50) * 1e3:6.1f}ms "
                      f"{pct(r.itl_s, 99) * 1e3:6.1f}ms {share * 100:13.2f}%", flush=True)
            ratios.append((pair[True].tok_s / pair[False].tok_s, pct(pair[False].itl_s, 50) / pct(pair[True].itl_s, 50)))
        for k, (agg, dec) in enumerate(ratios):
            print(f"round {k + 1}: constrained / unconstrained = {agg:.3f} (tok/s), {dec:.3f} (decode tok/s)")
        grammars.close()

    worker = threading.Thread(target=engine_runs)
    worker.start()
    worker.join()


if __name__ == "__main__":
    main()
