"""Role processes for launcher tests: each logs when SIGTERM arrives and when it exits, and drains for
DRAIN_S seconds after the signal (what a frontend with requests in flight, or a backend serving them, does)."""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Mapping


def _draining(name: str, env: Mapping[str, str]) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with open(env["EVENTS"], "a") as f:
        f.write(f"{name} up {time.monotonic()}\n")
    stop.wait()
    with open(env["EVENTS"], "a") as f:
        f.write(f"{name} term {time.monotonic()}\n")
    time.sleep(float(env[f"{name.upper()}_DRAIN_S"]))
    with open(env["EVENTS"], "a") as f:
        f.write(f"{name} exit {time.monotonic()}\n")


def fake_backend(env: Mapping[str, str]) -> None:
    _draining("backend", env)


def fake_frontend(env: Mapping[str, str]) -> None:
    _draining("frontend", env)


def _stubborn(name: str, env: Mapping[str, str]) -> None:
    """Ignores SIGTERM and has started two children of its own (as a role with helper processes would):
    one tied to it the way every kvyard child is (kvyard/parent_death.py), one not."""
    import functools
    import os
    import subprocess

    from kvyard.parent_death import die_with_parent
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tied = subprocess.Popen(["sleep", "600"], preexec_fn=functools.partial(die_with_parent, os.getpid()))
    untied = subprocess.Popen(["sleep", "600"])
    with open(env["EVENTS"], "a") as f:
        f.write(f"{name} pids {os.getpid()} {tied.pid} {untied.pid}\n")
    time.sleep(600)


def stubborn_backend(env: Mapping[str, str]) -> None:
    _stubborn("backend", env)


def stubborn_frontend(env: Mapping[str, str]) -> None:
    _stubborn("frontend", env)
