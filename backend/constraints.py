"""Grammar-constrained decoding, backend side: the gRPC edge compiles a request's Constraint (kvyard/constraint.py)
off the engine thread, cached by its text; each sequence then owns a GrammarState that the engine turns into
a token bitmask before sampling (backend/sampler.py applies it) and advances with every accepted token.

llguidance does the work: an Earley parser over the grammar plus a lexer run over a token trie, so a mask
costs ~10-20 µs per row, and compiling a 50-property schema ~1-5 ms (see docs/performance.md)."""
from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from llguidance import LLMatcher, LLTokenizer

from kvyard.constraint import Constraint
from kvyard.errors import ErrorCode, RequestError
from kvyard.limits import GRAMMAR_BUDGET_S

CACHE_ENTRIES = 256   # compiled grammars kept (least recently used go first)
COMPILE_WORKERS = 2   # LLMatcher construction drops the GIL; one slow schema leaves the other worker free


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return (vocab_size + 31) // 32


class GrammarState:
    """One sequence's place in its grammar. After the hand-off to the engine, only the engine thread uses it."""

    def __init__(self, matcher: LLMatcher, eos_ids: frozenset[int], vocab_size: int) -> None:
        self._matcher = matcher
        self._eos_ids = eos_ids
        self._vocab_size = vocab_size

    def copy(self) -> GrammarState:
        """An independent state at the same place (n > 1: one per sequence)."""
        return GrammarState(self._matcher.deep_copy(), self._eos_ids, self._vocab_size)

    @property
    def error(self) -> str:
        """Why the grammar cannot go on ("" while it can)."""
        return self._matcher.get_error() if self._matcher.is_error() else ""

    @property
    def done(self) -> bool:
        """The grammar is complete: only eos may follow."""
        return self._matcher.is_stopped()

    def fill_mask(self, out: torch.Tensor) -> None:
        """out: [mask_words(V)] int32, contiguous, on the CPU → the tokens allowed next. A complete grammar
        allows only eos (llguidance's own mask says so too; this makes the rule explicit and cheap)."""
        assert out.dtype == torch.int32 and out.is_contiguous() and out.device.type == "cpu"
        if self._matcher.is_stopped():
            out.zero_()
            for t in self._eos_ids:
                out[t // 32] |= _bit(t % 32)
            return
        self._matcher.unsafe_compute_mask_ptr(out.data_ptr(), out.numel() * 4)
        if self._matcher.is_error():  # a parser limit hit while computing the mask
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"the grammar failed: {self._matcher.get_error()}")

    def advance(self, token_id: int) -> bool:
        """Consume the token the sequence just took; False when the grammar refuses it (then `error` says why)."""
        if self._matcher.is_stopped() and token_id in self._eos_ids:
            return True  # eos after a complete grammar: nothing left to advance
        return self._matcher.consume_token(token_id) and not self._matcher.is_error()

    def advance_all(self, token_ids: Iterable[int]) -> bool:
        return all(self.advance(t) for t in token_ids)


def _bit(k: int) -> int:
    """Bit k of an int32 word, as a Python int that fits int32 (bit 31 is the sign)."""
    return -(1 << 31) if k == 31 else 1 << k


class GrammarCompiler:
    """Owned by the backend's gRPC servicer: compiles constraints on its own worker threads, never the engine's.

    The first compile builds llguidance's token tables from the tokenizer (~0.3 s for a 49k vocabulary),
    so backends that never see a constraint never pay for it."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: frozenset[int],
                 cache_entries: int = CACHE_ENTRIES, workers: int = COMPILE_WORKERS) -> None:
        self.vocab_size = vocab_size  # the model's (logit rows), which may exceed the tokenizer's
        self.eos_ids = eos_ids
        self._tokenizer_json = tokenizer_json
        self._tokenizer: LLTokenizer | None = None
        self._cache: OrderedDict[Constraint, Future[LLMatcher]] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()  # the cache: the event loop and the workers' callbacks
        self._tokenizer_lock = threading.Lock()  # the lazy tokenizer (workers only: its build takes ~0.3 s)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def compile(self, constraint: Constraint, budget_s: float = GRAMMAR_BUDGET_S) -> GrammarState:
        """A fresh state at the grammar's start. Raises RequestError(INVALID_ARGUMENT) naming the problem, also
        when the compile (queued or running) takes longer than `budget_s`: the worker finishes on its own, and
        the shield keeps one caller's timeout or cancel from cancelling a compile other requests share."""
        try:
            template = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._template(constraint))),
                                              budget_s)
        except TimeoutError:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"the {constraint.kind.value} grammar did not compile "
                               f"within {budget_s:g} s (GRAMMAR_BUDGET_S)", "constraint") from None
        return self._state(template)

    def compile_now(self, constraint: Constraint) -> GrammarState:
        """`compile` on the calling thread's time (tests, tools): waits for the worker."""
        return self._state(self._template(constraint).result())

    def _state(self, template: LLMatcher) -> GrammarState:
        return GrammarState(template.deep_copy(), self.eos_ids, self.vocab_size)

    def _template(self, constraint: Constraint) -> Future[LLMatcher]:
        """The compiled grammar at its start, shared through the cache (never consumed: states deep-copy it).
        Concurrent requests for one text share one compile; a failed compile is not kept."""
        with self._lock:
            future = self._cache.get(constraint)
            if future is not None:
                self._cache.move_to_end(constraint)
                return future
            future = self._pool.submit(self._build, constraint)
            self._cache[constraint] = future
            while len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)

        def forget_failure(f: Future[LLMatcher]) -> None:
            if f.exception() is not None:
                with self._lock:
                    if self._cache.get(constraint) is f:
                        del self._cache[constraint]
        future.add_done_callback(forget_failure)
        return future

    def _build(self, constraint: Constraint) -> LLMatcher:
        grammar = constraint.llguidance_grammar()
        matcher = LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"invalid {constraint.kind.value}: {matcher.get_error().strip()}")
        return matcher

    def _llg_tokenizer(self) -> LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                              eos_token=sorted(self.eos_ids) or None)
            return self._tokenizer


async def compile_constraint(grammars: GrammarCompiler | None, constraint: Constraint | None) -> GrammarState | None:
    """A request's grammar state from its constraint, on the compiler's threads (so the engine gets it ready
    to mask with); None without one."""
    if constraint is None:
        return None
    if grammars is None:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "this backend does not take constraints", "constraint")
    return await grammars.compile(constraint)
