"""Mixed load on a prefill/decode split vs two PDFUSION backends, same total threads, same run.

Short chats decode steadily while long prompts keep arriving. Prints the decode streams' inter-token
latency p50/p99 and output throughput for both setups, and PD's ratios to PDFUSION's.

    .venv/bin/python benchmarks/pd_mixed_load.py [--streams 8] [--long 6] [--long-len 900]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from proto import model_rpc_pb2 as pb  # noqa: E402
from proto import model_rpc_pb2_grpc as pb_grpc  # noqa: E402
from kvyard.cluster_auth import grpc_metadata, new_token  # noqa: E402
from kvyard.ports import free_port_block  # noqa: E402
from tests.support.procs import stop_groups, wait_healthy  # noqa: E402

TOKEN = new_token()  # every role of the benchmark's cluster shares it


def start(role: str, port: int, **env: str) -> subprocess.Popen:
    full = {**os.environ, "ROLE_TYPE": role, "START_PORT": str(port), "HOST": "127.0.0.1", "KV_CACHE_MB": "256",
            "TORCH_NUM_THREADS": "1", "FRONTEND_SERVER_COUNT": "0", "PYTHONPATH": str(REPO),
            "CLUSTER_TOKEN": TOKEN, **env}
    return subprocess.Popen([sys.executable, "-m", "kvyard"], env=full, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)




def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


async def run(targets: list[tuple[str, str]], streams: int, n_long: int, long_len: int, out: int) -> dict:
    """targets: (grpc address, decode_address) pairs used round-robin."""
    rng = random.Random(0)
    itl: list[float] = []
    tokens = 0
    channels = {addr: grpc.aio.insecure_channel(addr) for addr, _ in targets}
    stubs = {addr: pb_grpc.ModelRpcServiceStub(ch) for addr, ch in channels.items()}

    async def one(i: int, prompt: list[int], max_new: int, record: bool) -> None:
        nonlocal tokens
        addr, decode = targets[i % len(targets)]
        cfg = pb.GenerateConfigPB(max_new_tokens=max_new, ignore_eos=True)
        last = None
        async for msg in stubs[addr].GenerateStreamCall(pb.GenerateInputPB(
                request_id=f"r{i}-{time.monotonic_ns()}", token_ids=prompt, generate_config=cfg,
                decode_address=decode), metadata=grpc_metadata(TOKEN)):
            now = time.perf_counter()
            if msg.HasField("error"):
                raise RuntimeError(msg.error.message)
            n = sum(len(o.output_ids) for o in msg.generate_outputs)
            tokens += n
            if record and last is not None:
                itl.append(now - last)
            last = now

    async def long_arrivals() -> None:
        for j in range(n_long):
            await asyncio.sleep(1.0)
            asyncio.ensure_future(one(1000 + j, [rng.randrange(100, 40000) for _ in range(long_len)], 8, False))

    t0 = time.perf_counter()
    short = [one(i, [rng.randrange(100, 40000) for _ in range(rng.randint(40, 80))], out, True)
             for i in range(streams)]
    await asyncio.gather(long_arrivals(), *short)
    elapsed = time.perf_counter() - t0
    for ch in channels.values():
        await ch.close()
    return {"itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99), "tok_s": tokens / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long", type=int, default=6)
    ap.add_argument("--long-len", type=int, default=900)
    ap.add_argument("--out", type=int, default=96)
    args = ap.parse_args()
    procs: list[subprocess.Popen] = []
    try:
        base = free_port_block(40)  # four backends, each START_PORT .. +5
        d, p, f1, f2 = base, base + 10, base + 20, base + 30
        procs += [start("DECODE", d), start("PREFILL", p), start("PDFUSION", f1), start("PDFUSION", f2)]
        for port, proc in zip((d, p, f1, f2), procs):
            wait_healthy(f"http://127.0.0.1:{port + 5}/health", proc, 180)
        pd_targets = [(f"127.0.0.1:{p + 1}", f"127.0.0.1:{d + 1}")]
        fused_targets = [(f"127.0.0.1:{f1 + 1}", ""), (f"127.0.0.1:{f2 + 1}", "")]
        print(f"{args.streams} decode streams ({args.out} tokens) + {args.long} prompts of {args.long_len} tokens "
              f"arriving 1/s; every process 1 torch thread")
        fused = asyncio.run(run(fused_targets, args.streams, args.long, args.long_len, args.out))
        split = asyncio.run(run(pd_targets, args.streams, args.long, args.long_len, args.out))
        print(f"{'setup':26} {'ITL p50':>9} {'ITL p99':>9} {'tok/s':>7}")
        for name, r in (("2 x PDFUSION", fused), ("PD (1 prefill + 1 decode)", split)):
            print(f"{name:26} {r['itl_p50'] * 1e3:7.1f}ms {r['itl_p99'] * 1e3:7.1f}ms {r['tok_s']:7.1f}")
        print(f"PD / PDFUSION: ITL p50 x{split['itl_p50'] / fused['itl_p50']:.2f}, "
              f"ITL p99 x{split['itl_p99'] / fused['itl_p99']:.2f}, throughput x{split['tok_s'] / fused['tok_s']:.2f}")
    finally:
        stop_groups(procs, 15)


if __name__ == "__main__":
    main()
