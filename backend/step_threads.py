"""How many torch threads a pooling step runs on (backend/pooling_engine.py asks before each step).

A step of at most ONE_THREAD_TOKENS padded tokens always runs on one thread: its matmuls are too small to be
worth splitting, and on a busy machine an OpenMP team's barriers cost far more than the work (shared 2-core
machine, load ~9, all-MiniLM-L6-v2, one 6-token sentence in process: p50 590-610 ms on 2 threads, 43-47 ms
on 1). For larger steps neither count always wins: on a quiet machine every core helps; on a machine whose
cores are busy with other work the team waits on its slowest member (load ~10, batches of 32 sentences of
20-60 words in process: 10 sentences/s on 2 threads, 22-25 on 1). So the chooser measures: it keeps a
moving average of seconds per padded token for the count it runs, tries the other after EXPLORE_EVERY
large steps (that sample replaces the other's figure), and runs the faster. Each try that loses doubles the
wait before the next, up to EXPLORE_MAX; a try that wins resets it. A lost try is dear: on a busy machine a
step on 2 threads took 3x one thread's (1.1 s vs 0.39 s a batch of 32), so trying every 8 steps cost the
batches a fifth of their throughput (all-MiniLM-L6-v2, load ~3: 62 vs 82 sentences/s over 12 steps)."""
from __future__ import annotations

ONE_THREAD_TOKENS = 64
EXPLORE_EVERY = 8      # large steps before the count not currently winning is tried again ...
EXPLORE_MAX = 64       # ... doubling after each try it loses, up to this
SMOOTHING = 0.3        # weight of the newest step in the moving average


class StepThreads:
    def __init__(self, max_threads: int) -> None:
        self.max_threads = max_threads
        self._cost: dict[int, float] = {}   # threads → moving average of seconds per padded token
        self._since = 0            # large steps since the losing count was last tried
        self._every = EXPLORE_EVERY

    def choose(self, padded_tokens: int) -> int:
        if self.max_threads <= 1 or padded_tokens <= ONE_THREAD_TOKENS:
            return 1
        self._since += 1
        for threads in (self.max_threads, 1):  # each count once, all threads first
            if threads not in self._cost:
                return threads
        best = min(self._cost, key=self._cost.__getitem__)
        if self._since >= self._every:
            self._since = 0
            return 1 if best == self.max_threads else self.max_threads
        return best

    def measured(self, threads: int, padded_tokens: int, seconds: float) -> None:
        """A large step's time on `threads` (small steps teach nothing: they always run on one)."""
        if padded_tokens <= ONE_THREAD_TOKENS or self.max_threads <= 1:
            return
        cost = seconds / padded_tokens
        old = self._cost.get(threads)
        best = min(self._cost, key=self._cost.__getitem__) if self._cost else threads
        # The count in use is averaged; the other's one sample replaces its stale figure, so a machine that
        # quietens (or gets busy) switches at the next exploration.
        self._cost[threads] = cost if old is None or threads != best else (1 - SMOOTHING) * old + SMOOTHING * cost
        if old is not None and threads != best:  # a try of the losing count: did it win this time?
            won = min(self._cost, key=self._cost.__getitem__) == threads
            self._every = EXPLORE_EVERY if won else min(2 * self._every, EXPLORE_MAX)
