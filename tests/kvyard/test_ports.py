"""Free-port picks for tests and launchers stay out of the kernel's ephemeral range and never overlap."""
from __future__ import annotations

import socket

from kvyard import ports


def test_blocks_come_from_below_the_ephemeral_range_and_are_free() -> None:
    low, _high = ports._ephemeral_range()
    base = ports.free_port_block(6)
    assert base + 6 <= low
    for p in range(base, base + 6):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_successive_blocks_are_disjoint() -> None:
    seen: set[int] = set()
    for _ in range(50):
        base = ports.free_port_block(6)
        block = set(range(base, base + 6))
        assert not block & seen
        seen |= block


def test_a_taken_port_is_skipped() -> None:
    taken = ports.free_port_block(1)
    with socket.socket() as held:
        held.bind(("127.0.0.1", taken))
        held.listen()
        ports._cursor = taken - 2
        base = ports.free_port_block(6)
        assert base == taken + 4  # the block holding `taken` is passed over; the next one is handed out
