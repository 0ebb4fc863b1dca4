"""Where a LoRA step's time goes on the embedded model: the CPU time of one decode step of 32 rows (context
64) and of one prefill step (10 prompts x 64 tokens), base rows only against rows spread over 4 random
rank-16 adapters plus the base (as benchmarks/lora.py's streams), the decode step fused (one C++ call) and op
by op. One thread and process CPU time, medians and minimums of interleaved repeats: on a shared machine the
wall clock mostly measures the neighbours.

    .venv/bin/python benchmarks/lora_step.py [--reps 7]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend import kernels  # noqa: E402
from backend.attention import KVCache  # noqa: E402
from backend.lora_weights import load_adapter  # noqa: E402
from backend.model import LlamaModel  # noqa: E402
from backend.model_runner import DirectChunk, DirectSeq, ModelRunner  # noqa: E402
from backend.weights import load_weights  # noqa: E402
from benchmarks.lora import write_adapter  # noqa: E402
from kvyard.model_config import load_model_config  # noqa: E402
from kvyard.model_path import embedded_model_path  # noqa: E402

CPU = torch.device("cpu")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    module = kernels.load()
    if module is None:
        sys.exit("the C++ kernels are unavailable here: no fused decode step to measure")
    path = embedded_model_path()
    config = load_model_config(path)
    model = LlamaModel(config, load_weights(path, config, torch.float32, CPU, keep_blocks=True,
                                            block_layout="n16"))  # int16 activations, the default
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [load_adapter(f"a{i}", write_adapter(Path(tmp) / f"a{i}", config, i), config, torch.float32, CPU)
                    for i in range(4)]
    cache = KVCache(config.num_layers, 32 * 6, 16, config.num_kv_heads, config.head_dim, torch.float16, CPU)
    runner = ModelRunner(model, cache)

    def chunks(rows: int, start: int, n: int, mixed: bool) -> list[DirectChunk]:
        return [DirectChunk(DirectSeq([100 + b] * (start + n), list(range(6 * b, 6 * b + 6)),
                                      (adapters[b % 5 - 1],) if mixed and b % 5 else ()), start, n)
                for b in range(rows)]

    fused = model.fused
    cases: dict[str, tuple[list[DirectChunk], object]] = {
        "decode, base rows, fused": (chunks(32, 64, 1, False), fused),
        "decode, 4 adapters + base, fused": (chunks(32, 64, 1, True), fused),
        "decode, base rows, op by op": (chunks(32, 64, 1, False), None),
        "decode, 4 adapters + base, op by op": (chunks(32, 64, 1, True), None),
        "prefill 10x64, base rows": (chunks(10, 0, 64, False), fused),
        "prefill 10x64, 4 adapters + base": (chunks(10, 0, 64, True), fused),
    }

    def run(step: list[DirectChunk], decoder: object) -> Callable[[], float]:
        def timed() -> float:
            model.fused = decoder
            t0 = time.process_time()
            runner.run(step)
            model.fused = fused
            return time.process_time() - t0
        return timed

    runs = {name: run(*case) for name, case in cases.items()}
    for timed in runs.values():
        timed()  # warm: kernels, adapters' fused forms
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, timed in runs.items():
            times[name].append(timed())
    print(f"one thread, CPU ms per step (median, min) of {args.reps} interleaved repeats")
    for name, ts in times.items():
        print(f"  {name:38s} {statistics.median(ts) * 1e3:7.1f}  {min(ts) * 1e3:7.1f}")


if __name__ == "__main__":
    main()
