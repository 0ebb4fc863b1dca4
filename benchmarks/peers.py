"""kvyard against what a user would run instead, on the same GGUF, in one run (`make bench-peers`).

    .venv/bin/python benchmarks/peers.py [--only kvyard,llama,hf] [--quick] [--json out.json]

Peers: llama.cpp's llama-server (built once from the llama-cpp-python sdist into ~/.cache/kvyard, see
benchmarks/peer_servers.py; `-t 2 -np 32 -c 16384` for the streams, a one-slot server for the long
prompt) and kvyard (`python -m kvyard`, PDFUSION) through the HTTP API with the
official openai client, and transformers' `generate` in-process (float32, same weights). Servers run one
at a time so they never share the two cores. Workloads:
  single   one chat stream, sequential requests, 96 output tokens (ignore_eos), tok/s
  agg@32   32 concurrent chat requests, aggregate tok/s
  ttft     p50 latency of a ~1,000-token prompt with max_tokens=1 (distinct prompts: no cache hits)
Prints tok/s, TTFT and the ratios the engine-speed issue sets as targets, and each server's resident MB.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peer_servers import kvyard_server, llama_server, tree_rss_mb  # noqa: E402
from kvyard.model_path import embedded_model_path  # noqa: E402

OUT_TOKENS = 96
LONG_TEXT = (Path(__file__).resolve().parents[1] / "tests" / "backend" / "data" / "ordinary_text.txt").read_text()


def story(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me a long story about robot number {i}."}]


def chat_tokens(client, model: str, messages: list[dict[str, str]], max_tokens: int) -> int:
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0.8,
                                       extra_body={"ignore_eos": True})
    return r.usage.completion_tokens


def client_for(base_url: str):  # type: ignore[no-untyped-def]
    from openai import OpenAI
    client = OpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    model = client.models.list().data[0].id
    chat_tokens(client, model, story(0), 8)  # warm-up
    return client, model


def measure_streams(base_url: str, n_single: int, concurrency: int) -> dict[str, float]:
    client, model = client_for(base_url)
    t0 = time.perf_counter()
    tokens = sum(chat_tokens(client, model, story(i), OUT_TOKENS) for i in range(1, n_single + 1))
    single = tokens / (time.perf_counter() - t0)

    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        tokens = sum(pool.map(lambda i: chat_tokens(client, model, story(100 + i), OUT_TOKENS), range(concurrency)))
        agg = tokens / (time.perf_counter() - t0)
    return {"single": single, "agg": agg}


def measure_ttft(base_url: str, n_ttft: int) -> dict[str, float]:
    client, model = client_for(base_url)
    ttft = []
    for i in range(n_ttft):
        prompt = f"Document {i} of {time.time_ns()}.\n{LONG_TEXT}\n{LONG_TEXT[:1200]}\nSummarise document {i}."
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=1, temperature=0)
        ttft.append(time.perf_counter() - t0)
    return {"ttft_ms": 1000 * statistics.median(ttft), "prompt_tokens": r.usage.prompt_tokens}


def measure_transformers(gguf: Path, n_single: int, concurrency: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
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


def report(res: dict[str, dict[str, float]], concurrency: int) -> None:
    kv, ll, hf = res.get("kvyard", {}), res.get("llama", {}), res.get("hf", {})

    def cell(d: dict[str, float], key: str, fmt: str = "{:.1f}") -> str:
        return fmt.format(d[key]) if key in d else "—"

    def ratio(a: dict[str, float], b: dict[str, float], key: str, target: float, lower_is_better: bool = False) -> str:
        if key not in a or key not in b:
            return "—"
        r = a[key] / b[key]
        ok = r <= target if lower_is_better else r >= target
        return f"{r:.2f}x {'met' if ok else 'MISSED'} ({'<=' if lower_is_better else '>='}{target})"

    rows = [("single stream tok/s", "single", 1.0, 1.5, False),
            (f"agg@{concurrency} tok/s", "agg", 2.0, 1.5, False),
            ("TTFT p50 ~1k-token prompt, ms", "ttft_ms", 1.0, None, True)]
    print(f"\n{'workload':34} {'kvyard':>9} {'llama-server':>13} {'transformers':>13}   kvyard/llama               kvyard/transformers")
    for name, key, t_llama, t_hf, lower in rows:
        print(f"{name:34} {cell(kv, key):>9} {cell(ll, key):>13} {cell(hf, key):>13}   "
              f"{ratio(kv, ll, key, t_llama, lower):26} {ratio(kv, hf, key, t_hf) if t_hf else '—'}")
    for name, d in (("kvyard", kv), ("llama-server", ll)):
        if "rss_mb" in d:
            print(f"{name} resident after the run: {d['rss_mb']:.0f} MB ({d.get('rss_detail', '')})")
    if "prompt_tokens" in kv:
        print(f"TTFT prompt: {kv['prompt_tokens']:.0f} tokens (kvyard's count)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="kvyard,llama,hf")
    ap.add_argument("--quick", action="store_true", help="fewer requests, agg@8")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    only = set(args.only.split(","))
    n_single, concurrency, n_ttft = (1, 8, 2) if args.quick else (3, 32, 5)
    gguf = embedded_model_path()
    res: dict[str, dict[str, float]] = {}
    if "llama" in only:
        with llama_server(gguf) as (url, pid):
            loaded = sum(tree_rss_mb(pid).values())
            res["llama"] = measure_streams(url, n_single, concurrency)
            res["llama"]["rss_detail"] = f"{loaded:.0f} MB right after load"  # type: ignore[assignment]
            res["llama"]["rss_mb"] = sum(tree_rss_mb(pid).values())
        with llama_server(gguf, slots=1, context=4096) as (url, pid):
            res["llama"].update(measure_ttft(url, n_ttft))
        print("llama-server:", res["llama"], flush=True)
    if "kvyard" in only:
        with kvyard_server({}) as (url, pid):
            loaded = max(tree_rss_mb(pid).values())  # the backend: the largest of the launcher's processes
            res["kvyard"] = measure_streams(url, n_single, concurrency)
            res["kvyard"].update(measure_ttft(url, n_ttft))
            res["kvyard"]["rss_mb"] = max(tree_rss_mb(pid).values())
            res["kvyard"]["rss_detail"] = f"backend process; {loaded:.0f} MB right after load"  # type: ignore[assignment]
        print("kvyard:", res["kvyard"], flush=True)
    if "hf" in only:
        res["hf"] = measure_transformers(gguf, n_single, concurrency)
        print("transformers:", res["hf"], flush=True)
    report(res, concurrency)
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
