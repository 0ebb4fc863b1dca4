"""kvyard against what a user would run instead, on the same GGUF, in one run (`make bench-peers`).

    .venv/bin/python benchmarks/peers.py [--rounds 3] [--only kvyard,llama,hf,vllm] [--kvyard-env KEY=VALUE ...]
                                         [--quick] [--json out.json]

Peers: llama.cpp's llama-server (built once from the llama-cpp-python sdist into ~/.cache/kvyard, see
benchmarks/peer_servers.py; `-t 2 -np 32 -c 16384` for the streams, a one-slot server for the long
prompt) and kvyard (`python -m kvyard`, PDFUSION, defaults) through the HTTP API with the official openai
client, and transformers' `generate` in-process (float32, same weights).

These shared 2-core machines drift by tens of percent within minutes, so the servers are measured side
by side: all of them are started first (an idle server takes no CPU), then each round drives one server
at a time through every workload, alternating which goes first; the table shows each server's median
over the rounds and the spread of the per-round ratios. transformers runs after the servers have stopped.
Workloads:
  single   one chat request at a time ("Tell me a long story about robot number i."), 96 output tokens
           (ignore_eos, temperature 0.8), 3 requests: tok/s, first token included
  itl      the same streamed (SSE): inter-token latency p50, ms
  agg@32   32 concurrent requests of the same kind: aggregate tok/s
  ttft     a ~1,000-token prompt with max_tokens=1 (distinct prompts: no cache hits), machine otherwise
           idle: latency p50, ms
`KVYARD_CPU_ISA=avx2` (or `avx512`) in the environment runs an older CPU's path on this one: kvyard's kernels
capped at that level and llama-server built for it (benchmarks/peer_servers.py); vLLM is not capped.
Prints resident memory too: kvyard's own account (before/after the weights, with the KV cache) and each
server's resident size after the run.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peer_servers import CACHE, kvyard_server, llama_server, tree_rss_mb  # noqa: E402
from role_procs import settle  # noqa: E402
from kvyard.model_path import embedded_model_path  # noqa: E402

OUT_TOKENS = 96
LONG_TEXT = (Path(__file__).resolve().parents[1] / "tests" / "backend" / "data" / "ordinary_text.txt").read_text()


def story(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me a long story about robot number {i}."}]


def chat_tokens(client, model: str, messages: list[dict[str, str]], max_tokens: int) -> int:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0.8,
                                       extra_body={"ignore_eos": True})
    return r.usage.completion_tokens


def client_for(base_url: str):  # type: ignore[no-untyped-def]
    from openai import OpenAI
    client = OpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    model = client.models.list().data[0].id
    chat_tokens(client, model, story(0), 8)  # warm-up
    return client, model


def measure_single(client, model: str, n: int, offset: int,  # type: ignore[no-untyped-def]
                   out_tokens: int = OUT_TOKENS) -> float:
    t0 = time.perf_counter()
    tokens = sum(chat_tokens(client, model, story(offset + i), out_tokens) for i in range(n))
    return tokens / (time.perf_counter() - t0)


def measure_itl(client, model: str, offset: int) -> float:  # type: ignore[no-untyped-def]
    """p50 gap between streamed chunks that carry text, over one 96-token stream."""
    stamps = []
    stream = client.chat.completions.create(model=model, messages=story(offset), max_tokens=OUT_TOKENS,
                                            temperature=0.8, stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
    return 1000 * statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def measure_agg(client, model: str, concurrency: int, offset: int,  # type: ignore[no-untyped-def]
                out_tokens: int = OUT_TOKENS) -> float:
    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        tokens = sum(pool.map(lambda i: chat_tokens(client, model, story(offset + i), out_tokens), range(concurrency)))
        return tokens / (time.perf_counter() - t0)


def measure_ttft(client, model: str, n: int) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """p50 milliseconds to the first (only) token of a ~930-token prompt no server has seen."""
    ttft, prompt_tokens = [], 0
    for i in range(n):
        prompt = f"Document {i} of {time.time_ns()}.\n{LONG_TEXT}\n{LONG_TEXT[:1200]}\nSummarise document {i}."
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=1, temperature=0)
        ttft.append(time.perf_counter() - t0)
        prompt_tokens = r.usage.prompt_tokens
    return 1000 * statistics.median(ttft), prompt_tokens


def measure_transformers(gguf: Path, n_single: int, concurrency: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok.padding_side = "left"

    def run(batch: list[int]) -> float:
        texts = [tok.apply_chat_template(story(i), tokenize=False, add_generation_prompt=True) for i in batch]
        enc = tok(texts, return_tensors="pt", padding=True)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=OUT_TOKENS, min_new_tokens=OUT_TOKENS, do_sample=True,
                                 temperature=0.8, pad_token_id=tok.pad_token_id or tok.eos_token_id)
        return (out.shape[1] - enc["input_ids"].shape[1]) * len(batch) / (time.perf_counter() - t0)

    run([0])  # warm-up
    single = statistics.mean(run([i]) for i in range(1, n_single + 1))
    return {"single": single, "agg": run(list(range(100, 100 + concurrency)))}


def kvyard_memory_line() -> str:
    """What the backend logged about its resident memory (backend/main.py)."""
    log = (CACHE / "kvyard-peer.log").read_text(errors="replace")
    found = re.findall(r"resident: (.*)", log)
    return found[-1] if found else "(not logged)"


def kvyard_settings_line(log_name: str = "kvyard-peer.log") -> str:
    """The backend's account of its weights and activations (backend/main.py)."""
    found = re.findall(r"kvyard.backend: weights: (.*)", (CACHE / log_name).read_text(errors="replace"))
    return found[-1] if found else "(not logged)"


def report(samples: dict[str, dict[str, list[float]]], hf: dict[str, float], concurrency: int) -> None:
    kv, ll = samples.get("kvyard", {}), samples.get("llama", {})

    def med(d: dict[str, list[float]], key: str) -> float | None:
        return statistics.median(d[key]) if d.get(key) else None

    def cell(v: float | None) -> str:
        return "—" if v is None else f"{v:.1f}"

    def ratio(key: str, target: float, lower_is_better: bool) -> str:
        a, b = med(kv, key), med(ll, key)
        if a is None or b is None:
            return "—"
        r = a / b
        per_round = [x / y for x, y in zip(kv[key], ll[key])]
        ok = r <= target if lower_is_better else r >= target
        return (f"{r:.2f}x {'met' if ok else 'MISSED'} ({'<=' if lower_is_better else '>='}{target}; "
                f"rounds {min(per_round):.2f}-{max(per_round):.2f})")

    rows = [("single stream tok/s", "single", 1.0, False, "single"),
            ("single stream ITL p50 ms (SSE)", "itl", 1.0, True, None),
            (f"agg@{concurrency} tok/s", "agg", 2.0, False, "agg"),
            ("TTFT p50 ~1k-token prompt, ms", "ttft", 1.0, True, None)]
    n = max((len(v) for d in samples.values() for v in d.values()), default=0)
    print(f"\nmedians over {n} rounds")
    vl = samples.get("vllm", {})
    print(f"{'workload':32} {'kvyard':>8} {'llama-server':>13} {'transformers':>13} {'vLLM':>8}   "
          f"{'kvyard/llama (target; per-round range)':44} {'kvyard/transformers':26} kvyard/vLLM")
    for name, key, target, lower, hf_key in rows:
        hf_val = hf.get(hf_key) if hf_key else None
        kv_val, vl_val = med(kv, key), med(vl, key)
        vs_hf = f"{kv_val / hf_val:.2f}x {'met' if kv_val / hf_val >= 1.5 else 'MISSED'} (>=1.5)" \
            if kv_val is not None and hf_val else "—"
        vs_vl = f"{kv_val / vl_val:.2f}x" if kv_val is not None and vl_val else "—"
        print(f"{name:32} {cell(kv_val):>8} {cell(med(ll, key)):>13} {cell(hf_val):>13} {cell(vl_val):>8}   "
              f"{ratio(key, target, lower):44} {vs_hf:26} {vs_vl}")


def start_servers(stack: ExitStack, gguf: Path, kvyard_env: dict[str, str], only: set[str]) -> dict[str, tuple]:
    """The servers `only` names, stopped with the stack: llama-server (one with many slots, one with a single
    slot for TTFT), kvyard and vLLM's CPU backend. → name: (client, TTFT client, pid)."""
    servers: dict[str, tuple] = {}
    if "llama" in only:
        url, pid = stack.enter_context(llama_server(gguf))
        ttft_url, _ = stack.enter_context(llama_server(gguf, slots=1, context=4096))
        servers["llama"] = (client_for(url), client_for(ttft_url), pid)
    if "kvyard" in only:
        url, pid = stack.enter_context(kvyard_server(kvyard_env))
        kv_client = client_for(url)
        servers["kvyard"] = (kv_client, kv_client, pid)
    if "vllm" in only:  # benchmarks/vllm_peer.py: its own venv, the same weights as a Hugging Face directory
        from vllm_peer import vllm_server
        url, pid = stack.enter_context(vllm_server(gguf))
        vllm_client = client_for(url)
        servers["vllm"] = (vllm_client, vllm_client, pid)
    return servers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="kvyard,llama,hf")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one round, fewer requests, agg@8")
    ap.add_argument("--kvyard-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment for kvyard's role processes, e.g. ACTIVATIONS=float32")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    kvyard_env = dict(kv.split("=", 1) for kv in args.kvyard_env)
    only = set(args.only.split(","))
    rounds = 1 if args.quick else args.rounds
    n_single, concurrency, n_ttft = (1, 8, 2) if args.quick else (3, 32, 5)
    gguf = embedded_model_path()
    samples: dict[str, dict[str, list[float]]] = {}
    extra: dict[str, str] = {}
    with ExitStack() as stack:
        servers = start_servers(stack, gguf, kvyard_env, only)
        if "kvyard" in servers:
            extra["kvyard memory"] = kvyard_memory_line()
            extra["kvyard settings"] = kvyard_settings_line() + (f" ({', '.join(args.kvyard_env)})" if kvyard_env else "")
        names = list(servers)
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                settle()  # the server before may still hold a core (vLLM's worker: ~1 s after a request)
                (client, model), (ttft_client, ttft_model), _ = servers[name]
                got = samples.setdefault(name, {})
                got.setdefault("single", []).append(measure_single(client, model, n_single, 1 + 10 * r))
                got.setdefault("itl", []).append(measure_itl(client, model, 5 + 10 * r))
                got.setdefault("agg", []).append(measure_agg(client, model, concurrency, 100 + 100 * r))
                ttft, prompt_tokens = measure_ttft(ttft_client, ttft_model, n_ttft)
                got.setdefault("ttft", []).append(ttft)
                extra["TTFT prompt"] = f"{prompt_tokens} tokens ({name}'s count)"
                print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in got.items()), flush=True)
        for name, (_, _, pid) in servers.items():
            rss = tree_rss_mb(pid)
            extra[f"{name} resident after the run"] = (f"{max(rss.values()):.0f} MB largest process "
                                                       f"({sum(rss.values()):.0f} MB all {len(rss)})")
    hf = measure_transformers(gguf, n_single, concurrency) if "hf" in only else {}
    if hf:
        print("transformers:", {k: round(v, 1) for k, v in hf.items()}, flush=True)
    report(samples, hf, concurrency)
    for key, value in extra.items():
        print(f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps({"samples": samples, "transformers": hf, "extra": extra}, indent=2))


if __name__ == "__main__":
    main()
