"""kvyard's /v1/embeddings over HTTP vs sentence-transformers' in-process encode vs vLLM's CPU pooling runner
over HTTP, same model (the embedded all-MiniLM-L6-v2), same dtype (float32), same machine, same run.

    .venv/bin/python benchmarks/embeddings.py [--sentences 1000] [--batch 32] [--threads N]
        [--only kvyard,sentence-transformers,vllm,llama,kvyard-gguf] [--dtype float32|bfloat16]

`llama` adds llama.cpp's llama-server (`--embedding --pooling mean`) on the same model written as llama.cpp's
converter lays out a BERT GGUF (F32, into the peer cache); `kvyard-gguf` is kvyard serving that same file.
`--dtype bfloat16` runs kvyard (DTYPE), sentence-transformers (the model cast) and vLLM (--dtype) in bfloat16 — on
a CPU with AMX-BF16 all three multiply on its tiles; the cosines are then against float32 sentence-transformers.

Throughput: N sentences of 20-60 words (a fixed seed), in batches of 32: kvyard and vLLM as one HTTP request
per batch, sequential (a client embedding a corpus); sentence-transformers as model.encode(batch) per batch.
The three are interleaved batch by batch, each timed call once the machine idles (see settle()). Latency: the
p50 of 50 requests of one short sentence each. kvyard runs as PDFUSION's embedding backend + frontend (the chat
backend is a mock: no weights); vLLM as benchmarks/vllm_peer.py starts it (its own venv). kvyard and
sentence-transformers get the same torch thread count, vLLM its OpenMP threads bound to every core. Each
system's vectors are checked against sentence-transformers' (the lowest cosine is printed).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx

from role_procs import ProcessGroup, settle, wait_healthy  # noqa: E402

sys.path.insert(0, str(__import__("role_procs").REPO))
from kvyard.pooling_model import EMBEDDED_EMBEDDING_NAME, embedded_embedding_path  # noqa: E402
from kvyard.ports import free_port_block  # noqa: E402

WORDS = ("the a of and to in is was for on that with as by at from it this be are an or which have has not but "
         "model data system time people water city music river history science energy market light paper "
         "window garden friend story morning language computer mountain problem answer question result "
         "quickly slowly carefully bright dark warm cold large small ancient modern quiet loud").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))).capitalize() + "." for _ in range(n)]


Embed = Callable[[list[str]], list[list[float]] | None]


@contextmanager
def kvyard_embedder(batch: int, threads: int, dtype: str = "float32") -> Iterator[Embed]:
    """PDFUSION's embedding backend + a frontend (the chat backend a mock), asked over HTTP."""
    group = ProcessGroup("kvyard-embeddings-", "benchmark-cluster-token-0123456789")
    chat, encoder, frontend = free_port_block(6), free_port_block(6), free_port_block(6)
    try:
        group.kvyard("chat", {"ROLE_TYPE": "MOCK_BACKEND", "START_PORT": str(chat), "MOCK_TOKEN_IDS": "[1, 2]"})
        enc = group.kvyard("encoder", {"ROLE_TYPE": "PDFUSION", "FRONTEND_SERVER_COUNT": "0",
                                       "START_PORT": str(encoder), "CHECKPOINT_PATH": str(embedded_embedding_path()),
                                       "TORCH_NUM_THREADS": str(threads), "MAX_NUM_SEQS": str(batch),
                                       "MAX_NUM_BATCHED_TOKENS": "8192", "DTYPE": dtype})
        fe = group.kvyard("frontend", {"ROLE_TYPE": "FRONTEND", "START_PORT": str(frontend), "MODEL_NAME": "chat",
                                       "MAX_SEQ_LEN": "1024", "BACKEND_ADDRESS": f"127.0.0.1:{chat + 1}",
                                       "EMBEDDING_MODEL_PATH": "embedded",
                                       "EMBEDDING_BACKEND_ADDRESS": f"127.0.0.1:{encoder + 1}"})
        wait_healthy(f"http://127.0.0.1:{encoder + 5}/health", enc, 300)
        url = f"http://127.0.0.1:{frontend}"
        wait_healthy(f"{url}/health", fe, 120)
        with httpx.Client(base_url=f"{url}/v1", timeout=300) as client:
            yield http_embedder(client, EMBEDDED_EMBEDDING_NAME)
    finally:
        group.stop()


def minilm_gguf() -> Path:
    """The embedded MiniLM as an F32 BERT GGUF (tests/support/tiny_encoders.py write_bert_gguf), built once."""
    from peer_servers import CACHE
    from tests.support.tiny_encoders import write_bert_gguf
    path = CACHE / "all-MiniLM-L6-v2.F32.gguf"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        write_bert_gguf(embedded_embedding_path(), path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)
    return path


@contextmanager
def llama_embedder(batch: int, threads: int) -> Iterator[Embed]:
    """llama-server on the GGUF: mean pooling (the file says so too), a batch of `batch` sentences in one request
    spread over `batch` slots, every sentence within one micro-batch (a BERT needs its whole input at once)."""
    import subprocess

    from peer_servers import llama_binary, stop_groups
    port = free_port_block()
    proc = subprocess.Popen([str(llama_binary("llama-server")), "-m", str(minilm_gguf()), "--host", "127.0.0.1",
                             "--port", str(port), "-t", str(threads), "--embedding", "--pooling", "mean",
                             "-np", str(batch), "-c", str(512 * batch), "-b", "8192", "-ub", "8192"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, 300)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=300) as client:
            yield http_embedder(client, "minilm", base64=False)
    finally:
        stop_groups([proc], 30)


@contextmanager
def kvyard_gguf_embedder(batch: int, threads: int) -> Iterator[Embed]:
    """kvyard serving the same GGUF as its main model (PDFUSION: backend + frontend)."""
    group = ProcessGroup("kvyard-embeddings-gguf-", "benchmark-cluster-token-0123456789")
    port = free_port_block(6)
    try:
        proc = group.kvyard("gguf", {"ROLE_TYPE": "PDFUSION", "START_PORT": str(port), "CHECKPOINT_PATH": str(minilm_gguf()),
                                     "TORCH_NUM_THREADS": str(threads), "MAX_NUM_SEQS": str(batch),
                                     "MAX_NUM_BATCHED_TOKENS": "8192", "MODEL_NAME": "minilm"})
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, 300)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=300) as client:
            yield http_embedder(client, "minilm")
    finally:
        group.stop()


@contextmanager
def vllm_embedder(batch: int, dtype: str = "float32") -> Iterator[Embed]:
    """vLLM's CPU backend, its pooling runner on the same directory (benchmarks/vllm_peer.py)."""
    from vllm_peer import vllm_pooling_server
    with vllm_pooling_server(embedded_embedding_path(), EMBEDDED_EMBEDDING_NAME, batch, dtype) as (url, _pid), \
            httpx.Client(base_url=url, timeout=300) as client:
        yield http_embedder(client, EMBEDDED_EMBEDDING_NAME)


def http_embedder(client: httpx.Client, model: str, base64: bool = True) -> Embed:
    """One POST /v1/embeddings per call; the vectors back only when asked (base64 otherwise, as a corpus
    client would ask, where the server takes it)."""
    def embed(texts: list[str], vectors: bool = False) -> list[list[float]] | None:
        r = client.post("/embeddings", json={"input": texts if len(texts) > 1 else texts[0], "model": model,
                                             "encoding_format": "float" if vectors or not base64 else "base64"})
        r.raise_for_status()
        return [d["embedding"] for d in r.json()["data"]] if vectors else None
    return embed  # type: ignore[return-value]


@contextmanager
def st_embedder(batch: int, threads: int, dtype: str = "float32") -> Iterator[Embed]:
    import torch
    from sentence_transformers import SentenceTransformer
    torch.set_num_threads(threads)
    model = SentenceTransformer(str(embedded_embedding_path()), device="cpu").to(getattr(torch, dtype))

    def embed(texts: list[str], vectors: bool = False) -> list[list[float]] | None:
        out = model.encode(texts, batch_size=batch)
        return out.tolist() if vectors else None
    yield embed  # type: ignore[misc]


def interleaved(embedders: dict[str, Embed], texts: list[str], batch: int) -> dict[str, tuple[float, float]]:
    """Each batch (then each one-sentence request) goes to every system in turn, the order rotating, so a
    burst of load elsewhere on the machine lands on all of them alike. → name: (sentences/s, p50 ms).
    Before each timed call the machine settles (see settle())."""
    names = list(embedders)
    for name in names:  # warm-up
        for _ in range(3):
            embedders[name](texts[:batch])
    spent = dict.fromkeys(names, 0.0)
    for k, i in enumerate(range(0, len(texts), batch)):
        for name in names[k % len(names):] + names[:k % len(names)]:
            settle()
            t = time.perf_counter()
            embedders[name](texts[i:i + batch])
            spent[name] += time.perf_counter() - t
    lat: dict[str, list[float]] = {n: [] for n in names}
    for k in range(50):
        for name in names[k % len(names):] + names[:k % len(names)]:
            settle()
            t = time.perf_counter()
            embedders[name](["A short sentence."])
            lat[name].append(time.perf_counter() - t)
    return {n: (len(texts) / spent[n], statistics.median(lat[n]) * 1000) for n in names}


def agreement(embedders: dict[str, Embed], texts: list[str]) -> dict[str, float]:
    """The lowest cosine of each system's vectors against float32 sentence-transformers' (a wrong answer is no win)."""
    import torch
    from sentence_transformers import SentenceTransformer
    reference = SentenceTransformer(str(embedded_embedding_path()), device="cpu")
    ref = torch.tensor(reference.encode(texts, batch_size=len(texts)))
    return {n: float(torch.cosine_similarity(torch.tensor(e(texts, True)), ref).min())  # type: ignore[call-arg]
            for n, e in embedders.items()}


LABELS = {"kvyard": "kvyard /v1/embeddings (HTTP)", "sentence-transformers": "sentence-transformers encode "
          "(in process)", "vllm": "vLLM CPU pooling runner /v1/embeddings (HTTP)",
          "llama": "llama.cpp llama-server --embedding, the F32 GGUF (HTTP)",
          "kvyard-gguf": "kvyard /v1/embeddings, the F32 GGUF (HTTP)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", default="kvyard,sentence-transformers,vllm",
                    help="comma-separated: kvyard, sentence-transformers, vllm, llama, kvyard-gguf")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="kvyard's, sentence-transformers' and vLLM's (llama.cpp reads the F32 GGUF either way)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    texts = sentences(args.sentences)
    only = [n for n in LABELS if n in args.only.split(",")]
    makers = {"kvyard": lambda: kvyard_embedder(args.batch, args.threads, args.dtype),
              "sentence-transformers": lambda: st_embedder(args.batch, args.threads, args.dtype),
              "vllm": lambda: vllm_embedder(args.batch, args.dtype),
              "llama": lambda: llama_embedder(args.batch, args.threads),
              "kvyard-gguf": lambda: kvyard_gguf_embedder(args.batch, args.threads)}
    with ExitStack() as stack:
        embedders = {n: stack.enter_context(makers[n]()) for n in only}
        load = os.getloadavg()
        results = interleaved(embedders, texts, args.batch)
        cosines = agreement(embedders, texts[:64])
    print(f"\n{args.sentences} sentences of 20-60 words, batch {args.batch}, all-MiniLM-L6-v2 {args.dtype}, "
          f"{args.threads} torch threads, interleaved; load average at the start {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}, at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| | sentences/s | p50 one short sentence (ms) | min cosine vs float32 sentence-transformers |\n|---|---|---|---|")
    for name, (rate, p50) in results.items():
        cos = f"{cosines[name]:.6f}"
        print(f"| {LABELS[name]} | {rate:.0f} | {p50:.1f} | {cos} |")
    if "kvyard" in results:
        for peer in ("sentence-transformers", "vllm", "llama"):
            if peer in results:
                print(f"| ratio kvyard / {peer} | {results['kvyard'][0] / results[peer][0]:.2f}x | | |")


if __name__ == "__main__":
    main()
