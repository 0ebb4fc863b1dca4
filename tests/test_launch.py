"""The launcher (`python -m kvyard`) refuses bad configuration with one line and exit code 2."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import REPO


@pytest.mark.parametrize("env", [{"ROLE_TYPE": "NOPE"}, {"CHECKPOINT_PATH": "/does/not/exist"},
                                 {"ROLE_TYPE": "FRONTEND", "CHECKPOINT_PATH": "/does/not/exist"}],
                         ids=["role", "checkpoint", "frontend-checkpoint"])
def test_launcher_bad_config_exits_2(env: dict[str, str]) -> None:
    full = {k: v for k, v in os.environ.items() if k not in ("ROLE_TYPE", "CHECKPOINT_PATH", "TOKENIZER_PATH")}
    full["PYTHONPATH"] = str(REPO) + os.pathsep + full.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "kvyard"], env={**full, **env}, cwd=Path(REPO),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvyard: error:")
    assert ("NOPE" if env.get("ROLE_TYPE") == "NOPE" else "/does/not/exist") in lines[0]
