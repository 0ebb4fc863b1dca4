"""Where a cold prefill's time goes, op by op, as the serving default computes it (GGUF blocks, n16 layout
where the CPU has AVX-512 VNNI, a float16 KV cache), and the prefill attention kernel against SDPA.

    .venv/bin/python benchmarks/prefill_profile.py [--gguf PATH] [--tokens 940] [--reps 3]
                                                   [--gemms int16,float32,bfloat16,bfloat16-onednn]

One prompt of --tokens random tokens in one chunk (the engine's budget holds it whole), driven through the
model runner. Each rep runs the prompt with the attention kernel on and off, interleaved (a shared machine
drifts: compare within a run); the op table is the fastest rep with the kernel on. Then torch.matmul at the
model's linear shapes, the float32 GEMM rate the linears can reach here. --gemms times the whole prompt once
per rep with each PREFILL_GEMM choice for the n16 linears, interleaved (which one a CPU kind should default to);
bfloat16-onednn is bfloat16 the way CPUs without brgemm's bfloat16 tiles take it (W^T tiles, oneDNN's GEMM)."""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend import kernels  # noqa: E402
from backend.attention import KVCache  # noqa: E402
from backend.model import LlamaModel  # noqa: E402
from backend.model_runner import DirectChunk, DirectSeq, ModelRunner  # noqa: E402
from backend.weights import load_weights  # noqa: E402
from kvyard.model_config import load_model_config  # noqa: E402
from kvyard.model_path import embedded_model_path  # noqa: E402

OPS = ("embed", "rms_norm", "linear", "gate_up_silu", "rope_store", "attention", "silu_mul")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path, default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--tokens", type=int, default=940)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gemms", default="", help="also time the whole prompt with each of these PREFILL_GEMMs "
                    "(e.g. int16,float32,bfloat16), interleaved, after the op table")
    args = ap.parse_args()
    module = kernels.load()
    if module is None:
        sys.exit("the C++ kernels are unavailable here: nothing to profile")
    path = args.gguf or embedded_model_path()
    config = load_model_config(path)
    model = LlamaModel(config, load_weights(path, config, torch.float32, torch.device("cpu"), keep_blocks=True,
                                            block_layout="n16", progress=False))  # int16: the default
    ops, spent, depth = model.ops, defaultdict(float), [0]
    for name in OPS:  # time every outermost op call (instance attributes shadow the class's methods; a
        # stacked weight's linear calls linear per part)
        def timed(*a, _f=getattr(ops, name), _n=name, **kw):  # type: ignore[no-untyped-def]
            depth[0] += 1
            t = time.perf_counter()
            try:
                return _f(*a, **kw)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    spent[_n] += time.perf_counter() - t
        setattr(ops, name, timed)
    n, nblk = args.tokens, args.tokens // 16 + 2
    cache = KVCache(config.num_layers, nblk, 16, config.num_kv_heads, config.head_dim, torch.float16,
                    torch.device("cpu"))
    runner = ModelRunner(model, cache)
    ids = torch.randint(100, config.vocab_size - 100, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt = [DirectChunk(DirectSeq(ids, list(range(nblk))), 0, n)]
    runner.run([DirectChunk(DirectSeq(ids[:64], list(range(nblk))), 0, 64)])  # warm up
    kernel_on = getattr(ops, "prefill_kernel", False)
    totals: dict[bool, list[float]] = {True: [], False: []}
    best: tuple[float, dict[str, float]] | None = None
    for _ in range(args.reps):
        for on in ((True, False) if kernel_on else (False,)):
            ops.prefill_kernel = on
            spent.clear()
            t0 = time.perf_counter()
            runner.run(prompt)
            totals[on].append(time.perf_counter() - t0)
            if on == kernel_on and (best is None or totals[on][-1] < best[0]):
                best = (totals[on][-1], dict(spent))
    ops.prefill_kernel = kernel_on
    assert best is not None
    if args.gemms:  # the prefill linears' GEMM choice (KernelOps.n16_gemm), each rep interleaved
        chosen, tiles, by_gemm = ops.n16_gemm, getattr(ops, "bf16_tiles", False), defaultdict(list)
        for _ in range(args.reps):
            for gemm in args.gemms.split(","):
                ops.n16_gemm = None if gemm == "int16" else getattr(torch, gemm.removesuffix("-onednn"))
                ops.bf16_tiles = tiles and gemm == "bfloat16"  # bfloat16-onednn: W^T tiles, bf16_matmul
                t0 = time.perf_counter()
                runner.run(prompt)
                by_gemm[gemm].append(time.perf_counter() - t0)
        ops.n16_gemm, ops.bf16_tiles = chosen, tiles
        print("PREFILL_GEMM, each rep (ms): " + "; ".join(
            f"{g} {', '.join(f'{t * 1000:.0f}' for t in ts)}" for g, ts in by_gemm.items()))
    print(f"{torch.get_num_threads()} threads, {n}-token prompt, {path.name}: fastest rep {best[0] * 1000:.0f} ms")
    for name, s in sorted(best[1].items(), key=lambda kv: -kv[1]):
        print(f"  {name:12s} {s * 1000:8.1f} ms  {100 * s / best[0]:5.1f} %")
    print(f"  {'other':12s} {(best[0] - sum(best[1].values())) * 1000:8.1f} ms")
    if kernel_on:
        print("prefill attention kernel on / off, each rep (ms):",
              [f"{a * 1000:.0f}/{b * 1000:.0f}" for a, b in zip(totals[True], totals[False])])
    shapes = {tuple(w.shape) for k, w in model.w.items() if k.startswith("layers.0.") and len(w.shape) == 2}
    for out_f, in_f in sorted(shapes):
        x, w = torch.randn(n, in_f), torch.randn(in_f, out_f)
        dt = min(_timed(lambda: x @ w) for _ in range(3))
        print(f"torch.matmul {n}x{in_f}x{out_f}: {2 * n * in_f * out_f / dt / 1e9:.0f} GFLOP/s")


def _timed(f) -> float:  # type: ignore[no-untyped-def]
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
