"""The engine's recent speed, as moving averages the master routes on (GetWorkerStatus)."""
from __future__ import annotations

EMA = 0.2  # weight of the newest step in the moving averages


class StepStats:
    def __init__(self) -> None:
        self.iterations = 0                # steps run since start
        self.step_latency_ms = 0.0         # moving average of one step's wall time
        self.prefill_tokens_per_s = 0.0    # moving average over steps that computed prompt tokens; 0 = none yet

    def measure(self, prefill_tokens: int, seconds: float) -> None:
        self.iterations += 1
        ms = seconds * 1000
        self.step_latency_ms = ms if self.iterations == 1 else (1 - EMA) * self.step_latency_ms + EMA * ms
        if prefill_tokens > 0:
            rate = prefill_tokens / seconds
            self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else \
                (1 - EMA) * self.prefill_tokens_per_s + EMA * rate
