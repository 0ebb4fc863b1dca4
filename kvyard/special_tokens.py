"""A tokenizer's special_tokens_map under Hugging Face's names (bos_token, eos_token, unk_token, sep_token,
pad_token, cls_token, mask_token, additional_special_tokens): chat templates get each as a variable, as
transformers' apply_chat_template and RTP-LLM's renderers give them."""
from __future__ import annotations

from typing import Any

from kvyard import gguf_vocab

# Hugging Face's name → the GGUF metadata key's middle part (tokenizer.ggml.<key>_token_id)
_GGUF_KEYS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "sep_token": "separator",
              "pad_token": "padding", "cls_token": "cls", "mask_token": "mask"}
NAMED = tuple(_GGUF_KEYS)


def from_gguf(meta: dict[str, Any], tokens: list[str], control: list[int]) -> dict[str, Any]:
    """The named tokens the GGUF's metadata sets; GGUF keeps no list of additional special tokens, so
    those are its other control tokens (Qwen's <|im_start|>, <|im_end|>, ...)."""
    out: dict[str, Any] = {}
    for name, key in _GGUF_KEYS.items():
        i = gguf_vocab.opt_int(meta.get(f"tokenizer.ggml.{key}_token_id"))
        if i is not None and 0 <= i < len(tokens):
            out[name] = tokens[i]
    named = set(out.values())
    out["additional_special_tokens"] = [tokens[i] for i in control if tokens[i] not in named]
    return out


def from_hf_config(*configs: dict[str, Any]) -> dict[str, Any]:
    """From special_tokens_map.json and tokenizer_config.json (later ones win), where each token is a
    string or a serialized AddedToken ({"content": ...})."""
    out: dict[str, Any] = {}
    for config in configs:
        for name in NAMED:
            token = _content(config.get(name))
            if token is not None:
                out[name] = token
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            out["additional_special_tokens"] = [t for t in map(_content, extra) if t is not None]
    out.setdefault("additional_special_tokens", [])
    return out


def _content(token: Any) -> str | None:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None
