"""Time to first token of one 448x448 image + a short question on a LLaVA-shaped model (random weights,
realistic widths: a 12-layer ViT-S/14 tower, 1024 image tokens, a 135M-parameter Llama), kvyard over HTTP
(the real PDFUSION cluster, the openai-style chat route, the image as a data: URI) against transformers'
LlavaForConditionalGeneration.generate in process (its CLIP image processor included), both float32 on the
same machine and thread count, in the same run, each timed call once the machine idles (role_procs.settle).
--family qwen2_5_vl: the same widths as a Qwen2.5-VL (a 12-layer windowed tower, 256 image tokens after the
2×2 merge, Qwen2 with M-RoPE) against Qwen2_5_VLForConditionalGeneration (its Qwen2-VL image processor
included). Then the same image again: kvyard's embedding cache and prefix cache against its first time. --vit-memory instead starts a ROLE_TYPE=VIT process (tower and
projector only) and a backend (the whole model, KV_CACHE_MB=16) on the same checkpoint and prints each
one's peak resident memory after loading. --dtype bfloat16 runs both sides in bfloat16 (AMX-BF16 tiles where the
CPU has them).

    .venv/bin/python benchmarks/vision.py [--trials 3] [--threads N] [--vit-memory] [--family qwen2_5_vl]
        [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse
import base64
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from role_procs import REPO, ProcessGroup, settle, wait_healthy  # noqa: E402

sys.path.insert(0, str(REPO))
from kvyard.ports import free_port_block  # noqa: E402
from tests.support.tiny_qwen_vl import save_qwen_vl_dir, tiny_qwen_vl  # noqa: E402
from tests.support.tiny_vision import png_bytes, save_llava_dir, tiny_llava  # noqa: E402

SIDE = 448
QUESTION = "What is in this picture?"
TEXT = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "max_position_embeddings": 2048}
VISION = {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 12, "num_attention_heads": 6}
QWEN_TEXT = {**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}}
QWEN_VISION = {"depth": 12, "hidden_size": 384, "intermediate_size": 1536, "num_heads": 6, "out_hidden_size": 576,
               "window_size": 112, "fullatt_block_indexes": [3, 7, 11]}


def chat_body(image: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                                      {"type": "image_url", "image_url": {"url": url}}]}],
            "max_tokens": 1, "temperature": 0, "aux_info": True}


def bench_kvyard(path: Path, images: list[bytes], threads: int, dtype: str) -> tuple[list[float], list[float], list[int]]:
    group = ProcessGroup("kvyard-vision-", "benchmark-cluster-token-0123456789")
    port = free_port_block(6)
    try:
        proc = group.kvyard("pdfusion", {"START_PORT": str(port), "CHECKPOINT_PATH": str(path), "DTYPE": dtype,
                                         "TORCH_NUM_THREADS": str(threads), "KV_CACHE_MB": "256",
                                         "MAX_NUM_BATCHED_TOKENS": "2048"})
        url = f"http://127.0.0.1:{port}"
        wait_healthy(f"{url}/health", proc, 300)
        first, again, reuse = [], [], []
        with httpx.Client(base_url=url, timeout=300) as client:
            client.post("/v1/chat/completions", json=chat_body(png_bytes(SIDE, SIDE, seed=999))).raise_for_status()
            for image in images:
                for times in (first, again):
                    settle()  # each timed call once the machine idles (the last one's threads may still spin)
                    t = time.perf_counter()
                    r = client.post("/v1/chat/completions", json=chat_body(image))
                    r.raise_for_status()
                    times.append(time.perf_counter() - t)
                reuse.append(r.json()["aux_info"]["reuse_len"])
        return first, again, reuse
    finally:
        group.stop()


def peak_mb(pid: int) -> float:
    """The largest VmHWM among `pid` and its children (a backend runs in a child of the launcher)."""
    pids = [pid, *(int(c) for t in Path(f"/proc/{pid}/task").iterdir()
                   for c in (t / "children").read_text().split())]
    peaks = []
    for p in pids:
        line = next(x for x in Path(f"/proc/{p}/status").read_text().splitlines() if x.startswith("VmHWM:"))
        peaks.append(int(line.split()[1]) / 1024)
    return max(peaks)


def vit_memory(path: Path, threads: int) -> dict[str, float]:
    """Peak resident MB of a VIT process and of a backend-only process, each after loading."""
    out = {}
    for role in ("VIT", "PDFUSION"):
        group = ProcessGroup(f"kvyard-{role.lower()}-", "benchmark-cluster-token-0123456789")
        port = free_port_block(6)
        try:
            proc = group.kvyard(role.lower(), {"ROLE_TYPE": role, "START_PORT": str(port), "CHECKPOINT_PATH": str(path),
                                               "DTYPE": "float32", "TORCH_NUM_THREADS": str(threads), "KV_CACHE_MB": "16",
                                               "FRONTEND_SERVER_COUNT": "0"})
            wait_healthy(f"http://127.0.0.1:{port + 5}/health", proc, 300)
            out[role] = peak_mb(proc.pid)
        finally:
            group.stop()
    return out


def bench_transformers_qwen(path: Path, images: list[bytes], threads: int, dtype: str) -> list[float]:
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from backend.image_preprocess import decode_image
    torch.set_num_threads(threads)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    processor: Any = Qwen2VLImageProcessorPil.from_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    pad = "<|image_pad|>"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "<|vision_start|>" + pad + "<|vision_end|>"
                                             + QUESTION}], tokenize=False, add_generation_prompt=True)
    out = []
    for image in [png_bytes(SIDE, SIDE, seed=999), *images]:
        settle()
        t = time.perf_counter()
        inputs = processor(images=[decode_image(image)], return_tensors="pt")
        n = int(inputs["image_grid_thw"].prod()) // 4
        ids = torch.tensor([tokenizer(prompt.replace(pad, pad * n), add_special_tokens=False)["input_ids"]])
        types = (ids == tokenizer.convert_tokens_to_ids(pad)).int()
        with torch.inference_mode():
            model.generate(input_ids=ids, mm_token_type_ids=types, max_new_tokens=1, do_sample=False, **inputs)
        out.append(time.perf_counter() - t)
    return out[1:]  # the first was the warm-up


def bench_transformers(path: Path, images: list[bytes], threads: int, dtype: str) -> list[float]:
    import io

    import torch
    from PIL import Image
    from transformers import AutoTokenizer, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    torch.set_num_threads(threads)
    model = LlavaForConditionalGeneration.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    processor: Any = CLIPImageProcessorPil.from_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    n_image = (SIDE // 14) ** 2
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION + "<image>"}], tokenize=False,
                                           add_generation_prompt=True).replace("<image>", "<image>" * n_image)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = []
    for image in [png_bytes(SIDE, SIDE, seed=999), *images]:
        settle()
        t = time.perf_counter()
        pixels = processor(images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")["pixel_values"]
        pixels = pixels.to(model.dtype)
        with torch.inference_mode():
            model.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=1, do_sample=False)
        out.append(time.perf_counter() - t)
    return out[1:]  # the first was the warm-up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--vit-memory", action="store_true", help="only the VIT's and a backend's peak memory")
    ap.add_argument("--family", choices=("llava", "qwen2_5_vl"), default="llava")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    qwen = args.family == "qwen2_5_vl"
    if qwen:  # 448x448 within the pixel budget: 32x32 patches, 256 image tokens
        path = save_qwen_vl_dir(tiny_qwen_vl(text=QWEN_TEXT, vision=QWEN_VISION),
                                Path(tempfile.mkdtemp(prefix="kvyard-qwen-vl-")) / "qwen-vl-bench", max_pixels=SIDE * SIDE)
    else:
        path = save_llava_dir(tiny_llava(image_size=SIDE, text=TEXT, vision=VISION),
                              Path(tempfile.mkdtemp(prefix="kvyard-llava-")) / "llava-bench")
    if args.vit_memory:
        peaks = vit_memory(path, args.threads)
        print("\n| process (float32, after loading) | peak resident (MB) |\n|---|---|")
        print(f"| ROLE_TYPE=VIT (tower + projector) | {peaks['VIT']:.0f} |")
        print(f"| backend (the whole model, KV_CACHE_MB=16) | {peaks['PDFUSION']:.0f} |")
        return
    images = [png_bytes(SIDE, SIDE, seed=i) for i in range(args.trials)]
    first, again, reuse = bench_kvyard(path, images, args.threads, args.dtype)
    theirs = (bench_transformers_qwen if qwen else bench_transformers)(path, images, args.threads, args.dtype)
    med = statistics.median
    print(f"\nTTFT, {args.family}: one {SIDE}x{SIDE} PNG + a short question "
          f"({(SIDE // 28) ** 2 if qwen else (SIDE // 14) ** 2} image tokens), {args.dtype}, "
          f"{args.threads} torch threads, median of {args.trials}\n")
    print("| | TTFT (ms) |\n|---|---|")
    print(f"| kvyard, a new image (HTTP, end to end) | {med(first) * 1000:.0f} |")
    print(f"| kvyard, the same image again (embedding + prefix cache; {med(reuse)} tokens reused) | {med(again) * 1000:.0f} |")
    print(f"| transformers generate, max_new_tokens=1 (in process, processor included) | {med(theirs) * 1000:.0f} |")
    print(f"| transformers / kvyard (new image) | {med(theirs) / med(first):.2f}x |")
    print(f"| kvyard new image / same image again | {med(first) / med(again):.2f}x |")


if __name__ == "__main__":
    main()
