"""A backend learns from the master's register answers whether the master can dial the address it registered."""
from __future__ import annotations

from backend.registration import UNREACHABLE_AFTER, Reachability

FAILING = {"name": "10.0.0.9:8089", "registered": True, "healthy": False, "error": "UNAVAILABLE: no route"}
HEALTHY = {"name": "10.0.0.9:8089", "registered": True, "healthy": True, "error": None}
NOT_POLLED_YET = {"name": "10.0.0.9:8089", "registered": True, "healthy": False, "error": None}


def test_warns_once_after_several_failing_answers_then_says_when_it_is_reachable_again() -> None:
    r = Reachability()
    assert [r.update(FAILING) for _ in range(UNREACHABLE_AFTER - 1)] == [None] * (UNREACHABLE_AFTER - 1)
    warning = r.update(FAILING)
    assert warning is not None and "10.0.0.9:8089" in warning and "ADVERTISE_HOST" in warning and r.warned
    assert r.update(FAILING) is None  # once
    back = r.update(HEALTHY)
    assert back is not None and "again" in back and not r.warned


def test_no_warning_before_the_first_poll_or_from_an_older_master() -> None:
    r = Reachability()
    for answer in [NOT_POLLED_YET] * 5 + [{"name": "x", "registered": True}] * 5 + [None] * 5:
        assert r.update(answer) is None
    assert [r.update(a) for a in (FAILING, FAILING, HEALTHY, FAILING, FAILING)] == [None] * 5  # not in a row
