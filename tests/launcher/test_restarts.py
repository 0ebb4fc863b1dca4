"""launcher/restarts.py: backoff while a part keeps dying, reset once it ran a while, and a bound per window."""
from __future__ import annotations

from launcher.restarts import RestartPolicy, Restarts


def test_backoff_doubles_while_a_part_dies_soon_after_each_start() -> None:
    r = Restarts(RestartPolicy(max_restarts=10, window_s=1e9))
    now, delays = 0.0, []
    for _ in range(7):
        delay = r.on_exit("backend-1", started_at=now, now=now + 5)
        assert delay is not None
        delays.append(delay)
        now += 5 + delay
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    assert r.count("backend-1") == 7 and r.count("backend-2") == 0


def test_a_part_that_ran_a_while_restarts_after_the_first_delay_again() -> None:
    r = Restarts(RestartPolicy(max_restarts=10, window_s=1e9, stable_s=60))
    assert r.on_exit("b", started_at=0, now=1) == 1
    assert r.on_exit("b", started_at=2, now=3) == 2
    assert r.on_exit("b", started_at=4, now=100) == 1  # up 96 s: stable


def test_more_restarts_than_the_bound_within_the_window_leave_it_down() -> None:
    r = Restarts(RestartPolicy(max_restarts=2, window_s=600))
    assert r.on_exit("b", started_at=0, now=100) is not None
    assert r.on_exit("b", started_at=101, now=200) is not None
    assert r.on_exit("b", started_at=201, now=300) is None      # a third within 600 s
    assert r.on_exit("other", started_at=0, now=300) is not None  # per part
    assert r.on_exit("b", started_at=301, now=801) is not None  # the first restart left the window


def test_zero_never_restarts() -> None:
    assert Restarts(RestartPolicy(max_restarts=0)).on_exit("b", started_at=0, now=1000) is None
