"""One upstream's circuit breaker: consecutive 5xx and connection errors open it, 4xx never count. Pure.

closed ──(failures in a row ≥ threshold)──▶ open ──(open_s passed)──▶ half-open
  ▲                                                                     │ one trial request
  └────────────── success ◀─────────────────────────────────────────────┘ failure: open again
"""
from __future__ import annotations

from dataclasses import dataclass

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    threshold: int                  # failures in a row that open it
    open_s: float                   # how long it stays open before a trial
    failures: int = 0               # consecutive failures so far
    opened_at: float | None = None  # when it last opened (monotonic seconds); None = closed

    def state(self, now: float) -> str:
        if self.opened_at is None:
            return CLOSED
        return OPEN if now < self.opened_at + self.open_s else HALF_OPEN

    def record_success(self) -> None:
        self.failures = 0
        self.opened_at = None

    def record_failure(self, now: float) -> None:
        self.failures += 1
        if self.failures >= self.threshold or self.opened_at is not None:  # a failed trial reopens it
            self.opened_at = now
