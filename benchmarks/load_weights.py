"""Weight loading: time and peak resident memory, per checkpoint format and serving format.

Checkpoints: the embedded SmolLM2 GGUF, and a generated random Llama 3 model (default ~35M parameters) in
every format a user brings: Hugging Face directories (float32 and bfloat16 safetensors, sharded with an
index) and GGUFs (Q4_0/Q4_1/Q8_0 as converters quantize, Q4_K mixes, and F16/BF16/Q5/Q6_K types that are
requantized to Q8_0). Each load runs in a fresh process: resident memory before the weights, the peak while
loading (the high-water mark reset just before, Linux's clear_refs) and after.
The issue's bound: peak over the baseline ≤ 1.3x the served weights.

    .venv/bin/python benchmarks/load_weights.py [--hidden 1024] [--layers 4]
    .venv/bin/python benchmarks/load_weights.py --one PATH --serve blocks|n16|dense   # one load, as JSON
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK_BOUND = 1.3


def measure_one(path: Path, serve: str) -> dict[str, Any]:
    """Load `path` once in this process, served as GGUF blocks ("blocks": float32-activation rows,
    "n16": int16-activation layout) or dense float32; what it cost."""
    import gc

    import torch

    from backend.main import peak_resident_mb, reset_peak_resident, resident_mb
    from backend.quant import QuantWeight
    from backend.weights import load_weights
    from kvyard.model_config import load_model_config

    torch.set_num_threads(1)
    config = load_model_config(path)
    gc.collect()
    before = resident_mb()
    reset_peak_resident()
    start = time.monotonic()
    weights = load_weights(path, config, torch.float32, torch.device("cpu"), keep_blocks=serve != "dense",
                           block_layout="n16" if serve == "n16" else "rows", progress=False)
    seconds = time.monotonic() - start
    n_bytes = sum(w.nbytes() if isinstance(w, QuantWeight) else w.numel() * w.element_size()
                  for w in weights.values())
    return {"path": str(path), "serve": serve, "load_s": seconds, "weights_mb": n_bytes / 2**20,
            "peak_over_mb": peak_resident_mb() - before, "kept_over_mb": resident_mb() - before,
            "file_mb": _size(path) / 2**20}


def run_one(path: Path, serve: str) -> dict[str, Any]:
    """measure_one in a fresh process (its own baseline and high-water mark)."""
    done = subprocess.run([sys.executable, __file__, "--one", str(path), "--serve", serve],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"loading {path} ({serve}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*")) if path.is_dir() else path.stat().st_size


def generated_checkpoints(root: Path, hidden: int, layers: int) -> list[tuple[str, Path, list[str]]]:
    """A random Llama 3 model written in each format, with the serving formats to load each as."""
    import torch

    from tests.support.tiny_models import EXACT_TYPES, Q4_K_TYPES, REQUANTIZED_TYPES, save_hf_dir, tiny_model, write_gguf

    tiny = tiny_model("llama", hidden=hidden, heads=hidden // 128, kv_heads=max(1, hidden // 512), layers=layers)
    out: list[tuple[str, Path, list[str]]] = []
    out.append(("generated HF dir, float32 safetensors", save_hf_dir(tiny, root / "hf-f32", max_shard_size="50MB"),
                ["dense"]))
    tiny.hf_model.to(torch.bfloat16)
    out.append(("generated HF dir, bfloat16 safetensors", save_hf_dir(tiny, root / "hf-bf16", max_shard_size="50MB"),
                ["dense"]))
    tiny.hf_model.to(torch.float32)
    blocks = ["blocks", "n16", "dense"]
    for label, types in (("Q4_0/Q4_1/Q8_0", EXACT_TYPES), ("Q4_K mix", Q4_K_TYPES),
                         ("F16/BF16/Q5/Q6_K, requantized", REQUANTIZED_TYPES)):
        path = write_gguf(tiny, root / f"{label.split('/')[0].split(' ')[0].lower()}.gguf", types)
        out.append((f"generated GGUF, {label}", path, blocks))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--one", type=Path, help="load this checkpoint once and print the figures as JSON")
    ap.add_argument("--serve", default="blocks", choices=["blocks", "n16", "dense"])
    ap.add_argument("--hidden", type=int, default=1024, help="generated model width (a multiple of 512)")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(measure_one(args.one, args.serve)))
        return

    from backend import kernels
    from kvyard.model_path import embedded_model_path

    module = kernels.load()
    usable = {"dense"} | ({"blocks", "n16"} if module is not None else set())
    with tempfile.TemporaryDirectory() as tmp:
        cases = [("SmolLM2-135M GGUF (embedded)", embedded_model_path(), ["blocks", "n16", "dense"]),
                 *generated_checkpoints(Path(tmp), args.hidden, args.layers)]
        print(f"{'checkpoint':42} {'served as':10} {'file MB':>8} {'weights MB':>10} {'load s':>7} "
              f"{'peak +MB':>9} {'peak/weights':>12}")
        worst = 0.0
        for label, path, serves in cases:
            for serve in serves:
                if serve not in usable:
                    continue
                r = run_one(path, serve)
                ratio = r["peak_over_mb"] / r["weights_mb"]
                worst = max(worst, ratio)
                print(f"{label:42} {serve:10} {r['file_mb']:8.1f} {r['weights_mb']:10.1f} {r['load_s']:7.2f} "
                      f"{r['peak_over_mb']:9.1f} {ratio:12.2f}", flush=True)
    print(f"\nworst peak / served weights: {worst:.2f} (bound {PEAK_BOUND})")


if __name__ == "__main__":
    main()
