"""Engine throughput: concurrency 1/8/32/64, prompts of ~100-500 tokens, 128 output tokens each.

Prints aggregate output tok/s, TTFT and inter-token latency (p50/p99), each also as a ratio to a
one-request-at-a-time loop (the model runner driven directly, no scheduler) measured in the same run.

    .venv/bin/python benchmarks/engine_throughput.py [--grpc] [--concurrency 1,8,32,64] [--out 128]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.config import BackendConfig  # noqa: E402
from backend.engine import Engine, GenerationRequest  # noqa: E402
from backend.engine_loop import EngineLoop  # noqa: E402
from backend.main import build_engine_loop  # noqa: E402
from backend.model_runner import DirectChunk, DirectSeq, ModelRunner  # noqa: E402
from kvyard.sampling_params import SamplingParams  # noqa: E402
from backend.sequence import StopConditions  # noqa: E402


@dataclass
class Result:
    name: str
    tokens: int
    seconds: float
    ttft_s: list[float]
    itl_s: list[float]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(100, 500))] for _ in range(n)]


def request(i: int, prompt: list[int], out: int) -> GenerationRequest:
    return GenerationRequest(f"r{i}-{time.monotonic_ns()}", prompt, SamplingParams(),
                             StopConditions(max_new_tokens=out, ignore_eos=True))



def baseline_loop(runner: ModelRunner, prompts: list[list[int]], out: int) -> Result:
    """One request at a time, straight through the model runner: the number to beat."""
    bs = runner.cache.block_size
    ttft, itl, tokens = [], [], 0
    t0 = time.perf_counter()
    for prompt in prompts:
        seq = DirectSeq(list(prompt), list(range((len(prompt) + out) // bs + 1)))
        start = time.perf_counter()
        chunk = DirectChunk(seq, 0, len(prompt))
        last = start
        for k in range(out):
            tok = int(runner.run([chunk])[0].argmax())
            now = time.perf_counter()
            (ttft if k == 0 else itl).append(now - last if k else now - start)
            last = now
            seq.token_ids.append(tok)
            chunk = DirectChunk(seq, len(seq.token_ids) - 1, 1)
            tokens += 1
    return Result("loop (1 at a time)", tokens, time.perf_counter() - t0, ttft, itl)


def run_offline(engine: Engine, prompts: list[list[int]], out: int) -> Result:
    arrival = time.perf_counter()
    reqs = [request(i, p, out) for i, p in enumerate(prompts)]
    last: dict[str, float] = {}
    ttft, itl, tokens = [], [], 0
    for r in reqs:
        engine.add(r)
    while engine.has_work:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id not in last:
                ttft.append(now - arrival)
            else:
                itl.append(now - last[o.request_id])
            last[o.request_id] = now
            tokens += 1
    return Result(f"engine c={len(prompts)}", tokens, time.perf_counter() - arrival, ttft, itl)


async def run_grpc(address: str, prompts: list[list[int]], out: int) -> Result:
    import grpc

    from proto import model_rpc_pb2 as pb
    from proto import model_rpc_pb2_grpc as pb_grpc

    ttft, itl = [], []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ModelRpcServiceStub(channel)

        async def one(i: int, prompt: list[int]) -> int:
            start = last = time.perf_counter()
            n = 0
            cfg = pb.GenerateConfigPB(max_new_tokens=out, ignore_eos=True)
            async for msg in stub.GenerateStreamCall(pb.GenerateInputPB(request_id=f"g{i}-{time.monotonic_ns()}",
                                                                        token_ids=prompt, generate_config=cfg)):
                now = time.perf_counter()
                (itl if n else ttft).append(now - (last if n else start))
                last = now
                n += sum(len(o.output_ids) for o in msg.generate_outputs)
            return n

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)]))
    return Result(f"gRPC   c={len(prompts)}", tokens, time.perf_counter() - t0, ttft, itl)


def report(results: list[Result], base: Result) -> None:
    # Aggregate tok/s counts prefill time too; "decode tok/s" is the steady state: streams / ITL p50.
    print(f"{'run':22} {'tok/s':>8} {'x loop':>7} {'decode tok/s':>13} {'x loop':>7} {'TTFT p50':>9} {'p99':>8} "
          f"{'ITL p50':>8} {'p99':>8}")
    base_decode = 1 / pct(base.itl_s, 50)
    for r in [base, *results]:
        streams = 1 if r is base else len(r.ttft_s)  # the loop runs one stream at a time
        decode = streams / pct(r.itl_s, 50)
        print(f"{r.name:22} {r.tok_s:8.1f} {r.tok_s / base.tok_s:7.2f} {decode:13.1f} {decode / base_decode:7.2f} "
              f"{pct(r.ttft_s, 50) * 1e3:8.0f}ms {pct(r.ttft_s, 99) * 1e3:6.0f}ms {pct(r.itl_s, 50) * 1e3:6.1f}ms "
              f"{pct(r.itl_s, 99) * 1e3:6.1f}ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--out", type=int, default=128, help="output tokens per request")
    ap.add_argument("--baseline-requests", type=int, default=2)
    ap.add_argument("--grpc", action="store_true", help="also measure through the gRPC server")
    ap.add_argument("--kv-mb", type=int, default=4096)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    cfg = BackendConfig.from_env({"KV_CACHE_MB": str(args.kv_mb), "MAX_NUM_SEQS": str(max(levels)),
                                  "START_PORT": "1"})  # ports unused here
    # Every run gets prompts of its own: a prompt seen before would be a prefix-cache hit.
    seeds = iter(range(1, 1000))
    done: dict[str, object] = {}

    def offline() -> None:
        # On a thread that ends before the engine thread starts: one OpenMP master at a time (see
        # backend/openmp_threads.py; two live pools make every parallel region sleep).
        engine_loop, *_ = build_engine_loop(cfg)
        engine = engine_loop.engine
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {cfg.device}, "
              f"dtype {cfg.dtype}, {type(engine.runner.model.ops).__name__}")
        base_prompts = make_prompts(args.baseline_requests, engine.vocab_size, seed=0)
        print(f"prompts: 100-500 tokens (mean {statistics.mean(len(p) for p in base_prompts):.0f} in the loop), "
              f"{args.out} out each")
        done["loop"] = engine_loop
        done["base"] = baseline_loop(engine.runner, base_prompts, args.out)
        done["results"] = [run_offline(engine, make_prompts(c, engine.vocab_size, next(seeds)), args.out)
                           for c in levels]

    worker = threading.Thread(target=offline)
    worker.start()
    worker.join()
    engine_loop, base, results = done["loop"], done["base"], done["results"]
    engine = engine_loop.engine  # type: ignore[attr-defined]
    if args.grpc:
        grpc_prompts = [make_prompts(c, engine.vocab_size, next(seeds)) for c in levels]
        results += asyncio.run(_grpc_levels(engine_loop, grpc_prompts, args.out))  # type: ignore[arg-type,operator]
    report(results, base)  # type: ignore[arg-type]


async def _grpc_levels(engine_loop: EngineLoop, prompt_sets: list[list[list[int]]], out: int) -> list[Result]:
    import socket

    from backend.grpc_server import start_grpc_server
    from backend.server import ModelRpcServicer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine_loop.start()
    server, _ = await start_grpc_server(ModelRpcServicer(engine_loop, frozenset({2}), 8192), "127.0.0.1", port)
    try:
        return [await run_grpc(f"127.0.0.1:{port}", prompts, out) for prompts in prompt_sets]
    finally:
        await server.stop(0)
        engine_loop.stop()


if __name__ == "__main__":
    main()
