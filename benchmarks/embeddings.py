"""kvyard's /v1/embeddings over HTTP vs sentence-transformers' in-process encode, same model (the embedded
all-MiniLM-L6-v2), same dtype (float32), same machine, same run.

    .venv/bin/python benchmarks/embeddings.py [--sentences 1000] [--batch 32] [--threads N]

Throughput: N sentences of 20-60 words (a fixed seed), in batches of 32: kvyard as one HTTP request per batch,
sequential (a client embedding a corpus); sentence-transformers as model.encode(batch) per batch. Latency:
the p50 of 50 requests of one short sentence each. kvyard runs as PDFUSION's embedding backend + frontend
(the chat backend is a mock: no weights). Both sides get the same torch thread count.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import httpx

from role_procs import ProcessGroup, wait_healthy  # noqa: E402

sys.path.insert(0, str(__import__("role_procs").REPO))
from kvyard.pooling_model import embedded_embedding_path  # noqa: E402
from kvyard.ports import free_port_block  # noqa: E402

WORDS = ("the a of and to in is was for on that with as by at from it this be are an or which have has not but "
         "model data system time people water city music river history science energy market light paper "
         "window garden friend story morning language computer mountain problem answer question result "
         "quickly slowly carefully bright dark warm cold large small ancient modern quiet loud").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))).capitalize() + "." for _ in range(n)]


def bench_kvyard(texts: list[str], batch: int, threads: int) -> tuple[float, float]:
    group = ProcessGroup("kvyard-embeddings-", "benchmark-cluster-token-0123456789")
    chat, encoder, frontend = free_port_block(6), free_port_block(6), free_port_block(6)
    try:
        group.kvyard("chat", {"ROLE_TYPE": "MOCK_BACKEND", "START_PORT": str(chat), "MOCK_TOKEN_IDS": "[1, 2]"})
        enc = group.kvyard("encoder", {"ROLE_TYPE": "PDFUSION", "FRONTEND_SERVER_COUNT": "0",
                                       "START_PORT": str(encoder), "CHECKPOINT_PATH": str(embedded_embedding_path()),
                                       "TORCH_NUM_THREADS": str(threads), "MAX_NUM_SEQS": str(batch),
                                       "MAX_NUM_BATCHED_TOKENS": "8192", "DTYPE": "float32"})
        fe = group.kvyard("frontend", {"ROLE_TYPE": "FRONTEND", "START_PORT": str(frontend), "MODEL_NAME": "chat",
                                       "MAX_SEQ_LEN": "1024", "BACKEND_ADDRESS": f"127.0.0.1:{chat + 1}",
                                       "EMBEDDING_MODEL_PATH": "embedded",
                                       "EMBEDDING_BACKEND_ADDRESS": f"127.0.0.1:{encoder + 1}"})
        wait_healthy(f"http://127.0.0.1:{encoder + 5}/health", enc, 300)
        url = f"http://127.0.0.1:{frontend}"
        wait_healthy(f"{url}/health", fe, 120)
        with httpx.Client(base_url=url, timeout=300) as client:
            for _ in range(3):  # warm-up
                client.post("/v1/embeddings", json={"input": texts[:batch]}).raise_for_status()
            t0 = time.perf_counter()
            for i in range(0, len(texts), batch):
                r = client.post("/v1/embeddings", json={"input": texts[i:i + batch], "encoding_format": "base64"})
                r.raise_for_status()
            throughput = len(texts) / (time.perf_counter() - t0)
            lat = []
            for _ in range(50):
                t = time.perf_counter()
                client.post("/v1/embeddings", json={"input": "A short sentence."}).raise_for_status()
                lat.append(time.perf_counter() - t)
        return throughput, statistics.median(lat) * 1000
    finally:
        group.stop()


def bench_sentence_transformers(texts: list[str], batch: int, threads: int) -> tuple[float, float]:
    import torch
    from sentence_transformers import SentenceTransformer
    torch.set_num_threads(threads)
    model = SentenceTransformer(str(embedded_embedding_path()), device="cpu")
    for _ in range(3):
        model.encode(texts[:batch], batch_size=batch)
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch):
        model.encode(texts[i:i + batch], batch_size=batch)
    throughput = len(texts) / (time.perf_counter() - t0)
    lat = []
    for _ in range(50):
        t = time.perf_counter()
        model.encode(["A short sentence."])
        lat.append(time.perf_counter() - t)
    return throughput, statistics.median(lat) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    texts = sentences(args.sentences)
    kv = bench_kvyard(texts, args.batch, args.threads)
    st = bench_sentence_transformers(texts, args.batch, args.threads)
    print(f"\n{args.sentences} sentences of 20-60 words, batch {args.batch}, all-MiniLM-L6-v2 float32, "
          f"{args.threads} torch threads\n")
    print("| | sentences/s | p50 one short sentence (ms) |\n|---|---|---|")
    print(f"| kvyard /v1/embeddings (HTTP) | {kv[0]:.0f} | {kv[1]:.1f} |")
    print(f"| sentence-transformers encode (in process) | {st[0]:.0f} | {st[1]:.1f} |")
    print(f"| ratio kvyard / sentence-transformers | {kv[0] / st[0]:.2f}x | |")


if __name__ == "__main__":
    main()
