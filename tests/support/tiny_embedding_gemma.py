"""A tiny random EmbeddingGemma: transformers' Gemma3TextModel with use_bidirectional_attention, the
sentence-transformers pipeline EmbeddingGemma ships (mean pooling, two Dense projections without bias,
Normalize) and its query/document prompts, a byte-level BPE vocabulary trained here wrapping each text in
<bos> … <eos>. Widths are small, the structure is the real one: grouped key/value heads, q/k norms, two
sliding layers (a window of 4 either side) before a full one, GeGLU."""
from __future__ import annotations

import json
from pathlib import Path

import torch

PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}


def tiny_embedding_gemma(path: Path, seed: int = 0, sliding_window: int = 8) -> Path:
    import transformers
    from sentence_transformers.sentence_transformer.modules import Dense
    from tokenizers import processors
    from torch import nn

    from tests.support.tiny_tokenizers import byte_level_tokenizer
    path.mkdir(parents=True, exist_ok=True)
    tok = byte_level_tokenizer("gpt-2", vocab_size=400, specials=("<pad>", "<eos>", "<bos>", "<unk>")).reference
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>", special_tokens=[("<bos>", 2), ("<eos>", 1)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    torch.manual_seed(seed)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=sliding_window, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        use_bidirectional_attention=True, max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = transformers.Gemma3TextModel(cfg).eval()
    with torch.no_grad():  # Gemma's norms start at 0 (a scale of 1 + w): make them random, so a wrong one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
               {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
               {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                               "pooling_mode_mean_tokens": True}))
    for folder, (n_in, n_out) in (("2_Dense", (64, 96)), ("3_Dense", (96, 64))):
        (path / folder).mkdir(exist_ok=True)
        Dense(n_in, n_out, bias=False, activation_function=nn.Identity()).save(str(path / folder))
    (path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": PROMPTS, "default_prompt_name": None}))
    return path


def write_embedding_gemma_gguf(hf_dir: Path, path: Path, qtype: str = "F32") -> Path:
    """The directory as llama.cpp's converter writes EmbeddingGemma (`gemma-embedding`): the norms stored as
    1 + w, the Dense modules' matrices as dense_2 / dense_3 with their feature sizes, mean pooling, the
    checkpoint's sliding_window (512 in the published one); the byte-level vocabulary as `gpt2` (pre-tokenizer
    gpt-2) with <bos> and <eos> added. The sliding layers as a flag per layer (the converter leaves the key out:
    llama.cpp's default, every sixth layer full, is the published model's, not this 3-layer one's). Matrices in
    `qtype` (F32, F16, Q8_0), vectors in F32."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from tests.support.tiny_encoders import write_bpe_vocab
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    a = "gemma-embedding"
    w = gguf.GGUFWriter(str(path), a)
    w.add_name(hf_dir.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    w.add_pooling_type(gguf.PoolingType.MEAN)
    dense = {"dense_2": hf_dir / "2_Dense", "dense_3": hf_dir / "3_Dense"}
    for name, folder in dense.items():
        c = json.loads((folder / "config.json").read_text())
        w.add_dense_features_dims(name, c["in_features"], c["out_features"])
    write_bpe_vocab(w, tok, "gpt-2", {"bos": "<bos>", "eos": "<eos>", "pad": "<pad>", "unk": "<unk>"})
    layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    tensors = {}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        stem = name.removesuffix(".weight")
        if stem == "embed_tokens":
            ours = "token_embd"
        elif stem == "norm":
            ours = "output_norm"
        else:
            _, i, part = stem.split(".", 2)
            ours = f"blk.{i}.{layer[part]}"
        tensors[ours + ".weight"] = t.float() + 1.0 if ours.endswith("norm") else t.float()
    for name, folder in dense.items():
        tensors[name + ".weight"] = load_file(str(folder / "model.safetensors"))["linear.weight"].float()
    for name, t in tensors.items():
        array = t.numpy().astype(np.float32)
        if array.ndim == 2 and qtype != "F32":
            kind = getattr(gguf.GGMLQuantizationType, qtype)
            w.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
