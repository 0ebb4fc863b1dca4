"""When `kvyard cluster` restarts a part that exited on its own: backoff, and a bound on restarts.

Pure bookkeeping (the clock is passed in), so it is tested without processes. A part is restarted after
1 s, then 2, 4, ... up to 30 s while it keeps dying soon after each start; one that ran `stable_s` before
dying starts again from 1 s. More than `max_restarts` restarts within `window_s` and it is left down.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int            # restarts of one part within window_s; 0: never restart
    window_s: float = 600.0
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    stable_s: float = 60.0       # a part up this long before it died has its backoff reset


@dataclass
class _History:
    restarts: deque[float] = field(default_factory=deque)  # when each restart was decided
    quick_deaths: int = 0                                    # deaths in a row, each soon after its start


class Restarts:
    """One per cluster: `on_exit` says how long to wait before starting a part again, or None to leave it down."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._parts: dict[str, _History] = {}

    def on_exit(self, name: str, started_at: float, now: float) -> float | None:
        p = self.policy
        h = self._parts.setdefault(name, _History())
        while h.restarts and now - h.restarts[0] > p.window_s:
            h.restarts.popleft()
        if len(h.restarts) >= p.max_restarts:
            return None
        h.quick_deaths = h.quick_deaths + 1 if now - started_at < p.stable_s else 1
        h.restarts.append(now)
        return min(p.max_delay_s, p.first_delay_s * 2 ** (h.quick_deaths - 1))

    def count(self, name: str) -> int:
        """Restarts of this part within the window (as of its last exit)."""
        h = self._parts.get(name)
        return len(h.restarts) if h else 0
