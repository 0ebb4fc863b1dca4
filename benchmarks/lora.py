"""LoRA adapters on the embedded model (SmolLM2-135M, the default serving format): decode throughput of 32
streams spread over 4 adapters plus the base model against 32 streams of the base model alone, in the same
run (rounds interleaved, medians), and the load time of one rank-16 adapter.

The adapters are random (rank 16 on q/k/v/o/gate/up/down, PEFT's file layout): their numbers do not matter
to the speed. The engine is driven directly (no servers), as benchmarks/engine_throughput.py does.

    .venv/bin/python benchmarks/lora.py [--streams 32] [--out 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.config import BackendConfig  # noqa: E402
from backend.engine import Engine, GenerationRequest  # noqa: E402
from backend.lora import LoraRegistry  # noqa: E402
from backend.lora_weights import TARGETS  # noqa: E402
from backend.main import build_engine_loop  # noqa: E402
from backend.sequence import StopConditions  # noqa: E402
from kvyard.model_config import ModelConfig  # noqa: E402
from kvyard.sampling_params import SamplingParams  # noqa: E402

RANK = 16


def write_adapter(path: Path, config: ModelConfig, seed: int) -> Path:
    """A random rank-16 PEFT LoRA of every projection, as `save_pretrained` lays it out."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    d, q, kv, f = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.intermediate_size
    shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "gate_proj": (d, f),
              "up_proj": (d, f), "down_proj": (f, d)}  # (in, out)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (n_in, n_out) in shapes.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(RANK, n_in, generator=gen) * 0.01
            tensors[f"{stem}.lora_B.weight"] = torch.randn(n_out, RANK, generator=gen) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(TARGETS), "bias": "none"}))
    return path


def run_round(engine: Engine, prompts: list[list[int]], adapters: list[str], out: int, tag: str) -> float:
    """All streams at once to the end; output tokens per second."""
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        req = GenerationRequest(f"{tag}-{i}", prompt, SamplingParams(adapter=adapter),
                                StopConditions(max_new_tokens=out, ignore_eos=True))
        engine.validate(req)
        engine.add(req)
    tokens, t0 = 0, time.perf_counter()
    while engine.has_work:
        tokens += len(engine.step())
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--out", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    loop, _, _, _ = build_engine_loop(BackendConfig.from_env({"KV_CACHE_MB": "256"}))
    engine = loop.engine
    assert isinstance(engine, Engine) and isinstance(engine.loras, LoraRegistry)
    model = engine.runner.model
    config = model.config
    with tempfile.TemporaryDirectory() as tmp:
        paths = [write_adapter(Path(tmp) / f"a{i}", config, i) for i in range(4)]
        load_ms = []
        for trial in range(5):
            t0 = time.perf_counter()
            engine.loras.load(f"a{trial % 4}", str(paths[trial % 4]), start_up=True)
            load_ms.append((time.perf_counter() - t0) * 1e3)
        for i, path in enumerate(paths):
            engine.loras.load(f"a{i}", str(path), start_up=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, config.vocab_size) for _ in range(rng.randint(32, 96))] for _ in range(args.streams)]
    names = ["", "a0", "a1", "a2", "a3"]
    mixed = [names[i % len(names)] for i in range(args.streams)]
    base_alone = [""] * args.streams
    run_round(engine, prompts[:4], base_alone[:4], 4, "warm")  # kernels and caches warm
    run_round(engine, prompts[:5], mixed[:5], 4, "warm-mixed")
    base_rates, mixed_rates = [], []
    for r in range(args.rounds):  # interleaved: the machine's noise hits both alike
        base_rates.append(run_round(engine, prompts, base_alone, args.out, f"base{r}"))
        mixed_rates.append(run_round(engine, prompts, mixed, args.out, f"mixed{r}"))
    base, mix = statistics.median(base_rates), statistics.median(mixed_rates)
    print(f"model: {config.num_layers} layers, hidden {config.hidden_size}; {type(model.ops).__name__}; "
          f"threads {torch.get_num_threads()}")
    print(f"rank-{RANK} adapter load (q/k/v/o/gate/up/down, {config.num_layers} layers): median "
          f"{statistics.median(load_ms):.0f} ms (of {', '.join(f'{x:.0f}' for x in load_ms)})")
    print(f"{args.streams} streams x {args.out} tokens, base alone: {base:.0f} tok/s "
          f"(rounds {', '.join(f'{x:.0f}' for x in base_rates)})")
    print(f"{args.streams} streams over 4 adapters + base: {mix:.0f} tok/s "
          f"(rounds {', '.join(f'{x:.0f}' for x in mixed_rates)})")
    print(f"ratio mixed / base alone: {mix / base:.2f}")


if __name__ == "__main__":
    main()
