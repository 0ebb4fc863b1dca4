"""Master routing: cache-aware (through the master) vs round-robin vs random, on a shared-prefix workload.

N system prompts of ~P tokens, many short user turns, against 2 backends; each strategy gets its own
fresh set of system prompts (so none inherits another's cache) and the same request sequence. Prints
TTFT p50/p99, throughput, prefix hit rate (reuse_len / prompt tokens from the backends' aux info) and
the ratios to cache-aware. Starts a master and two backend processes itself unless --master is given.

    .venv/bin/python benchmarks/master_routing.py [--requests 48] [--concurrency 4] [--prefixes 8]
        [--prefix-tokens 400] [--kv-cache-mb 128] [--master host:port --backends a:p,b:p]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from frontend.backend_client import GenerateParams  # noqa: E402
from frontend.config import FrontendConfig  # noqa: E402
from frontend.routing import Router  # noqa: E402
from kvyard.cluster_auth import auth_headers, new_token  # noqa: E402
from kvyard.model_config import load_model_config  # noqa: E402
from kvyard.model_path import embedded_model_path  # noqa: E402

TOKEN = new_token()  # the benchmark's cluster shares one token, as a real deployment does
STRATEGIES = ("cache-aware", "round-robin", "random")


@dataclass
class Result:
    name: str
    ttft_s: list[float]
    seconds: float
    prompt_tokens: int
    reused_tokens: int
    output_tokens: int
    failures: int

    def pct(self, q: float) -> float:
        xs = sorted(self.ttft_s)
        return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def workload(args: argparse.Namespace, vocab: int, salt: int) -> list[list[int]]:
    """The request prompts: system prompt i (fresh per salt) + a short user turn; same shape per salt."""
    shape = random.Random(args.seed)
    fresh = random.Random(args.seed * 1000 + salt)
    prefixes = [[fresh.randrange(100, vocab) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    out = []
    for _ in range(args.requests):
        i = shape.randrange(args.prefixes)
        turn = [fresh.randrange(100, vocab) for _ in range(shape.randint(10, 30))]
        out.append(prefixes[i] + turn)
    return out


async def run_strategy(name: str, prompts: list[list[int]], router: Router, backends: list[str],
                       concurrency: int, out_tokens: int) -> Result:
    params = GenerateParams(max_new_tokens=out_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(7)
    queue = list(enumerate(prompts))
    ttft: list[float] = []
    totals = {"reused": 0, "out": 0, "fail": 0}
    rr = 0

    async def one(i: int, ids: list[int]) -> None:
        nonlocal rr
        t0 = time.perf_counter()
        try:
            if name == "cache-aware":
                stream = router.generate(f"{name}-{i}", ids, params)
            else:
                address = backends[rr % len(backends)] if name == "round-robin" else rng.choice(backends)
                rr += 1
                stream = router.client(address).generate(f"{name}-{i}", ids, params)
            first = True
            async for outs in stream:
                if first:
                    ttft.append(time.perf_counter() - t0)
                    totals["reused"] += outs[0].aux.reuse_len
                    first = False
                totals["out"] += sum(len(o.token_ids) for o in outs)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            totals["fail"] += 1
            print(f"  {name} request {i} failed: {exc!r}", file=sys.stderr)

    async def worker() -> None:
        while queue:
            i, ids = queue.pop(0)
            await one(i, ids)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Result(name, ttft, time.perf_counter() - t0, sum(map(len, prompts)), totals["reused"],
                  totals["out"], totals["fail"])


class Cluster:
    """A master and two backends (no frontends) on free loopback ports, stopped on exit."""

    def __init__(self, kv_cache_mb: int, base: int) -> None:
        self.logs = Path(tempfile.mkdtemp(prefix="kvyard-bench-"))
        self.master = f"127.0.0.1:{base}"
        self.backends = [f"127.0.0.1:{base + 2}", f"127.0.0.1:{base + 8}"]
        self.procs = [self._start("master", {"ROLE_TYPE": "MASTER", "START_PORT": str(base)})]
        for i, start in enumerate((base + 1, base + 7)):
            self.procs.append(self._start(f"backend{i}", {
                "ROLE_TYPE": "PDFUSION", "FRONTEND_SERVER_COUNT": "0", "START_PORT": str(start),
                "KV_CACHE_MB": str(kv_cache_mb), "TORCH_NUM_THREADS": "1", "MASTER_ADDRESS": self.master}))

    def _start(self, name: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        full = {**os.environ, "HOST": "127.0.0.1", "PYTHONPATH": str(REPO), "CLUSTER_TOKEN": TOKEN, **env}
        log = open(self.logs / f"{name}.log", "wb")
        return subprocess.Popen([sys.executable, "-m", "kvyard"], env=full, cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a role process exited; logs in {self.logs}")
            try:
                view = httpx.get(f"http://{self.master}/backends", timeout=1, headers=auth_headers(TOKEN)).json()["backends"]
                if sorted(b["name"] for b in view if b["healthy"]) == sorted(self.backends):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"cluster not ready in {timeout_s} s; logs in {self.logs}")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


async def main_async(args: argparse.Namespace, master: str, backends: list[str]) -> list[Result]:
    vocab = load_model_config(embedded_model_path()).vocab_size
    router = Router(FrontendConfig.from_env({"MASTER_ADDRESS": master, "BACKEND_ADDRESSES": ",".join(backends),
                                             "CLUSTER_TOKEN": TOKEN}))
    try:
        warm = [[random.Random(s).randrange(100, vocab) for _ in range(64)] for s in range(4)]
        await run_strategy("round-robin", warm, router, backends, 2, 2)  # first-step costs out of the way
        results = []
        for salt, name in enumerate(STRATEGIES, start=1):
            results.append(await run_strategy(name, workload(args, vocab, salt), router, backends,
                                              args.concurrency, args.out_tokens))
        return results
    finally:
        await router.close()


def report(results: list[Result], args: argparse.Namespace) -> None:
    print(f"\n{args.requests} requests/strategy, concurrency {args.concurrency}, {args.prefixes} system prompts of "
          f"{args.prefix_tokens} tokens + 10-30 token turns, {args.out_tokens} output tokens, 2 backends\n")
    print(f"{'strategy':<12} {'TTFT p50':>9} {'TTFT p99':>9} {'req/s':>7} {'out tok/s':>9} {'hit rate':>8} {'failed':>6}")
    for r in results:
        print(f"{r.name:<12} {r.pct(50) * 1000:>7.0f}ms {r.pct(99) * 1000:>7.0f}ms "
              f"{args.requests / r.seconds:>7.2f} {r.output_tokens / r.seconds:>9.1f} "
              f"{r.reused_tokens / r.prompt_tokens:>8.1%} {r.failures:>6}")
    ca = results[0]
    for r in results[1:]:
        print(f"{r.name} / cache-aware: TTFT p50 x{r.pct(50) / ca.pct(50):.2f}, p99 x{r.pct(99) / ca.pct(99):.2f}, "
              f"throughput x{(args.requests / r.seconds) / (args.requests / ca.seconds):.2f}")
    print(f"target (cache-aware TTFT p50 <= half of round-robin's): "
          f"{'met' if ca.pct(50) * 2 <= results[1].pct(50) else 'NOT met'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=400)
    ap.add_argument("--out-tokens", type=int, default=8)
    ap.add_argument("--kv-cache-mb", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=18700, help="first of 13 ports for the cluster it starts")
    ap.add_argument("--master", help="use a running master (host:port) instead of starting a cluster")
    ap.add_argument("--backends", help="with --master: the backends' gRPC addresses, comma-separated")
    args = ap.parse_args()
    cluster = None
    if args.master:
        master, backends = args.master, [b for b in (args.backends or "").split(",") if b]
        if len(backends) < 2:
            ap.error("--master needs --backends with at least two addresses")
    else:
        cluster = Cluster(args.kv_cache_mb, args.port)
        master, backends = cluster.master, cluster.backends
    try:
        if cluster is not None:
            print(f"starting a master and 2 backends (logs in {cluster.logs}) ...", flush=True)
            cluster.wait_ready()
        report(asyncio.run(main_async(args, master, backends)), args)
    finally:
        if cluster is not None:
            cluster.stop()


if __name__ == "__main__":
    main()
