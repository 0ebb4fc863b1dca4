"""The engine on a CUDA GPU against transformers' `generate` on the same GPU and weights (`make bench-cuda`).

    python benchmarks/cuda_engine.py [--layers 24 --hidden 2048 --heads 32 --ffn 8192] [--rounds 2] [--out 128]
                                     [--eager]        (also kvyard with CUDA_GRAPHS=0, same weights, interleaved)
                                     [--profile N]    (only: cProfile of one kvyard stream of N tokens)
                                     [--device cpu]   (a dry run of the script with a small --layers/--hidden)

Builds a random Llama-architecture model in bfloat16 (default: SmolLM2-1.7B's shape, vocabulary 49152) on the
GPU, saves it as a Hugging Face directory, loads that with kvyard's loader (DEVICE=cuda's path: bfloat16
dense weights, PyTorch ops, a bfloat16 paged KV cache, decode steps replayed from CUDA graphs) and with
transformers, then times, interleaved:
  single   one request, a 128-token prompt, --out greedy tokens (ignore_eos): tok/s, first token included
  agg@32   32 such requests at once (kvyard: continuous batching; transformers: one static batch): tok/s
  ttft     a 940-token prompt, one token out: ms
Prompts are random token ids, fresh each round (no prefix-cache hits). transformers is a benchmark
dependency only."""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.attention import KVCache  # noqa: E402
from backend.engine import Engine, GenerationRequest  # noqa: E402
from backend.model import LlamaModel  # noqa: E402
from backend.model_runner import ModelRunner  # noqa: E402
from backend.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from backend.sequence import StopConditions  # noqa: E402
from backend.weights import load_weights  # noqa: E402
from kvyard.model_config import load_model_config  # noqa: E402
from kvyard.sampling_params import SamplingParams  # noqa: E402

DEVICE = torch.device("cuda")
PROMPT, TTFT_PROMPT, STREAMS = 128, 940, 32
SMOLLM2_1_7B = {"layers": 24, "hidden": 2048, "heads": 32, "ffn": 8192}


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def build_checkpoint(args: argparse.Namespace, path: Path) -> torch.nn.Module:
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=args.hidden, intermediate_size=args.ffn,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.heads, max_position_embeddings=4096, rms_norm_eps=1e-5,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    with DEVICE:
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.02 * torch.randn_like(p))
    model.eval().save_pretrained(str(path))
    return model


def kvyard_engine(path: Path, graphs: bool = True) -> Engine:
    config = load_model_config(path)
    model = LlamaModel(config, load_weights(path, config, torch.bfloat16, DEVICE, progress=False), cuda_graphs=graphs)
    block = 16
    num_blocks = (STREAMS * (PROMPT + 256) + TTFT_PROMPT + 64) // block + STREAMS
    cache = KVCache(config.num_layers, num_blocks, block, config.num_kv_heads, config.head_dim, torch.bfloat16, DEVICE)
    scheduler = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block, max_num_seqs=STREAMS,
                                          max_num_batched_tokens=4096))
    return Engine(ModelRunner(model, cache), scheduler, config.vocab_size, 4096)


def prompts(n: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(100, 49152) for _ in range(length)] for _ in range(n)]


def run_kvyard(engine: Engine, batch: list[list[int]], out: int) -> float:
    """Seconds until every request of the batch has its `out` tokens."""
    sync()
    start = time.perf_counter()
    for i, ids in enumerate(batch):
        engine.add(GenerationRequest(f"r{time.monotonic_ns()}-{i}", ids, SamplingParams(),
                                     StopConditions(max_new_tokens=out, ignore_eos=True)))
    produced = 0
    while engine.has_work:
        produced += len(engine.step())
    sync()
    assert produced == out * len(batch), produced
    return time.perf_counter() - start


def run_transformers(model: torch.nn.Module, batch: list[list[int]], out: int) -> float:
    ids = torch.tensor(batch, device=DEVICE)
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=out,
                             min_new_tokens=out, do_sample=False, pad_token_id=0)
    sync()
    assert got.shape == (len(batch), len(batch[0]) + out), got.shape
    return time.perf_counter() - start


def profile(engine: Engine, out: int) -> None:
    """Where one stream's step goes on the host: cProfile over `out` decode steps after a warm-up."""
    import cProfile
    import pstats
    rng = random.Random(2)
    run_kvyard(engine, prompts(1, PROMPT, rng), out)  # warm-up: the graphs of every shape met below
    prof = cProfile.Profile()
    prof.enable()
    seconds = run_kvyard(engine, prompts(1, PROMPT, rng), out)
    prof.disable()
    print(f"one stream, {out} tokens: {1e3 * seconds / out:.2f} ms a token (prefill included)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in {**SMOLLM2_1_7B, "rounds": 3, "out": 128}.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--eager", action="store_true", help="also kvyard with CUDA_GRAPHS=0 (every step eagerly)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="instead: one stream of N tokens under cProfile (kvyard only), the functions costing most")
    args = ap.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        hf = build_checkpoint(args, Path(tmp))
        engine = kvyard_engine(Path(tmp))
        if args.profile:
            return profile(engine, args.profile)
        runners = {"kvyard": lambda b, n: run_kvyard(engine, b, n), "transformers": lambda b, n: run_transformers(hf, b, n)}
        if args.eager:
            eager = kvyard_engine(Path(tmp), graphs=False)
            runners["kvyard-eager"] = lambda b, n: run_kvyard(eager, b, n)
        print(f"built and loaded in {time.perf_counter() - t0:.0f} s", flush=True)
        rng = random.Random(1)
        for name, run in runners.items():  # warm-up at every shape: kernels, allocator, cuBLAS handles
            run(prompts(1, PROMPT, rng), 4), run(prompts(STREAMS, PROMPT, rng), 4), run(prompts(1, TTFT_PROMPT, rng), 1)
        samples: dict[str, dict[str, list[float]]] = {name: {} for name in runners}
        for r in range(args.rounds):
            order = list(runners) if r % 2 == 0 else list(reversed(runners))
            for name in order:
                run, got = runners[name], samples[name]
                got.setdefault("single", []).append(args.out / run(prompts(1, PROMPT, rng), args.out))
                got.setdefault("agg", []).append(STREAMS * args.out / run(prompts(STREAMS, PROMPT, rng), args.out))
                got.setdefault("ttft", []).append(1e3 * run(prompts(1, TTFT_PROMPT, rng), 1))
                print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in got.items()), flush=True)
    print(f"\nmedians over {args.rounds} rounds, {args.layers} layers, hidden {args.hidden}, bfloat16")
    eager = "kvyard-eager" in runners
    print(f"{'workload':22} {'kvyard':>9} {'transformers':>13} {'kvyard/transformers':>20}"
          + (f" {'kvyard-eager':>13} {'graphs/eager':>13}" if eager else ""))
    for label, key, better in (("one stream tok/s", "single", 1), (f"{STREAMS} streams tok/s", "agg", 1),
                               (f"TTFT {TTFT_PROMPT} tokens ms", "ttft", -1)):
        a, b, *c = (statistics.median(samples[n][key]) for n in runners)
        print(f"{label:22} {a:9.1f} {b:13.1f} {(a / b) ** better:19.2f}x"
              + (f" {c[0]:13.1f} {(a / c[0]) ** better:12.2f}x" if c else ""))


if __name__ == "__main__":
    main()
