"""Prefill attention on AMX-BF16 tiles, kvyard's kernel (backend/csrc/flash_bf16.h) against torch's CPU flash kernel
on the same bfloat16 operands, interleaved call by call, at the shapes the benchmarks run: the LLaVA-shaped model's
language model and CLIP tower (benchmarks/vision.py), the 1.7B (benchmarks/scale.py). Needs a CPU whose OS grants
AMX tiles.

    .venv/bin/python benchmarks/flash_attention.py [--threads 2] [--calls 25]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from role_procs import REPO  # noqa: E402

sys.path.insert(0, str(REPO))
from backend import kernels  # noqa: E402

SHAPES = [  # (what, query heads, KV heads, rows, causal)
    ("LLaVA-shaped LM, 1076 rows", 9, 3, 1076, True),
    ("its CLIP tower, 1024 patches", 6, 6, 1024, False),
    ("the 1.7B, 946 rows", 32, 8, 946, True),
    ("a 256-row chunk", 9, 3, 256, True),
    ("2048 rows", 9, 3, 2048, True),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=25)
    args = ap.parse_args()
    module = kernels.load_flash_bf16()
    if module is None:
        sys.exit("no AMX-BF16 tiles on this CPU (or the kernels did not build): nothing to compare")
    torch.set_num_threads(args.threads)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    print(f"| shape (heads of 64) | torch's flash kernel (ms) | kvyard's (ms) | ratio |\n|---|---|---|---|")
    for what, heads, kv_heads, rows, causal in SHAPES:
        q = torch.randn(rows, heads, 64).bfloat16()
        k, v = torch.randn(rows, kv_heads, 64).bfloat16(), torch.randn(rows, kv_heads, 64).bfloat16()
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        theirs = lambda: flash(qt, kt, vt, 0.0, causal)  # noqa: E731
        ours = lambda: module.flash_attention_bf16(q, k, v, 0, causal, 0.125)  # noqa: E731
        for _ in range(3):
            theirs(), ours()
        times: dict[str, list[float]] = {"theirs": [], "ours": []}
        for _ in range(args.calls):
            for name, fn in (("theirs", theirs), ("ours", ours)):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        a, b = statistics.median(times["theirs"]) * 1e3, statistics.median(times["ours"]) * 1e3
        print(f"| {what}, {heads} over {kv_heads}{', causal' if causal else ''} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
