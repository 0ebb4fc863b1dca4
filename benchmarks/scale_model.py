"""The 1.7B-shaped GGUF benchmarks/scale.py serves: SmolLM2-1.7B's shape (llama architecture, hidden 2048,
24 layers, 32 heads and 32 KV heads, intermediate 8192) with random weights and the embedded model's
tokenizer and chat template, quantized Q4_K_M by llama.cpp's own `llama-quantize` (the same llama.cpp
build as the llama-server peer). Built once into ~/.cache/kvyard (a 3.4 GB float16 file on the way,
deleted after quantizing; a few minutes on 2 cores).

    .venv/bin/python benchmarks/scale_model.py [Q5_K_M]    # prints the path, building it if missing

Another llama-quantize type (e.g. Q5_K_M, the other K-quant mix people run) is built the same way beside it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peer_servers import CACHE, llama_binary  # noqa: E402
from kvyard.model_path import embedded_model_path  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 2048, 24, 32, 32, 8192, 8192
NAME = "kvyard-scale-1.7b"


def scale_gguf(quant: str = "Q4_K_M") -> Path:
    """The file quantized `quant` (llama-quantize's type name), built on first use."""
    out = CACHE / f"{NAME}.{quant}.gguf"
    if out.exists():
        return out
    f16 = CACHE / f"{NAME}.F16.gguf"
    if not f16.exists():
        print(f"writing the random-weight float16 GGUF {f16} ...", flush=True)
        _write_f16(f16)
    print(f"quantizing it {quant} with llama-quantize ...", flush=True)
    tmp = out.with_suffix(".partial")
    subprocess.run([str(llama_binary("llama-quantize")), str(f16), str(tmp), quant, "2"], check=True,
                   stdout=subprocess.DEVNULL)
    tmp.rename(out)
    f16.unlink()
    return out


def _write_f16(path: Path) -> None:
    """Metadata of the shape above plus the embedded model's tokenizer fields; weights N(0, 0.02) in
    float16 (norms 1), written tensor by tensor (never the whole model in memory)."""
    import gguf

    src = gguf.GGUFReader(str(embedded_model_path()))
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(NAME)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(130000.0)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, field in src.fields.items():  # the tokenizer and its chat template, as the embedded model has them
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, HIDDEN)),
                                                 ("output_norm.weight", (HIDDEN,))]
    for i in range(LAYERS):
        b = f"blk.{i}."
        shapes += [(b + "attn_norm.weight", (HIDDEN,)), (b + "attn_q.weight", (HIDDEN, HIDDEN)),
                   (b + "attn_k.weight", (HIDDEN * KV_HEADS // HEADS, HIDDEN)),
                   (b + "attn_v.weight", (HIDDEN * KV_HEADS // HEADS, HIDDEN)),
                   (b + "attn_output.weight", (HIDDEN, HIDDEN)), (b + "ffn_norm.weight", (HIDDEN,)),
                   (b + "ffn_gate.weight", (FFN, HIDDEN)), (b + "ffn_up.weight", (FFN, HIDDEN)),
                   (b + "ffn_down.weight", (HIDDEN, FFN))]
    for name, shape in shapes:
        dtype = np.float32 if len(shape) == 1 else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(1700)
    for name, shape in shapes:
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:
            w.write_tensor_data((rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16))
    w.close()


if __name__ == "__main__":
    print(scale_gguf(*sys.argv[1:2]))
