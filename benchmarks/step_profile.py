"""Where a decode step's time goes: the model's ops timed one by one at batch 1/8/32 (context 300).

    .venv/bin/python benchmarks/step_profile.py [--batches 1,8,32] [--ctx 300]

Prints ms per step for each op kind of backend/ops.py (summed over the 30 layers), with the serving
format make run uses (GGUF blocks + C++ kernels on an AVX2 CPU)."""
from __future__ import annotations

import argparse
import collections
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

OPS = ("embed", "rms_norm", "linear", "rope_store", "attention", "silu_mul")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kv-dtype", default="float16", choices=("float32", "float16"))  # the serving default: float16
    args = ap.parse_args()
    path = embedded_model_path()
    config = load_model_config(path)
    model = LlamaModel(config, load_weights(path, config, torch.float32, torch.device("cpu"), keep_blocks=True))
    spent: collections.Counter[str] = collections.Counter()
    for name in OPS:
        fn = getattr(model.ops, name)

        def timed(*a, _fn=fn, _name=name, **k):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            out = _fn(*a, **k)
            spent[_name] += time.perf_counter() - t0
            return out
        setattr(model.ops, name, timed)
    print(f"ops: {type(model.ops).__name__}, {torch.get_num_threads()} threads, context {args.ctx}")
    print(f"{'batch':>5} {'step ms':>8} {'tok/s':>7}  " + " ".join(f"{n:>10}" for n in OPS) + f" {'other':>7}")
    for batch in (int(b) for b in args.batches.split(",")):
        nblk = args.ctx // 16 + 2
        cache = KVCache(config.num_layers, batch * nblk, 16, config.num_kv_heads, config.head_dim,
                        getattr(torch, args.kv_dtype), torch.device("cpu"))
        runner = ModelRunner(model, cache)
        chunks = [DirectChunk(DirectSeq([1] * (args.ctx + 1), list(range(b * nblk, (b + 1) * nblk))), args.ctx, 1)
                  for b in range(batch)]
        runner.run(chunks)
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(args.reps):
            runner.run(chunks)
        step = (time.perf_counter() - t0) / args.reps * 1000
        parts = {n: spent[n] / args.reps * 1000 for n in OPS}
        print(f"{batch:>5} {step:>8.1f} {batch / step * 1000:>7.0f}  " + " ".join(f"{parts[n]:>10.1f}" for n in OPS)
              + f" {step - sum(parts.values()):>7.1f}")


if __name__ == "__main__":
    main()
