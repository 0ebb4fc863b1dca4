"""kvyard against llama.cpp's llama-server at the sizes people run (`make bench-scale`): a 1.7B-shaped
Q4_K_M GGUF (benchmarks/scale_model.py: random weights, quantized by llama.cpp's own llama-quantize),
served by both, same workloads, interleaved rounds.

    .venv/bin/python benchmarks/scale.py [--rounds 2] [--only kvyard,llama,vllm] [--kvyard-env KEY=VALUE ...]
                                         [--gguf PATH | --quant Q5_K_M] [--before CHECKOUT [--before-env KEY=VALUE]]
                                         [--workloads single,agg,ttft]
                                         [--json out.json]

--before runs a second kvyard from another checkout (e.g. `git worktree add --detach /tmp/before <commit>`
with its own .venv link) as a third server, "before": a change's effect measured in the same rounds.
--before-env gives it other settings: `--before . --before-env KQUANTS=convert` compares two settings of one
checkout.

Workloads (chat completions through the HTTP API, the official openai client, as benchmarks/peers.py):
  single   one request at a time ("Tell me a long story about robot number i."), 64 output tokens
           (ignore_eos, temperature 0.8), 3 requests: tok/s, first token included
  agg@32   32 concurrent requests of the same kind: aggregate tok/s
  ttft     a ~930-token prompt never seen before (distinct prompts: no cache hits) with max_tokens=1,
           machine otherwise idle: latency p50 over 3 prompts (llama-server: a one-slot server, as in
           peers.py)
`KVYARD_CPU_ISA=avx2` (or `avx512`) in the environment runs an older CPU's path on this one: kvyard's kernels
capped at that level and llama-server built for it (benchmarks/peer_servers.py); vLLM is not capped.
All servers start first (an idle server takes no CPU); each round drives one server at a time through
every workload, alternating which goes first; the table shows medians over rounds and the per-round
ratios. `--only kvyard,llama,vllm` adds vLLM's CPU backend (benchmarks/vllm_peer.py: a venv of its own, the
same weights as a Hugging Face directory, bfloat16 where the CPU has it natively, else float32).
"""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peer_servers import kvyard_server, tree_rss_mb  # noqa: E402
from role_procs import settle  # noqa: E402
from peers import (client_for, kvyard_settings_line, measure_agg, measure_single, measure_ttft,  # noqa: E402
                   start_servers)
from scale_model import scale_gguf  # noqa: E402

OUT_TOKENS, N_SINGLE, CONCURRENCY, N_TTFT = 64, 3, 32, 3


def report(samples: dict[str, dict[str, list[float]]]) -> None:
    rows = [("one stream tok/s", "single"), (f"{CONCURRENCY} streams tok/s", "agg"), ("cold TTFT s", "ttft")]
    names = [n for n in ("kvyard", "before", "llama", "vllm") if n in samples]
    pairs = [(a, b) for a, b in (("kvyard", "llama"), ("kvyard", "vllm"), ("before", "llama"), ("kvyard", "before"))
             if a in samples and b in samples]
    n = max((len(v) for d in samples.values() for v in d.values()), default=0)
    print(f"\nmedians over {n} rounds (ratios: >1 is the first faster for tok/s, <1 for TTFT; per round in brackets)")
    print(f"{'workload':20} " + " ".join(f"{name:>8}" for name in names) + "   " +
          "   ".join(f"{a}/{b}" for a, b in pairs))
    for label, key in rows:
        if not all(key in samples[name] for name in names):
            continue
        cells = [f"{statistics.median(samples[name][key]):8.2f}" for name in names]
        ratios = []
        for a, b in pairs:
            xs, ys = samples[a][key], samples[b][key]
            per_round = ", ".join(f"{x / y:.2f}" for x, y in zip(xs, ys))
            ratios.append(f"{statistics.median(xs) / statistics.median(ys):.2f}x ({per_round})")
        print(f"{label:20} " + " ".join(cells) + "   " + "   ".join(ratios))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="kvyard,llama")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gguf", type=Path, help="another GGUF instead of the 1.7B-shaped Q4_K_M")
    ap.add_argument("--quant", default="Q4_K_M", help="the 1.7B-shaped model quantized another way by llama-quantize "
                    "(e.g. Q5_K_M; built on first use)")
    ap.add_argument("--kvyard-env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--before", type=Path, help="another kvyard checkout, served too as 'before'")
    ap.add_argument("--before-env", action="append", default=[], metavar="KEY=VALUE",
                    help="settings for 'before' only (over --kvyard-env), e.g. this checkout with KQUANTS=convert")
    ap.add_argument("--workloads", default="single,agg,ttft", help="a subset, e.g. single,agg (decode only)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still stops its servers (finally)
    gguf = args.gguf or scale_gguf(args.quant)
    kvyard_env = {"CHECKPOINT_PATH": str(gguf), **dict(kv.split("=", 1) for kv in args.kvyard_env)}
    only = set(args.only.split(","))
    workloads = set(args.workloads.split(","))
    samples: dict[str, dict[str, list[float]]] = {}
    extra: dict[str, str] = {"model": f"{gguf} ({gguf.stat().st_size / 2**20:.0f} MiB)"}
    with ExitStack() as stack:
        servers = start_servers(stack, gguf, kvyard_env, only)
        if "kvyard" in servers:
            extra["kvyard settings"] = kvyard_settings_line()
        if args.before is not None:
            before_env = {**kvyard_env, **dict(kv.split("=", 1) for kv in args.before_env)}
            url, pid = stack.enter_context(kvyard_server(before_env, root=args.before.resolve(),
                                                         log_name="kvyard-before.log"))
            before_client = client_for(url)
            servers["before"] = (before_client, before_client, pid)
            extra["before settings"] = f"{args.before}: {kvyard_settings_line('kvyard-before.log')}"
        names = list(servers)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                settle()  # the server before may still hold a core (vLLM's worker: ~1 s after a request)
                (client, model), (ttft_client, ttft_model), _ = servers[name]
                got = samples.setdefault(name, {})
                if "single" in workloads:
                    got.setdefault("single", []).append(measure_single(client, model, N_SINGLE, 1 + 10 * r, OUT_TOKENS))
                if "agg" in workloads:
                    got.setdefault("agg", []).append(measure_agg(client, model, CONCURRENCY, 100 + 100 * r, OUT_TOKENS))
                if "ttft" in workloads:
                    ttft_ms, prompt_tokens = measure_ttft(ttft_client, ttft_model, N_TTFT)
                    got.setdefault("ttft", []).append(ttft_ms / 1000)   # seconds in this report
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
