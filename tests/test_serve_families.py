"""End to end, as a user runs it: CHECKPOINT_PATH at a tiny random model of each family (a Hugging Face
directory or a GGUF written the way llama.cpp's converter writes one), the real cluster on free loopback
ports, and the official openai client asking for a chat completion.

Each answer is checked against transformers on the same weights and an independently built tokenizer:
the prompt ids are the family's template rendered with plain jinja2 and encoded by the reference
tokenizer; every generated token is transformers' greedy choice (teacher-forced on our tokens, so a
near-tie cannot derail the comparison) with our logprob within the bound of its serving format; the text
is the reference decode; and a request that pushes the model to its end-of-turn token stops there.
The Qwen2 directory is started through scripts/run_local.sh, which is what `make run` runs."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import openai
import pytest
import torch

from tests.support.procs import REPO, RoleProcess, free_port_block
from tests.support.tiny_models import EXACT_TYPES, Q4_K_TYPES, TinyModel, save_hf_dir, tiny_model, write_gguf

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
WINDOW = 16
# Well past the Mistral window and Llama 3.1's original 64 positions once rendered (~100 tokens).
QUESTION = ("The quick brown fox jumps over the lazy dog. Hello world 12345, café naïve 你好，世界 🤖 "
            "def f(x):\n    return x ** 2\n and SELECT * FROM t; it's $100 of 3.14159 things.")
# Logprob bounds: float32 weights and cache (the 2e-3; measured 4e-6..7e-6); GGUF blocks served
# with int16 activations and a float16 KV cache, the defaults on an AVX-512 VNNI CPU (measured 7e-4 and
# 1.3e-3 on 2026-11-24: ~8x that).
DENSE_ATOL, BLOCKS_ATOL = 2e-3, 1e-2
# The K-quant mix on an AVX2 CPU: Q4_K's scale products rounded to float16 and Q6_K requantized to Q8_0 at
# load (measured 0.0105 on 2026-11-26 with float32 activations; random tiny networks amplify weight noise:
# test_model_families.py).
CONVERTED_ATOL = 3e-2


@dataclasses.dataclass(frozen=True)
class Served:
    family: str                      # tiny_model's family
    fmt: str                         # "hf" (directory) or "gguf"
    env: tuple[tuple[str, str], ...] = ()
    via_make_run: bool = False       # started by scripts/run_local.sh rather than `python -m kvyard`
    stop_token: str = ""             # a stop id other than the eos where the family has one
    types: str = "exact"             # the GGUF's tensor types: "exact" (EXACT_TYPES) or "k_mix" (K_MIX_TYPES)
    blocks: str = ""                 # capped cases: the block kinds the server must log that it serves


CASES = {
    "qwen2-hf": Served("qwen2", "hf", via_make_run=True),
    "llama3-hf": Served("llama", "hf", stop_token="<|eom_id|>"),
    "qwen2-gguf": Served("qwen2", "gguf", env=(("MODEL_TYPE", "qwen2.5"),)),
    "llama3-gguf": Served("llama", "gguf", env=(("MODEL_TYPE", "llama3"),), stop_token="<|eom_id|>"),
    "mistral-hf": Served("mistral", "hf"),
    "mistral-gguf": Served("mistral", "gguf", env=(("MODEL_TYPE", "mistral"),)),
    "qwen3-gguf": Served("qwen3", "gguf"),  # the GGUF's own chat template, q/k norms in the fused decode step
    # An AVX2-only CPU's path, taken here by capping the kernels (KVYARD_CPU_ISA): int16 activations on the
    # AVX2 kernels, the K-quant blocks mixed at load (Q4_K to Q4_1, Q6_K's codes widened: Q6_K8), SDPA for
    # attention (beside the Q8_0 the tiny model's rows of fewer than 256 weights take).
    "llama3-gguf-k-avx2": Served("llama", "gguf", env=(("MODEL_TYPE", "llama3"), ("KVYARD_CPU_ISA", "avx2")),
                                 stop_token="<|eom_id|>", types="k_mix", blocks="q4_1/q6_k8/q8_0"),
    # AVX-512 without VNNI (Skylake-SP/X): the K-quant blocks as they are (beside the Q4_1/Q8_0 the tiny
    # model's rows of fewer than 256 weights take, as on a VNNI CPU), vpmaddwd on 512 bits.
    "llama3-gguf-k-avx512": Served("llama", "gguf", env=(("MODEL_TYPE", "llama3"), ("KVYARD_CPU_ISA", "avx512")),
                                   stop_token="<|eom_id|>", types="k_mix", blocks="q4_1/q4_k/q6_k/q8_0"),
}
# Q4_K_M's mix: Q4_K, with Q6_K for the down projection.
K_MIX_TYPES = {**Q4_K_TYPES, "ffn_down": "Q6_K"}
FAMILY_KWARGS: dict[str, dict[str, Any]] = {
    "llama": dict(rope={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 64, "rope_theta": 500000.0}, max_positions=512),
    "qwen2": dict(tie=True, max_positions=512),
    "mistral": dict(sliding_window=WINDOW, max_positions=512),
    "qwen3": dict(max_positions=512),
}


@dataclasses.dataclass
class Server:
    case: Served
    tiny: TinyModel
    client: openai.OpenAI
    model: str                       # the id /v1/models lists


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[TinyModel, dict[str, Path]]]:
    """Each (family, GGUF types) model built once, as a GGUF and then a directory of the same weights (the
    GGUF writer sets the model's weights to what the file holds)."""
    out = {}
    for family, types in sorted({(c.family, c.types) for c in CASES.values()}):
        root = tmp_path_factory.mktemp(f"{family}-{types}")
        tiny = tiny_model(family, **FAMILY_KWARGS[family])
        gguf_path = write_gguf(tiny, root / f"tiny-{family}.gguf", EXACT_TYPES if types == "exact" else K_MIX_TYPES)
        out[family, types] = tiny, {"gguf": gguf_path,
                                    "hf": save_hf_dir(tiny, root / f"tiny-{family}", max_shard_size="400KB")}
    return out


@pytest.fixture(scope="module", params=list(CASES))
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           families: dict[tuple[str, str], tuple[TinyModel, dict[str, Path]]]) -> Iterator[Server]:
    case = CASES[request.param]
    if dict(case.env).get("KVYARD_CPU_ISA") and os.environ.get("DEVICE") == "cuda":  # make test-cuda
        pytest.skip("a capped CPU kernels' path: the backend runs on the GPU here")
    root = tmp_path_factory.mktemp(request.param)
    tiny, paths = families[case.family, case.types]
    path = paths[case.fmt]
    port = free_port_block()
    env = {"CHECKPOINT_PATH": str(path), "START_PORT": str(port), "KV_CACHE_MB": "32", **dict(case.env)}
    argv = None
    if case.via_make_run:
        if not (REPO / ".venv" / "bin" / "python").exists():
            pytest.skip("scripts/run_local.sh runs .venv/bin/python (make setup)")
        argv = ["bash", str(REPO / "scripts" / "run_local.sh")]
    proc = RoleProcess(env, root / "server.log", argv=argv)
    try:
        proc.wait_healthy(f"http://127.0.0.1:{port}/health", timeout_s=180)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        if case.via_make_run:
            proc.wait_for_log(f"kvyard is serving {path.name} on http://127.0.0.1:{port}")
        if isa := dict(case.env).get("KVYARD_CPU_ISA"):  # the capped path is the one that served
            proc.wait_for_log(f"C++ kernels capped at {isa}")
            proc.wait_for_log(f"in GGUF blocks {case.blocks}")
            proc.wait_for_log("KernelOps, int16 activations")
        yield Server(case, tiny, client, client.models.list().data[0].id)
    finally:
        proc.stop()


def reference_prompt(tiny: TinyModel, messages: list[dict[str, str]]) -> tuple[str, list[int]]:
    """The family's template rendered by plain jinja2 and encoded by the reference tokenizer."""
    spec = tiny.tokenizer
    text = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(tiny.chat_template).render(
        messages=messages, add_generation_prompt=True, bos_token=spec.specials.get("bos", ""),
        eos_token=spec.specials.get("eos", ""))
    return text, spec.reference.encode(text, add_special_tokens=False).ids


def chat(server: Server, **extra: Any) -> dict[str, Any]:
    resp = server.client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=MAX_TOKENS,
        logprobs=True, extra_body={"debug_info": True, **extra})
    return resp.to_dict()


def test_chat_matches_transformers(server: Server) -> None:
    tiny, spec = server.tiny, server.tiny.tokenizer
    body = chat(server)
    debug, choice = body["debug_info"], body["choices"][0]
    prompt, want_ids = reference_prompt(tiny, [{"role": "user", "content": QUESTION}])
    assert debug["input_prompt"] == prompt
    assert debug["input_ids"] == want_ids
    if server.case.family == "mistral":
        assert len(want_ids) > 2 * WINDOW   # the window is in play from the first generated token
    out_ids = debug["output_ids"][0]
    assert choice["finish_reason"] == "length" and len(out_ids) == MAX_TOKENS, body
    with torch.inference_mode():
        logits = tiny.hf_model(input_ids=torch.tensor([want_ids + out_ids])).logits[0].float()
    theirs = torch.log_softmax(logits[len(want_ids) - 1:-1], dim=-1)   # [MAX_TOKENS, vocab]
    ours = torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]])
    atol = DENSE_ATOL if server.case.fmt == "hf" else BLOCKS_ATOL if server.case.types == "exact" else CONVERTED_ATOL
    picked = theirs[torch.arange(MAX_TOKENS), torch.tensor(out_ids)]
    assert float((ours - picked).abs().max()) <= atol, (ours, picked)
    # Greedy: each of our tokens is transformers' best, or within the bound of it (a near-tie).
    assert float((theirs.max(dim=-1).values - picked).max()) <= atol
    assert choice["message"]["content"] == spec.reference.decode(out_ids, skip_special_tokens=False)
    if server.case.env:
        assert debug["renderer_info"]["model_type"] == dict(server.case.env)["MODEL_TYPE"]


def test_generation_stops_on_the_end_of_turn_tokens(server: Server) -> None:
    """The model pushed to emit its eos (and Llama 3's <|eom_id|>, a stop id of its own): the answer
    ends there, with finish_reason "stop" and no text; a push towards an ordinary token does not stop."""
    spec = server.tiny.tokenizer
    for token in filter(None, (spec.specials["eos"], server.case.stop_token)):
        body = chat(server, logit_bias={str(spec.id(token)): 100})
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "", (token, body)
        assert body["usage"]["completion_tokens"] == 1
    ordinary = spec.reference.encode(" the", add_special_tokens=False).ids[-1]
    body = chat(server, logit_bias={str(ordinary): 100})
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["debug_info"]["output_ids"][0] == [ordinary] * MAX_TOKENS
