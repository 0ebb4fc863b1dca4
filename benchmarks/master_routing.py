"""Routers over the same two backends, the real HTTP path: kvyard's master vs SGLang's router.

    .venv/bin/python benchmarks/master_routing.py [--runs 3] [--pressure on,off] [--routers kvyard,cache_aware,round_robin]
        [--requests 64] [--concurrency 4] [--prefixes 12] [--words 300] [--out-tokens 16]

One cluster per KV setting (`--kv-mb-pressure 64`: each backend holds only a few of the long system
prompts; `--kv-mb-free 256`: all of them fit), each with:
  - two PDFUSION processes (a backend and its frontend), the same backends for every router;
  - kvyard:       client -> kvyard FRONTEND -> MASTER (/rtp_llm/schedule) -> backend gRPC
  - cache_aware:  client -> `sglang-router --policy cache_aware` -> a PDFUSION frontend -> its backend
  - round_robin:  client -> `sglang-router --policy round_robin` -> a PDFUSION frontend -> its backend
Every router is up before the first run (an idle one takes no CPU); then `--runs` rounds drive one router
at a time through the workload, each round starting with the next router (A B C, B C A, C A B, ...), so
none always runs first after the cluster started. Each (round, router)
gets its own fresh system prompts, so no run inherits another's cache, and the same request order.

Workload: `--prefixes` system prompts of `--words` random vocabulary words, `--requests` streamed chat
requests (a system prompt, drawn at random, and a 8-20 word user turn) `--concurrency` at a time,
`--out-tokens` output tokens each (temperature 0, ignore_eos). TTFT = until the first streamed content.
The prefix hit rate is the backends' own (kvyard:prefix_cache_hits_total / queries, over the run).

SGLang's router (PyPI `sglang-router`) is never a kvyard dependency: it lives in its own virtual
environment, `--sglang-venv` (default ~/.cache/kvyard/sglang-router-venv), created on first use with
`python -m venv` and `pip install sglang-router==SGLANG_ROUTER_VERSION` (the script prints the commands).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvyard.cluster_auth import auth_headers, new_token  # noqa: E402
from kvyard.model_path import EMBEDDED_MODEL_NAME, embedded_model_path  # noqa: E402
from kvyard.ports import free_port_block  # noqa: E402
from role_procs import ProcessGroup  # noqa: E402  (this folder: the script's own)
from kvyard.tokenizer import TextTokenizer  # noqa: E402

SGLANG_ROUTER_VERSION = "0.3.2"
DEFAULT_VENV = Path.home() / ".cache" / "kvyard" / "sglang-router-venv"
ROUTERS = ("kvyard", "cache_aware", "round_robin")
TOKEN = new_token()  # one cluster token for every kvyard role, as a deployment's Secret


# ---- SGLang's router, in its own environment -------------------------------------------------------

def sglang_router_python(venv: Path) -> Path:
    """The venv's python with sglang-router installed; creates the venv on first use."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import sglang_router"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "--quiet", f"sglang-router=={SGLANG_ROUTER_VERSION}"]]
    print(f"installing SGLang's router into its own environment {venv}:", flush=True)
    for step in steps:
        print("  $ " + " ".join(step), flush=True)
        subprocess.run(step, check=True)
    return python


# ---- processes ---------------------------------------------------------------------------------------

def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (each checked free again by its role at bind time)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class Cluster:
    """Two PDFUSION processes, a kvyard master and frontend, two SGLang routers; all stopped by stop()."""

    def __init__(self, kv_mb: int, routers: list[str], sglang_python: Path | None,
                 master_log_level: str = "INFO") -> None:
        self.group = ProcessGroup(f"kvyard-routers-{kv_mb}mb-", TOKEN)
        self.logs = self.group.logs
        self.urls: dict[str, str] = {}
        self.backend_metrics: list[str] = []
        try:
            self._start(kv_mb, routers, sglang_python, master_log_level)
        except BaseException:
            self.stop()
            raise

    def _start(self, kv_mb: int, routers: list[str], sglang_python: Path | None, master_log_level: str) -> None:
        starts = []
        for i in range(2):
            start = free_port_block(6)
            starts.append(start)
            self.group.kvyard(f"pdfusion{i}", {"ROLE_TYPE": "PDFUSION", "START_PORT": str(start),
                                          "KV_CACHE_MB": str(kv_mb), "TORCH_NUM_THREADS": "1"})
            self.backend_metrics.append(f"http://127.0.0.1:{start + 5}/metrics")
        grpc = ",".join(f"127.0.0.1:{s + 1}" for s in starts)
        workers = [f"http://127.0.0.1:{s}" for s in starts]
        if "kvyard" in routers:
            master, frontend = free_port_block(1), free_port_block(6)
            self.group.kvyard("master", {"ROLE_TYPE": "MASTER", "START_PORT": str(master), "MASTER_BACKENDS": grpc,
                                    "LOG_LEVEL": master_log_level})
            self.group.kvyard("frontend", {"ROLE_TYPE": "FRONTEND", "START_PORT": str(frontend),
                                      "MASTER_ADDRESS": f"127.0.0.1:{master}", "BACKEND_ADDRESSES": grpc})
            self.urls["kvyard"] = f"http://127.0.0.1:{frontend}"
            self.master_url = f"http://127.0.0.1:{master}"
        self._wait({f"worker{i}": url for i, url in enumerate(workers)})  # SGLang's router gives up on slow ones
        for policy in (r for r in routers if r != "kvyard"):
            assert sglang_python is not None
            port, metrics_port = free_ports(2)
            self.group.spawn(f"sglang-{policy}", [str(sglang_python), "-m", "sglang_router.launch_router",
                                             "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                                             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                                             "--worker-urls", *workers, "--log-level", "warn"], {})
            self.urls[policy] = f"http://127.0.0.1:{port}"

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds each started process and its children have used so far."""
        return {name: tree_cpu_s(p.pid) for name, p in zip(self.group.names, self.group.procs)}

    def wait_ready(self) -> None:
        self._wait(self.urls)

    def _wait(self, urls: dict[str, str], timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        pending = dict(urls)
        while pending and time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.group.procs):
                raise RuntimeError(f"a process exited; logs in {self.logs}")
            for name, url in list(pending.items()):
                if _answers(url):
                    del pending[name]
            time.sleep(0.5)
        if pending:
            raise TimeoutError(f"{sorted(pending)} not ready in {timeout_s:.0f} s; logs in {self.logs}")

    def stop(self) -> None:
        self.group.stop()


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of pid and every live descendant (threads included)."""
    total, todo, tick = 0.0, [pid], os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total


def _answers(url: str) -> bool:
    """A router is ready when a chat request through it is answered (SGLang's: once its workers are in)."""
    body = {"model": EMBEDDED_MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    try:
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


# ---- workload ----------------------------------------------------------------------------------------

def vocabulary_words(tokenizer: TextTokenizer) -> tuple[list[str], list[str]]:
    """(whole lowercase words, word endings) of the model's vocabulary: a word is one token after a space,
    an ending one more token, so words with an ending half the time read like English: ~1.5 tokens a word."""
    words, endings = set(), set()
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_piece(i)
        if piece.startswith("Ġ") and re.fullmatch(r"[a-z]{3,12}", piece[1:]):
            words.add(piece[1:])
        elif re.fullmatch(r"[a-z]{2,6}", piece):
            endings.add(piece)
    return sorted(words), sorted(endings)


def text(rng: random.Random, vocab: tuple[list[str], list[str]], n: int) -> str:
    words, endings = vocab
    return " ".join(rng.choice(words) + (rng.choice(endings) if rng.random() < 0.5 else "") for _ in range(n))


def workload(args: argparse.Namespace, vocab: tuple[list[str], list[str]], salt: int) -> list[list[dict[str, str]]]:
    """The requests' messages: the same shape for every salt (which prompt, how long a turn), fresh words."""
    shape = random.Random(args.seed)
    fresh = random.Random(args.seed * 100_003 + salt)
    systems = [text(fresh, vocab, args.words) for _ in range(args.prefixes)]
    out = []
    for _ in range(args.requests):
        i = shape.randrange(args.prefixes)
        turn = text(fresh, vocab, shape.randint(8, 20))
        out.append([{"role": "system", "content": systems[i]}, {"role": "user", "content": turn + "?"}])
    return out


@dataclass
class Run:
    router: str
    ttft_s: list[float]
    wall_s: float
    hit_rate: float      # backend prefix-cache hits / prompt tokens over the run
    failures: int
    backend_ttft_s: float  # mean TTFT the backends measured (from the request reaching them)
    cpu_s: dict[str, float]  # CPU seconds each process of the cluster used during the run

    @property
    def path_ms(self) -> float:
        """Mean client TTFT minus the backends' own: what the router and frontend add per request."""
        return (statistics.mean(self.ttft_s) - self.backend_ttft_s) * 1000 if self.ttft_s else float("nan")

    def pct(self, q: float) -> float:
        xs = sorted(self.ttft_s)
        return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


async def drive(url: str, requests: list[list[dict[str, str]]], concurrency: int, out_tokens: int) -> tuple[list[float], float, int]:
    ttft: list[float] = []
    failures = 0
    queue = list(requests)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(messages: list[dict[str, str]]) -> None:
            nonlocal failures
            body = {"model": EMBEDDED_MODEL_NAME, "messages": messages, "max_tokens": out_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            t0 = time.perf_counter()
            first = None
            try:
                async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                    if resp.status_code != 200:
                        raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                    async for line in resp.aiter_lines():
                        if first is None and line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                                first = time.perf_counter() - t0
                if first is None:
                    raise RuntimeError("no content streamed")
                ttft.append(first)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                failures += 1
                print(f"  request failed: {exc!r}", file=sys.stderr)

        async def worker() -> None:
            while queue:
                await one(queue.pop(0))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return ttft, time.perf_counter() - t0, failures


COUNTERS = ("kvyard:prefix_cache_hits_total", "kvyard:prefix_cache_queries_total",
            "kvyard:time_to_first_token_seconds_sum", "kvyard:time_to_first_token_seconds_count")


def backend_counters(cluster: Cluster) -> list[float]:
    """COUNTERS summed over the backends."""
    sums = [0.0] * len(COUNTERS)
    for url in cluster.backend_metrics:
        text = httpx.get(url, timeout=5).text
        for i, name in enumerate(COUNTERS):  # every label set (model_name, ...) of the counter
            values = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
            if not values:
                raise RuntimeError(f"{url} has no {name}")
            sums[i] += sum(float(v) for v in values)
    return sums


def run_once(cluster: Cluster, router: str, requests: list[list[dict[str, str]]], args: argparse.Namespace) -> Run:
    before, cpu_before = backend_counters(cluster), cluster.cpu_s()
    ttft, wall, failures = asyncio.run(drive(cluster.urls[router], requests, args.concurrency, args.out_tokens))
    cpu = {name: round(t - cpu_before.get(name, 0.0), 1) for name, t in cluster.cpu_s().items()}
    hits, queries, ttft_sum, ttft_count = (b - a for a, b in zip(before, backend_counters(cluster)))
    return Run(router, ttft, wall, hits / max(1.0, queries), failures, ttft_sum / max(1.0, ttft_count),
               {name: t for name, t in cpu.items() if t >= 0.1})


def master_stats(cluster: Cluster) -> dict[str, float]:
    return httpx.get(f"{cluster.master_url}/backends", timeout=5, headers=auth_headers(TOKEN)).json()["stats"]


# ---- report ------------------------------------------------------------------------------------------

def _spread(xs: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def report(results: dict[str, dict[str, list[Run]]], kv_mb: dict[str, int], args: argparse.Namespace) -> None:
    print(f"\n{args.requests} streamed chat requests per run, {args.concurrency} at a time, {args.prefixes} system "
          f"prompts of {args.words} words, {args.out_tokens} output tokens, 2 PDFUSION backends; "
          f"{args.runs} runs per row: median (min-max)\n")
    print("| KV cache per backend | router | TTFT p50 ms | TTFT p90 ms | wall s | prefix hit rate | failed |")
    print("|---|---|---|---|---|---|---|")
    for pressure, by_router in results.items():
        for router, runs in by_router.items():
            print(f"| {kv_mb[pressure]} MB | {router} | {_spread([r.pct(50) * 1000 for r in runs], '{:.0f}')} | "
                  f"{_spread([r.pct(90) * 1000 for r in runs], '{:.0f}')} | "
                  f"{_spread([r.wall_s for r in runs], '{:.1f}')} | "
                  f"{_spread([100 * r.hit_rate for r in runs], '{:.0f}')} % | {sum(r.failures for r in runs)} |")
    for pressure, by_router in results.items():
        ours = by_router.get("kvyard")
        if not ours:
            continue
        for other in (r for r in by_router if r != "kvyard"):
            # Per round: the runs of one round ran back to back, so their ratio is the least noisy number.
            p50 = [a.pct(50) / b.pct(50) for a, b in zip(ours, by_router[other])]
            p90 = [a.pct(90) / b.pct(90) for a, b in zip(ours, by_router[other])]
            print(f"{kv_mb[pressure]} MB: kvyard / {other}: TTFT p50 x{_spread(p50, '{:.2f}')}, "
                  f"p90 x{_spread(p90, '{:.2f}')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pressure", default="on,off", help="on: --kv-mb-pressure per backend; off: --kv-mb-free")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--kv-mb-pressure", type=int, default=64)
    ap.add_argument("--kv-mb-free", type=int, default=256)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prefixes", type=int, default=12)
    ap.add_argument("--words", type=int, default=300)
    ap.add_argument("--out-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sglang-venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--json", type=Path, help="also write every run's numbers (TTFTs included) here")
    ap.add_argument("--master-log-level", default="INFO", help="DEBUG: the master logs every decision (master.log)")
    args = ap.parse_args()
    routers = [r for r in args.routers.split(",") if r]
    if not set(routers) <= set(ROUTERS):
        ap.error(f"--routers: choose from {', '.join(ROUTERS)}")
    settings = [p for p in args.pressure.split(",") if p]
    if not set(settings) <= {"on", "off"}:
        ap.error("--pressure: on, off or both")
    kv_mb = {"on": args.kv_mb_pressure, "off": args.kv_mb_free}
    sglang = sglang_router_python(args.sglang_venv) if set(routers) - {"kvyard"} else None
    tokenizer = TextTokenizer.from_path(embedded_model_path())
    vocab = vocabulary_words(tokenizer)
    sample = workload(args, vocab, 0)[0]
    print(f"a system prompt is {len(tokenizer.encode(sample[0]['content']))} tokens", flush=True)
    results: dict[str, dict[str, list[Run]]] = {}
    salt = 0
    for pressure in settings:
        print(f"starting the cluster with KV_CACHE_MB={kv_mb[pressure]} ...", flush=True)
        cluster = Cluster(kv_mb[pressure], routers, sglang, args.master_log_level)
        try:
            cluster.wait_ready()
            print(f"  ready (logs in {cluster.logs})", flush=True)
            results[pressure] = {r: [] for r in routers}
            for round_no in range(args.runs):
                for router in routers[round_no % len(routers):] + routers[:round_no % len(routers)]:
                    salt += 1
                    before = master_stats(cluster) if router == "kvyard" else None
                    run = run_once(cluster, router, workload(args, vocab, salt), args)
                    results[pressure][router].append(run)
                    extra = ""
                    if before is not None:
                        after = master_stats(cluster)
                        extra = (f", master's predicted hit rate "
                                 f"{(after['hit_tokens'] - before['hit_tokens']) / max(1, after['prompt_tokens'] - before['prompt_tokens']):.0%}")
                    print(f"  round {round_no + 1} {router:<12} TTFT p50 {run.pct(50) * 1000:6.0f} ms  "
                          f"p90 {run.pct(90) * 1000:6.0f} ms  wall {run.wall_s:5.1f} s  "
                          f"hit rate {run.hit_rate:.0%}  mean TTFT {statistics.mean(run.ttft_s) * 1000:.0f} ms, "
                          f"of which before the backend {run.path_ms:.0f} ms{extra}\n"
                          f"    CPU s: {', '.join(f'{n} {t:.1f}' for n, t in run.cpu_s.items())}", flush=True)
        finally:
            cluster.stop()
    report(results, kv_mb, args)
    if args.json:
        args.json.write_text(json.dumps({kv_mb[p]: {r: [run.__dict__ for run in runs] for r, runs in by.items()}
                                         for p, by in results.items()}, indent=1))


if __name__ == "__main__":
    main()
