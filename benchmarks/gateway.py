"""Gateway benchmarks: a burst through the gateway vs clients retrying 429s themselves, and prefix-aware vs
least-connection routing on a shared-prefix workload.

burst:  64 chat requests at once against 2 upstreams (kvyard frontends over one mock backend streaming
        --mock-tokens tokens --mock-delay-ms apart, CONCURRENCY_LIMIT=--slots each). "direct": the official
        openai client (its default 2 retries, honouring Retry-After) spreads them over the two frontends,
        which answer 429 past their limit; "gateway": the same client with no retries through a gateway
        with MAX_CONNECT_PER_UPSTREAM=--slots, which queues instead. Client-visible errors, p50/p99 latency.
prefix: --prefixes long system prompts, --requests short user turns each on one of them (streamed, a few
        tokens), --concurrency clients, through a gateway over 2 PDFUSION servers on the embedded model
        with a small KV cache; once with GATEWAY_ROUTING=prefix, once least_connection, each with fresh
        system prompts. TTFT p50/p99 and the upstreams' prefix-cache hit rate.

    .venv/bin/python benchmarks/gateway.py [--part burst|prefix|all] [--requests 48] [--kv-cache-mb 64] ...
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvyard.cluster_auth import new_token  # noqa: E402
from kvyard.ports import free_port_block  # noqa: E402
from role_procs import ProcessGroup, wait_healthy  # noqa: E402  (this folder: the script's own)

TOKEN = new_token()
MODEL = "smol"
MOCK = "mock-model"


class Procs(ProcessGroup):
    """Role processes on free loopback ports, logs in one temporary folder, stopped by pid on exit."""

    def __init__(self) -> None:
        super().__init__("kvyard-gateway-bench-", TOKEN)

    def start(self, name: str, env: dict[str, str], health: str, timeout_s: float = 300.0) -> None:
        wait_healthy(health, self.kvyard(name, env), timeout_s, lambda: f"{name}: see {self.logs / name}.log")

    def gateway(self, name: str, upstreams: list[str], **env: str) -> str:
        port = free_port_block()
        url = f"http://127.0.0.1:{port}"
        self.start(name, {"ROLE_TYPE": "GATEWAY", "TIB_PORT": str(port), "UPSTREAMS": ",".join(upstreams), **env},
                   f"{url}/health", 60)
        return url


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


# ---- burst ------------------------------------------------------------------------------------------

@dataclass
class Burst:
    name: str
    latencies_s: list[float]   # of the requests that succeeded
    errors: int
    seconds: float


async def burst_run(name: str, bases: list[str], n: int, max_retries: int) -> Burst:
    clients = [openai.AsyncOpenAI(base_url=f"{b}/v1", api_key="unused", max_retries=max_retries, timeout=120)
               for b in bases]
    latencies: list[float] = []
    errors = 0

    async def one(i: int) -> None:
        nonlocal errors
        t0 = time.perf_counter()
        try:
            await clients[i % len(clients)].chat.completions.create(
                model=MOCK, messages=[{"role": "user", "content": f"request {i}"}])
            latencies.append(time.perf_counter() - t0)
        except openai.APIError:
            errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    seconds = time.perf_counter() - t0
    for c in clients:
        await c.close()
    return Burst(name, latencies, errors, seconds)


def burst(args: argparse.Namespace, procs: Procs) -> None:
    mock_port = free_port_block()  # the mock backend's gRPC port is its START_PORT + 1; it has no HTTP health
    procs.kvyard("mock_backend", {"ROLE_TYPE": "MOCK_BACKEND", "START_PORT": str(mock_port - 1),
                                 "MOCK_TOKEN_IDS": json.dumps([30] * args.mock_tokens + [2]),
                                 "MOCK_DELAY_MS": str(args.mock_delay_ms)})
    fronts = []
    for i in range(2):
        port = free_port_block()
        url = f"http://127.0.0.1:{port}"
        procs.start(f"front{i}", {"ROLE_TYPE": "FRONTEND", "START_PORT": str(port), "MODEL_NAME": MOCK,
                                  "BACKEND_ADDRESS": f"127.0.0.1:{mock_port}", "CONCURRENCY_LIMIT": str(args.slots)},
                    f"{url}/health", 120)
        fronts.append(url)
    gateway = procs.gateway("gateway_burst", fronts, MAX_CONNECT_PER_UPSTREAM=str(args.slots), WAIT_FOR="120000",
                            GATEWAY_ROUTING="least_connection")
    asyncio.run(burst_run("warm-up", [gateway], 4, 0))
    results = [asyncio.run(burst_run("direct, client retries 429 (openai default, 2 retries)", fronts, args.burst, 2)),
               asyncio.run(burst_run("through the gateway (no client retries)", [gateway], args.burst, 0))]
    one_s = (args.mock_tokens + 1) * args.mock_delay_ms / 1000
    print(f"\nburst: {args.burst} chat requests at once, 2 upstreams x {args.slots} slots, each request ~{one_s:.2f} s "
          f"of mock generation\n")
    print(f"{'':<58} {'errors':>6} {'p50':>7} {'p99':>7} {'all done':>8}")
    for r in results:
        print(f"{r.name:<58} {r.errors:>6} {pct(r.latencies_s, 50):>6.2f}s {pct(r.latencies_s, 99):>6.2f}s "
              f"{r.seconds:>7.2f}s")


# ---- shared prefix ----------------------------------------------------------------------------------

WORDS = ("river stone lantern harbor meadow copper violet engine signal orchard thunder quiet marble pilot "
         "canvas ember falcon glacier hollow island jasmine kettle ledger mosaic nickel oyster prism quartz").split()


@dataclass
class PrefixRun:
    name: str
    ttft_s: list[float]
    hit_rate: float
    failures: int
    seconds: float


def workload(args: argparse.Namespace, salt: int) -> list[list[dict[str, str]]]:
    shape, fresh = random.Random(args.seed), random.Random(args.seed * 1000 + salt)
    systems = [" ".join(fresh.choice(WORDS) for _ in range(args.prefix_words)) for _ in range(args.prefixes)]
    return [[{"role": "system", "content": systems[shape.randrange(args.prefixes)]},
             {"role": "user", "content": f"Question {i}: " + " ".join(fresh.choice(WORDS) for _ in range(8))}]
            for i in range(args.requests)]


def _has_text(line: str) -> bool:
    """An SSE line whose chunk carries generated text (not the role-only first chunk)."""
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line[len("data: "):]).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


def cache_counts(upstreams: list[str]) -> tuple[float, float]:
    queries = hits = 0.0
    for u in upstreams:
        text = httpx.get(f"{u}/metrics").text
        queries += float(re.search(r"^kvyard:prefix_cache_queries_total ([\d.e+]+)", text, re.M).group(1))
        hits += float(re.search(r"^kvyard:prefix_cache_hits_total ([\d.e+]+)", text, re.M).group(1))
    return queries, hits


async def prefix_run(name: str, gateway: str, requests: list[list[dict[str, str]]], args: argparse.Namespace,
                     upstreams: list[str]) -> PrefixRun:
    q0, h0 = cache_counts(upstreams)
    queue = list(requests)
    ttft: list[float] = []
    failures = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal failures
        while queue:
            messages = queue.pop(0)
            t0 = time.perf_counter()
            body = {"model": MODEL, "messages": messages, "max_tokens": args.out_tokens, "temperature": 0,
                    "stream": True}
            try:
                async with client.stream("POST", f"{gateway}/v1/chat/completions", json=body) as resp:
                    if resp.status_code != 200:
                        failures += 1
                        continue
                    first = True
                    async for line in resp.aiter_lines():
                        if first and _has_text(line):
                            ttft.append(time.perf_counter() - t0)
                            first = False
            except httpx.HTTPError:
                failures += 1

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    seconds = time.perf_counter() - t0
    q1, h1 = cache_counts(upstreams)
    return PrefixRun(name, ttft, (h1 - h0) / max(1.0, q1 - q0), failures, seconds)


def prefix(args: argparse.Namespace, procs: Procs) -> None:
    upstreams = []
    for i in range(2):
        port = free_port_block(6)
        url = f"http://127.0.0.1:{port}"
        procs.start(f"pdfusion{i}", {"ROLE_TYPE": "PDFUSION", "START_PORT": str(port), "MODEL_NAME": MODEL,
                                     "KV_CACHE_MB": str(args.kv_cache_mb), "TORCH_NUM_THREADS": "1"},
                    f"{url}/health", 300)
        upstreams.append(url)
    runs = []
    for salt, routing in enumerate(("prefix", "least_connection"), start=1):
        gateway = procs.gateway(f"gateway_{routing}", upstreams, GATEWAY_ROUTING=routing, WAIT_FOR="300000",
                                MAX_CONNECT_PER_UPSTREAM=str(args.concurrency))
        runs.append(asyncio.run(prefix_run(routing, gateway, workload(args, salt), args, upstreams)))
        procs.procs[-1].send_signal(signal.SIGTERM)
    print(f"\nshared prefix: {args.requests} streamed chats, {args.prefixes} system prompts of {args.prefix_words} "
          f"words, concurrency {args.concurrency}, {args.out_tokens} output tokens, 2 PDFUSION upstreams with "
          f"{args.kv_cache_mb} MB of KV each\n")
    print(f"{'routing':<18} {'TTFT p50':>9} {'TTFT p99':>9} {'hit rate':>8} {'failed':>6} {'total':>7}")
    for r in runs:
        print(f"{r.name:<18} {pct(r.ttft_s, 50) * 1000:>7.0f}ms {pct(r.ttft_s, 99) * 1000:>7.0f}ms "
              f"{r.hit_rate:>8.1%} {r.failures:>6} {r.seconds:>6.1f}s")
    print(f"least_connection / prefix TTFT p50: x{pct(runs[1].ttft_s, 50) / pct(runs[0].ttft_s, 50):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("burst", "prefix", "all"), default="all")
    ap.add_argument("--burst", type=int, default=64, help="requests arriving at once")
    ap.add_argument("--slots", type=int, default=4, help="requests each upstream takes at once")
    ap.add_argument("--mock-tokens", type=int, default=24)
    ap.add_argument("--mock-delay-ms", type=int, default=10)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-words", type=int, default=300)
    ap.add_argument("--out-tokens", type=int, default=4)
    ap.add_argument("--kv-cache-mb", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    procs = Procs()
    print(f"logs in {procs.logs}", flush=True)
    try:
        if args.part in ("burst", "all"):
            burst(args, procs)
            procs.stop()
        if args.part in ("prefix", "all"):
            prefix(args, procs)
    finally:
        procs.stop()


if __name__ == "__main__":
    main()
