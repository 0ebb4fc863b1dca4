"""How many torch threads a pooling step runs on (backend/pooling_engine.py asks before each step).

Neither one thread nor all always wins. On a quiet machine every core helps; on a machine whose cores are
busy with other work an OpenMP team waits on its slowest member at every op (load ~10, batches of 32
sentences of 20-60 words in process: 10 sentences/s on 2 threads, 22-25 on 1; load ~9, one 6-token sentence:
p50 590-610 ms on 2 threads, 43-47 ms on 1; at load ~2, 5.3-5.6 ms on 2 and 7.7-9.1 on 1). So the engine
keeps two choosers, one for small steps (at most SMALL_STEP_TOKENS padded tokens, whose time is mostly
streaming the weights: compared per step, one thread tried first) and one for large steps (compared per
padded token, all threads first). Each keeps a moving average of the cost of the count it runs, tries the
other after EXPLORE_EVERY steps (that sample replaces the other's figure), and runs the cheaper. Each try
that loses doubles the wait before the next, up to EXPLORE_MAX; a try that wins resets it. A lost try is
dear: on a busy machine a step on 2 threads took 3x one thread's (1.1 s vs 0.39 s a batch of 32), so trying
every 8 steps cost the batches a fifth of their throughput (all-MiniLM-L6-v2, load ~3: 62 vs 82 sentences/s
over 12 steps)."""
from __future__ import annotations

SMALL_STEP_TOKENS = 64
EXPLORE_EVERY = 8      # steps before the count not currently winning is tried again ...
EXPLORE_MAX = 64       # ... doubling after each try it loses, up to this
SMOOTHING = 0.3        # weight of the newest step in the moving average


class StepThreads:
    def __init__(self, max_threads: int, first: int | None = None) -> None:
        self.max_threads = max_threads
        self.first = max_threads if first is None else first   # the count tried first
        self._cost: dict[int, float] = {}   # threads → moving average of the cost of a unit of work
        self._since = 0            # steps since the losing count was last tried
        self._every = EXPLORE_EVERY

    def choose(self) -> int:
        if self.max_threads <= 1:
            return 1
        self._since += 1
        for threads in (self.first, 1 if self.first == self.max_threads else self.max_threads):
            if threads not in self._cost:  # each count once
                return threads
        best = min(self._cost, key=self._cost.__getitem__)
        if self._since >= self._every:
            self._since = 0
            return 1 if best == self.max_threads else self.max_threads
        return best

    def measured(self, threads: int, cost: float) -> None:
        """A step's cost on `threads` (seconds, or seconds per padded token)."""
        if self.max_threads <= 1:
            return
        old = self._cost.get(threads)
        best = min(self._cost, key=self._cost.__getitem__) if self._cost else threads
        # The count in use is averaged; the other's one sample replaces its stale figure, so a machine that
        # quietens (or gets busy) switches at the next exploration.
        self._cost[threads] = cost if old is None or threads != best else (1 - SMOOTHING) * old + SMOOTHING * cost
        if old is not None and threads != best:  # a try of the losing count: did it win this time?
            won = min(self._cost, key=self._cost.__getitem__) == threads
            self._every = EXPLORE_EVERY if won else min(2 * self._every, EXPLORE_MAX)
