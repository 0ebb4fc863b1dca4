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
