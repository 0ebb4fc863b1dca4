"""Loading streams the weights into their serving format: the peak resident memory while loading stays
within 1.3x the served weights (the issue's bound), measured the way benchmarks/load_weights.py does, each
load in a fresh process; and without a terminal the progress shows as one log line per 10 %."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backend import kernels
from backend.weights import load_weights
from kvyard.model_config import load_model_config
from kvyard.model_path import embedded_model_path
from tests.support.procs import REPO
from tests.support.tiny_models import save_hf_dir, tiny_model

pytestmark = pytest.mark.slow

PEAK_BOUND = 1.3


def measure(path: Path, serve: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "load_weights.py"), "--one", str(path),
                           "--serve", serve], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(kernels.load() is None, reason="GGUF blocks need the C++ kernels")
def test_gguf_into_blocks_peaks_below_the_weights() -> None:
    """SmolLM2's GGUF as the server keeps it (measured +85 MB at the peak for 92 MB of blocks)."""
    r = measure(embedded_model_path(), "blocks")
    assert r["weights_mb"] > 80
    assert r["peak_over_mb"] <= PEAK_BOUND * r["weights_mb"], r


def test_bfloat16_directory_into_float32_peaks_near_the_weights(tmp_path: Path) -> None:
    """A bfloat16 Hugging Face checkpoint, sharded, served as float32 (twice the file): measured 1.09x
    on ~42M weights (160 MB served). A whole shard or state dict read first would be 1.5x and more.
    Big enough that the process's fixed first-use allocations (10-17 MB whatever the model: 1.23x at
    73 MB, 1.54x at 19 MB, up to 1.32x at 73 MB from a fresh clone) do not decide the ratio."""
    tiny = tiny_model("llama", hidden=1536, heads=8, kv_heads=2, layers=2)
    tiny.hf_model.to(torch.bfloat16)
    path = save_hf_dir(tiny, tmp_path / "bf16", max_shard_size="30MB")
    assert len(list(path.glob("*.safetensors"))) > 1
    r = measure(path, "dense")
    assert r["weights_mb"] > 150
    assert r["peak_over_mb"] <= PEAK_BOUND * r["weights_mb"], r


def test_progress_is_a_log_line_per_tenth_without_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    path = embedded_model_path()
    caplog.set_level(logging.INFO, logger="kvyard.weights")
    load_weights(path, load_model_config(path), torch.float32, torch.device("cpu"),
                 keep_blocks=kernels.load() is not None)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loading weights:")]
    assert [line.split()[2] for line in lines] == [f"{p}%" for p in range(10, 101, 10)], lines
