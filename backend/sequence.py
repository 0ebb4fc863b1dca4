"""Per-request engine state: the token ids, KV bookkeeping and stop rules the scheduler and block pool share."""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, ClassVar, TypeVar

from kvyard.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

Feature = TypeVar("Feature")


class SequenceStatus(Enum):
    WAITING = "waiting"    # queued: no KV blocks (never admitted, or preempted)
    RUNNING = "running"    # admitted: holds KV blocks, scheduled each step while budget allows
    FINISHED = "finished"  # done (see finish_reason); its blocks are back in the pool


class FinishReason(Enum):
    STOP = "stop"      # EOS, a stop token or a stop sequence
    LENGTH = "length"  # max_new_tokens, the model context, or the whole KV pool reached
    ABORT = "abort"    # cancelled by the caller


@dataclass
class StopConditions:
    """What ends generation; pure data, checked by Sequence.check_stop after every appended token."""

    max_new_tokens: int                                  # output tokens allowed; reaching it -> LENGTH
    eos_token_ids: frozenset[int] = frozenset()          # end-of-sequence ids -> STOP (unless ignore_eos)
    stop_token_ids: frozenset[int] = frozenset()         # extra ids that end generation -> STOP, even with ignore_eos
    stop_sequences: tuple[tuple[int, ...], ...] = ()     # output ids ending with one of these -> STOP
    min_new_tokens: int = 0                              # STOP conditions are ignored until this many outputs
    ignore_eos: bool = False                             # keep generating through EOS (benchmarks)
    max_total_len: int | None = None                     # model context: prompt + output reaching it -> LENGTH

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if any(len(s) == 0 for s in self.stop_sequences):
            # An empty sequence would match after every token.
            raise ValueError("stop_sequences must not contain an empty sequence")


class Sequence:
    """One generation stream: prompt then output token ids, plus where its KV lives."""

    # Class-level so ids are unique within the process without a module-level global.
    _ids: ClassVar[Iterator[int]] = itertools.count()

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        stop: StopConditions,
        *,
        index: int = 0,
        sampling: SamplingParams | None = None,
        generator: torch.Generator | None = None,
        features: Iterable[object] = (),
        extra_key: bytes = b"",
        arrival_time: float | None = None,
    ) -> None:
        token_ids = list(prompt_token_ids)
        if not token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id: int = next(Sequence._ids)          # unique per process; keys `sampled` in the scheduler
        self.request_id: str = request_id               # the caller's id; several sequences may share it (n > 1)
        self.token_ids: list[int] = token_ids           # prompt then output; only ever appended to
        self.num_prompt_tokens: int = len(token_ids)    # prompt length, fixed
        self.num_computed_tokens: int = 0               # leading tokens whose KV is in the cache (0 while WAITING)
        self.num_cached_tokens: int = 0                 # prompt tokens served by the prefix cache at the last admission (reuse_len)
        self.block_table: list[int] = []                # KV block ids, in position order; empty while WAITING
        self.block_keys: list[int] = []                 # chained prefix-cache keys of the full blocks of token_ids, filled lazily by the block pool
        self.extra_key: bytes = extra_key               # salt mixed into every block key (cache isolation); the frontend must use the same
        self.block_salts: dict[int, bytes] = {}         # block index → bytes mixed into that block's key after extra_key (image digests)
        self.status: SequenceStatus = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None  # set when status becomes FINISHED
        self.arrival_time: float = time.monotonic() if arrival_time is None else arrival_time  # when the engine got it
        self.first_scheduled_time: float | None = None  # first step it took part in (wait time ends here)
        self.first_token_time: float | None = None      # when its first output token was sampled
        self.num_preemptions: int = 0                   # times it was preempted by recompute
        self.stop: StopConditions = stop                # what ends generation
        # How its tokens are drawn: read by the engine, never by the scheduler or the block pool.
        self.index: int = index                         # which of the request's n sequences
        self.sampling: SamplingParams = sampling or SamplingParams()
        self.generator: torch.Generator | None = generator  # its own RNG; None when greedy
        # What a feature keeps per sequence (a constraint's GrammarState, a ScoreRequest's ScoreState), owned by
        # the feature's module and found with `feature(kind)`: the base record does not know the kinds.
        self.features: tuple[object, ...] = tuple(features)
        self.iter_count: int = 0                        # steps it took part in (aux_info.iter_count)
        self.max_cached_tokens: int | None = None       # cap on prefix-cache hits (scoring needs logits from there on)
        self.hold_blocks: bool = False                  # keep blocks after finishing (prefill hand-over) until released

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, status={self.status.name}, "
                f"len={len(self.token_ids)}, prompt={self.num_prompt_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)})")

    def __len__(self) -> int:
        return len(self.token_ids)

    def feature(self, kind: type[Feature]) -> Feature | None:
        """This sequence's state of one feature (`seq.feature(GrammarState)`), None when it has none."""
        for f in self.features:
            if isinstance(f, kind):
                return f
        return None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop(self) -> FinishReason | None:
        """Apply the stop conditions to the token just appended; STOP wins over LENGTH when both hold."""
        stop = self.stop
        n_out = self.num_output_tokens
        if n_out == 0:
            return None
        if n_out >= stop.min_new_tokens:
            last = self.token_ids[-1]
            if not stop.ignore_eos and last in stop.eos_token_ids:
                return FinishReason.STOP
            if last in stop.stop_token_ids:
                return FinishReason.STOP
            for s in stop.stop_sequences:
                # Only generated ids count: a prompt ending in a stop sequence must not stop at once.
                if len(s) <= n_out and tuple(self.token_ids[-len(s):]) == s:
                    return FinishReason.STOP
        if n_out >= stop.max_new_tokens:
            return FinishReason.LENGTH
        if stop.max_total_len is not None and len(self.token_ids) >= stop.max_total_len:
            return FinishReason.LENGTH
        return None
