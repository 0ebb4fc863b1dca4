"""A process tree read from /proc (Linux): who descends from a pid, and whether a recorded pid still lives."""
from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid), or None when the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # the name may hold spaces and parentheses
    return fields[0], int(fields[1])


def descendants(root: int) -> set[int]:
    """Every live process below `root` (not root itself)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            parents[int(entry)] = st[1]
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier and pid not in found}
        found |= frontier
    return found


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it holds no memory or ports: it counts as gone)."""
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def wait_gone(pids: Iterable[int], timeout_s: float) -> set[int]:
    """The pids still alive after up to timeout_s."""
    left = set(pids)
    deadline = time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        left = {p for p in left if alive(p)}
        if left:
            time.sleep(0.1)
    return {p for p in left if alive(p)}
