"""Where a decode step's time goes, phase by phase, at batch 1/8/32 (context 300), as `make run` serves.

    .venv/bin/python benchmarks/step_profile.py [--batches 1,8,32] [--ctx 300] [--activations auto|float32]
                                                [--gguf PATH] [--kquants auto|native|mixed|convert]

--gguf profiles another GGUF than the embedded model (e.g. benchmarks/scale_model.py's 1.7B-shaped Q4_K_M);
the weights' served kinds and bytes are printed first, with the step's memory bound at --bandwidth GB/s.
--cpu-time measures one thread's CPU time per step instead (comparable on a machine busy with other work).

A decode-only step runs in one C++ call (backend/csrc/decode_step.h); its phase timer sums thread 0's time
between the barriers that separate the ops (waiting for the other thread included), summed over the 30
layers. Prints ms per step for each phase, and the time outside them (Python, the runner's tensors)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend import kernels  # noqa: E402
from backend.attention import KVCache  # noqa: E402
from backend.model import LlamaModel  # noqa: E402
from backend.quant import QuantWeight  # noqa: E402
from backend.model_runner import DirectChunk, DirectSeq, ModelRunner  # noqa: E402
from backend.weights import load_weights  # noqa: E402
from kvyard.model_config import load_model_config  # noqa: E402
from kvyard.model_path import embedded_model_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--activations", default="int16", choices=("int16", "float32"),
                    help="int16 (the serving default: AVX-512 VNNI or AVX2) or float32")
    ap.add_argument("--gguf", type=Path, help="a GGUF to profile instead of the embedded model")
    ap.add_argument("--kquants", default="auto", choices=("auto", "native", "mixed", "convert"),
                    help="KQUANTS: how a GGUF's K-quant blocks are served (backend/config.py)")
    ap.add_argument("--bandwidth", type=float, default=23.0, help="read bandwidth, GB/s, for the memory bound")
    ap.add_argument("--cpu-time", action="store_true",
                    help="a busy machine: one thread, each batch's fastest step in process CPU time (no phases)")
    args = ap.parse_args()
    if args.cpu_time:
        torch.set_num_threads(1)
    module = kernels.load()
    if module is None:
        sys.exit("the C++ kernels are unavailable here: nothing to profile")
    int16 = args.activations == "int16"
    path = args.gguf or embedded_model_path()
    config = load_model_config(path)
    model = LlamaModel(config, load_weights(path, config, torch.float32, torch.device("cpu"), keep_blocks=True,
                                            block_layout="n16" if int16 else "rows", progress=False,
                                            kquants=args.kquants if int16 else "convert"))
    served = model.weight_bytes()
    print(f"{path.name}: {served / 1e6:.0f} MB served ({path.stat().st_size / 1e6:.0f} MB file): "
          + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in sorted(served_kinds(model.w).items()))
          + f"; memory bound at {args.bandwidth:g} GB/s: {served / args.bandwidth / 1e6:.1f} ms per one-row step")
    if model.fused is None:
        sys.exit("no fused decode step for these weights")
    print(f"{torch.get_num_threads()} threads, {'int16' if int16 else 'float32'} activations, float16 KV cache, "
          f"context {args.ctx}; ms per step")
    names = None
    for batch in (int(b) for b in args.batches.split(",")):
        nblk = args.ctx // 16 + 2
        cache = KVCache(config.num_layers, batch * nblk, 16, config.num_kv_heads, config.head_dim, torch.float16,
                        torch.device("cpu"))
        runner = ModelRunner(model, cache)
        chunks = [DirectChunk(DirectSeq([1] * (args.ctx + 1), list(range(b * nblk, (b + 1) * nblk))), args.ctx, 1)
                  for b in range(batch)]
        runner.run(chunks)
        if args.cpu_time:  # time slices lost to other work do not count; memory stalls do
            best = min(_cpu_seconds(runner.run, chunks) for _ in range(args.reps)) * 1000
            print(f"batch {batch}: {best:.1f} ms of CPU a step, {batch / best * 1000:.1f} tok/s on one core")
            continue
        model.fused.set_profiling(True)
        t0 = time.perf_counter()
        for _ in range(args.reps):
            runner.run(chunks)
        step = (time.perf_counter() - t0) / args.reps * 1000
        phases = {k: v / args.reps * 1000 for k, v in model.fused.profile().items()}
        model.fused.set_profiling(False)
        if names is None:
            names = sorted(phases, key=lambda k: -phases[k])
            print(f"{'batch':>5} {'step':>6} {'tok/s':>6}  " + " ".join(f"{n:>10}" for n in names) + f" {'outside':>8}")
        print(f"{batch:>5} {step:>6.1f} {batch / step * 1000:>6.0f}  " + " ".join(f"{phases[n]:>10.2f}" for n in names)
              + f" {step - sum(phases.values()):>8.2f}")


def _cpu_seconds(run: Any, chunks: list[DirectChunk]) -> float:
    start = time.process_time()
    run(chunks)
    return time.process_time() - start


def served_kinds(weights: dict[str, Any]) -> dict[str, int]:
    """Bytes per served kind (a matrix stacked from parts of several kinds counts each part as its own)."""
    out: dict[str, int] = {}
    for w in weights.values():
        for part in getattr(w, "parts", [w]):
            if isinstance(part, QuantWeight):
                kind, n = part.kind, part.nbytes()
            else:
                kind, n = str(part.dtype).removeprefix("torch."), part.numel() * part.element_size()
            out[kind] = out.get(kind, 0) + n
    return out


if __name__ == "__main__":
    main()
