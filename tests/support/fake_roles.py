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
