"""kvyard against llama.cpp's llama-server at the sizes people run (`make bench-scale`): a 1.7B-shaped
Q4_K_M GGUF (benchmarks/scale_model.py: random weights, quantized by llama.cpp's own llama-quantize),
served by both, same workloads, interleaved rounds.

    .venv/bin/python benchmarks/scale.py [--rounds 2] [--only kvyard,llama] [--kvyard-env KEY=VALUE ...]
                                         [--gguf PATH] [--json out.json]

Workloads (chat completions through the HTTP API, the official openai client, as benchmarks/peers.py):
  single   one request at a time ("Tell me a long story about robot number i."), 64 output tokens
           (ignore_eos, temperature 0.8), 3 requests: tok/s, first token included
  agg@32   32 concurrent requests of the same kind: aggregate tok/s
  ttft     a ~930-token prompt never seen before (distinct prompts: no cache hits) with max_tokens=1,
           machine otherwise idle: latency p50 over 3 prompts (llama-server: a one-slot server, as in
           peers.py)
All servers start first (an idle server takes no CPU); each round drives one server at a time through
every workload, alternating which goes first; the table shows medians over rounds and the per-round
ratios. vLLM's CPU backend is not a peer here (yet): its venv is several GB.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peer_servers import kvyard_server, llama_server, tree_rss_mb  # noqa: E402
from peers import LONG_TEXT, client_for, kvyard_settings_line, measure_agg, measure_single  # noqa: E402
from scale_model import scale_gguf  # noqa: E402

OUT_TOKENS, N_SINGLE, CONCURRENCY, N_TTFT = 64, 3, 32, 3


def measure_ttft(client, model: str, n: int) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """p50 seconds to the first (only) token of a ~930-token prompt no server has seen."""
    ttft, prompt_tokens = [], 0
    for i in range(n):
        prompt = f"Document {i} of {time.time_ns()}.\n{LONG_TEXT}\nSummarise document {i}."
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=1, temperature=0)
        ttft.append(time.perf_counter() - t0)
        prompt_tokens = r.usage.prompt_tokens
    return statistics.median(ttft), prompt_tokens


def report(samples: dict[str, dict[str, list[float]]]) -> None:
    kv, ll = samples.get("kvyard", {}), samples.get("llama", {})
    rows = [("one stream tok/s", "single", False), (f"{CONCURRENCY} streams tok/s", "agg", False),
            ("cold TTFT s", "ttft", True)]
    n = max((len(v) for d in samples.values() for v in d.values()), default=0)
    print(f"\nmedians over {n} rounds (kvyard/llama-server: >1 is kvyard faster for tok/s, <1 for TTFT)")
    print(f"{'workload':20} {'kvyard':>8} {'llama-server':>13}   kvyard/llama-server (per-round)")
    for name, key, _ in rows:
        a = statistics.median(kv[key]) if kv.get(key) else None
        b = statistics.median(ll[key]) if ll.get(key) else None
        ratio = "—"
        if a is not None and b is not None:
            per_round = ", ".join(f"{x / y:.2f}" for x, y in zip(kv[key], ll[key]))
            ratio = f"{a / b:.2f}x ({per_round})"
        print(f"{name:20} {'—' if a is None else f'{a:.2f}':>8} {'—' if b is None else f'{b:.2f}':>13}   {ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="kvyard,llama")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gguf", type=Path, help="another GGUF instead of the 1.7B-shaped Q4_K_M")
    ap.add_argument("--kvyard-env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    gguf = args.gguf or scale_gguf()
    kvyard_env = {"CHECKPOINT_PATH": str(gguf), **dict(kv.split("=", 1) for kv in args.kvyard_env)}
    only = set(args.only.split(","))
    samples: dict[str, dict[str, list[float]]] = {}
    extra: dict[str, str] = {"model": f"{gguf} ({gguf.stat().st_size / 2**20:.0f} MiB)"}
    with ExitStack() as stack:
        servers: dict[str, tuple] = {}
        if "llama" in only:
            url, pid = stack.enter_context(llama_server(gguf))
            ttft_url, _ = stack.enter_context(llama_server(gguf, slots=1, context=4096))
            servers["llama"] = (client_for(url), client_for(ttft_url), pid)
        if "kvyard" in only:
            url, pid = stack.enter_context(kvyard_server(kvyard_env))
            kv_client = client_for(url)
            servers["kvyard"] = (kv_client, kv_client, pid)
            extra["kvyard settings"] = kvyard_settings_line()
        names = list(servers)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                (client, model), (ttft_client, ttft_model), _ = servers[name]
                got = samples.setdefault(name, {})
                got.setdefault("single", []).append(measure_single(client, model, N_SINGLE, 1 + 10 * r, OUT_TOKENS))
                got.setdefault("agg", []).append(measure_agg(client, model, CONCURRENCY, 100 + 100 * r, OUT_TOKENS))
                ttft, prompt_tokens = measure_ttft(ttft_client, ttft_model, N_TTFT)
                got.setdefault("ttft", []).append(ttft)
                extra[f"TTFT prompt ({name})"] = f"{prompt_tokens} tokens"
                print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in got.items()), flush=True)
        for name, (_, _, pid) in servers.items():
            rss = tree_rss_mb(pid)
            extra[f"{name} resident after the run"] = f"{max(rss.values()):.0f} MB largest process"
    report(samples)
    for key, value in extra.items():
        print(f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps({"samples": samples, "extra": extra}, indent=2))


if __name__ == "__main__":
    main()
