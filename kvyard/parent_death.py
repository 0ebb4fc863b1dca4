"""Ties a process's life to its parent's: on Linux the kernel signals it when the parent dies, even by SIGKILL.

Every process a launcher starts (`kvyard cluster`'s parts, a role's multiprocessing children) calls
`die_with_parent` first thing, so no role process outlives the launcher that started it, whatever signals
arrive: nothing is left holding ports and memory under PID 1. The signal is tied to the parent *thread*
that started the child: launchers start their children from their main thread.
"""
from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def _find_prctl() -> object | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: no parent-death signal
        return None


_PRCTL = _find_prctl()  # looked up at import: a child between fork and exec must not load libraries


def supported() -> bool:
    return _PRCTL is not None


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Have `sig` sent to this process when its parent dies. `parent_pid` is the parent that started us:
    if it died before this call (the kernel only signals for deaths after it), we die now. Safe to call
    between fork and exec (a subprocess preexec_fn): no allocation, no import."""
    if _PRCTL is None:
        return
    _PRCTL(PR_SET_PDEATHSIG, sig)  # type: ignore[operator]
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
