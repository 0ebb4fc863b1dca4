"""Does torch.compile help the CPU decode step? Eager vs compiled dense layer halves, same run.

    .venv/bin/python benchmarks/compile_check.py [--batches 1,8,32] [--ctx 330]
Prints step latency, tok/s and the compiled/eager ratio per batch size, plus compile time.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.attention import KVCache  # noqa: E402
from backend.model import LlamaModel  # noqa: E402
from backend.model_runner import DirectChunk, DirectSeq, ModelRunner  # noqa: E402
from backend.weights import load_weights  # noqa: E402
from kvyard.model_config import load_model_config  # noqa: E402
from kvyard.model_path import embedded_model_path  # noqa: E402



def step_ms(model: LlamaModel, batch: int, ctx: int, reps: int = 5) -> float:
    c, bs = model.config, 16
    nb = ctx // bs + 2
    cache = KVCache(c.num_layers, batch * nb, bs, c.num_kv_heads, c.head_dim, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, cache)
    chunks = [DirectChunk(DirectSeq([7] * (ctx + 1), list(range(i * nb, (i + 1) * nb))), ctx, 1) for i in range(batch)]
    for _ in range(2):
        runner.run(chunks)
    t0 = time.perf_counter()
    for _ in range(reps):
        runner.run(chunks)
    return (time.perf_counter() - t0) / reps * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ctx", type=int, default=330)
    args = ap.parse_args()
    path = embedded_model_path()
    config = load_model_config(path)
    weights = load_weights(path, config, torch.float32, torch.device("cpu"))
    eager, compiled = LlamaModel(config, weights), LlamaModel(config, weights, compile=True)
    t0 = time.perf_counter()
    step_ms(compiled, 1, args.ctx, reps=1)
    step_ms(compiled, 2, args.ctx, reps=1)  # second shape: dynamic-shape recompile happens here
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; compile warm-up {time.perf_counter() - t0:.1f} s")
    print(f"{'batch':>5} {'eager ms':>9} {'compiled ms':>12} {'compiled/eager':>15} {'eager tok/s':>12}")
    for b in (int(x) for x in args.batches.split(",")):
        e, cpl = step_ms(eager, b, args.ctx), step_ms(compiled, b, args.ctx)
        print(f"{b:5} {e:9.1f} {cpl:12.1f} {cpl / e:15.2f} {b / e * 1000:12.1f}")


if __name__ == "__main__":
    main()
