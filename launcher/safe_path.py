"""Role processes import only kvyard's own code and the environment's packages, never a module that
happens to sit in the directory `kvyard` was started from (a `resource.py` or `json.py` in a shared,
writable directory would otherwise run inside every role).

Python puts that directory first on sys.path for `python -m` and `python -c`, which is how the launcher
starts roles (`kvyard cluster`'s parts) and multiprocessing starts a role's processes. Safe-path mode
(PYTHONSAFEPATH=1, Python 3.11's `-P`) leaves it out; PYTHONPATH then names the directory kvyard itself
is imported from, so a checkout that was never installed still runs."""
from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

CODE_ROOT = str(Path(__file__).resolve().parent.parent)  # holds the kvyard, launcher, frontend, ... packages


def harden(environ: MutableMapping[str, str] = os.environ) -> None:
    """Every process started from here on (subprocess or multiprocessing) runs in safe-path mode and
    finds kvyard where this one did; PYTHONPATH entries already there keep their precedence."""
    environ["PYTHONSAFEPATH"] = "1"
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if CODE_ROOT not in paths:
        environ["PYTHONPATH"] = os.pathsep.join([*paths, CODE_ROOT])


def drop_start_directory() -> None:
    """`python -m kvyard` without -P: the start directory, sys.path[0], becomes kvyard's own code root (the
    same entry when kvyard runs from its checkout); everything imported from here on is safe."""
    if not sys.flags.safe_path and sys.path and Path(sys.path[0] or ".").resolve() == Path.cwd().resolve():
        sys.path[0] = CODE_ROOT
