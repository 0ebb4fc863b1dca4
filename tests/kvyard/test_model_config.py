"""ModelConfig from Hugging Face config.json (transformers 4 and 5 layouts) and GGUF metadata: RoPE scaling,
sliding windows, and one clear error naming whatever is not supported (the launcher: one line, exit 2)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from kvyard.model_config import load_model_config
from kvyard.model_path import ModelFileError
from tests.support.procs import REPO

BASE = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 2,
        "intermediate_size": 512, "vocab_size": 100, "max_position_embeddings": 8192}


def hf(tmp_path: Path, **fields: Any) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **fields}))
    return tmp_path


def test_transformers5_rope_parameters(tmp_path: Path) -> None:
    """transformers 5 keeps rope_theta (and the scaling) under rope_parameters: read, not defaulted."""
    c = load_model_config(hf(tmp_path, model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert c.rope_theta == 1e6 and c.rope_scaling is None and c.attention_bias


def test_llama31_rope_scaling(tmp_path: Path) -> None:
    c = load_model_config(hf(tmp_path, rope_theta=500000.0, max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    assert c.rope_scaling is not None and c.rope_scaling.rope_type == "llama3"
    assert c.rope_scaling.original_max_position_embeddings == 8192 and c.max_position_embeddings == 131072


def test_yarn_extends_the_served_context(tmp_path: Path) -> None:
    """Qwen2.5's recipe: a 32K config plus yarn factor 4 serves 128K; the attention factor defaults to
    0.1 ln(factor) + 1 (the old `type` key is read too)."""
    c = load_model_config(hf(tmp_path, model_type="qwen2", max_position_embeddings=32768, rope_theta=1e6,
                             rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}))
    assert c.max_position_embeddings == 131072
    assert c.rope_scaling is not None and abs(c.rope_scaling.attention_factor - (0.1 * np.log(4.0) + 1)) < 1e-12


@pytest.mark.parametrize("fields,match", [
    ({"model_type": "gemma"}, "model_type 'gemma'"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "RoPE type 'longrope'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 3}}, "'linear' with beta_fast"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "needs 'factor'"),
    ({"rope_theta": 10000.0, "rope_parameters": {"rope_theta": 500000.0}}, "disagree"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "o_proj"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
])
def test_unsupported_is_one_clear_error(tmp_path: Path, fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ModelFileError, match=match):
        load_model_config(hf(tmp_path, **fields))


def test_sliding_windows(tmp_path: Path) -> None:
    mistral = load_model_config(hf(tmp_path, model_type="mistral", sliding_window=4096))
    assert [mistral.layer_window(i) for i in range(2)] == [4096, 4096]
    assert load_model_config(hf(tmp_path, model_type="mistral", sliding_window=None)).sliding_window == 0
    # Qwen2: only with use_sliding_window, and from max_window_layers on (or as layer_types say).
    assert load_model_config(hf(tmp_path, model_type="qwen2", sliding_window=4096)).sliding_window == 0
    qwen = load_model_config(hf(tmp_path, model_type="qwen2", use_sliding_window=True, sliding_window=64,
                                max_window_layers=1))
    assert [qwen.layer_window(i) for i in range(2)] == [0, 64]
    typed = load_model_config(hf(tmp_path, model_type="qwen2", use_sliding_window=True, sliding_window=64,
                                 layer_types=["sliding_attention", "full_attention"]))
    assert [typed.layer_window(i) for i in range(2)] == [64, 0]


def gguf_file(path: Path, **keys: Any) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(4096)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_block_count(2)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(100)
    for key, value in keys.items():
        if key == "rope_freqs":
            w.add_tensor("rope_freqs.weight", np.asarray(value, dtype=np.float32))
        else:
            getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_rope_metadata(tmp_path: Path) -> None:
    yarn = load_model_config(gguf_file(tmp_path / "y.gguf", rope_scaling_type=gguf.RopeScalingType.YARN,
                                       rope_scaling_factor=4.0, rope_scaling_orig_ctx_len=4096))
    assert yarn.rope_scaling is not None and yarn.rope_scaling.rope_type == "yarn"
    assert yarn.max_position_embeddings == 16384
    linear = load_model_config(gguf_file(tmp_path / "l.gguf", rope_scaling_type=gguf.RopeScalingType.LINEAR,
                                         rope_scaling_factor=2.0))
    assert linear.rope_scaling is not None and linear.rope_scaling.factor == 2.0
    factors = [1.0] * 16 + [8.0] * 16
    llama31 = load_model_config(gguf_file(tmp_path / "r.gguf", rope_freqs=factors))
    assert llama31.rope_scaling is not None and llama31.rope_scaling.freq_factors == tuple(factors)
    window = load_model_config(gguf_file(tmp_path / "w.gguf", sliding_window=128))
    assert window.sliding_window == 128
    with pytest.raises(ModelFileError, match="'longrope'"):
        load_model_config(gguf_file(tmp_path / "x.gguf", rope_scaling_type=gguf.RopeScalingType.LONGROPE,
                                    rope_scaling_factor=2.0))


def test_gguf_unknown_architecture(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="architecture 'gemma2'"):
        load_model_config(tmp_path / "g.gguf")


def launch_error(env: dict[str, str]) -> str:
    """`python -m kvyard` with env: it must exit with code 2 and one error line, returned."""
    done = subprocess.run([sys.executable, "-m", "kvyard"], env={**os.environ, "START_PORT": "1", "PYTHONPATH": str(REPO),
                                                                  **env},
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("kvyard: error")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    return errors[0]


def test_launcher_refuses_an_unsupported_model_in_one_line(tmp_path: Path) -> None:
    model = hf(tmp_path, rope_scaling={"rope_type": "longrope", "factor": 2.0})
    (model / "tokenizer.json").write_text("{}")
    assert "RoPE type 'longrope'" in launch_error({"CHECKPOINT_PATH": str(model), "FRONTEND_SERVER_COUNT": "0"})


def unknown_pre_tokenizer_gguf(path: Path) -> Path:
    return gguf_file(path, tokenizer_model="gpt2", tokenizer_pre="deepseek-llm", token_list=["a", "b"],
                     token_merges=["a b"])


def test_unsupported_gguf_tokenizer_is_found_before_building_it(tmp_path: Path) -> None:
    from kvyard.tokenizer import TextTokenizer
    TextTokenizer.check_path(gguf_file(tmp_path / "ok.gguf", tokenizer_model="llama"))
    with pytest.raises(ModelFileError, match="pre-tokenizer 'deepseek-llm'"):
        TextTokenizer.check_path(unknown_pre_tokenizer_gguf(tmp_path / "pre.gguf"))
    with pytest.raises(ModelFileError, match="tokenizer model 'rwkv'"):
        TextTokenizer.check_path(gguf_file(tmp_path / "rwkv.gguf", tokenizer_model="rwkv"))
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        TextTokenizer.check_path(tmp_path)


@pytest.mark.parametrize("role", ["PDFUSION", "FRONTEND"])
def test_launcher_refuses_an_unsupported_tokenizer_in_one_line(tmp_path: Path, role: str) -> None:
    """The frontend (and the backend, for its stop ids) would build the tokenizer only once started:
    the launch checks it first instead of a role dying with a traceback."""
    path = unknown_pre_tokenizer_gguf(tmp_path / "m.gguf")
    assert "pre-tokenizer 'deepseek-llm'" in launch_error({"CHECKPOINT_PATH": str(path), "ROLE_TYPE": role})
