"""LoRA adapters against transformers + PEFT on the same weights: a tiny random Llama (Hugging Face directory
and GGUF blocks) and three random PEFT adapters with different ranks, alphas and targets.

- logits of a cold prefill and of decode steps within 2e-3 (float32), dense PyTorch and GGUF-block kernels;
- a batch mixing the three adapters and the base model gives each row the tokens it gets alone;
- the prefix cache never serves one adapter's (or the base's) KV to another;
- unloading an adapter lets its running requests finish; new ones get MODEL_NOT_FOUND;
- adapter configs computed differently (rsLoRA, DoRA, biases, saved modules...) are refused by name."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from backend import kernels
from backend.attention import KVCache
from backend.engine import Engine, GenerationRequest
from backend.engine_types import ScoreRequest, ScoreResult
from backend.lora import LoraRegistry
from backend.lora_weights import AdapterError, LoraAdapter, load_adapter
from backend.model import LlamaModel
from backend.model_runner import DirectChunk, DirectSeq, ModelRunner
from backend.ops import TorchOps
from backend.scheduler import Scheduler, SchedulerConfig
from backend.sequence import StopConditions
from backend.weights import load_weights
from kvyard.errors import ErrorCode, RequestError
from kvyard.model_config import load_model_config
from kvyard.roles import Role
from kvyard.sampling_params import SamplingParams
from tests.backend.conftest import CPU
from tests.support.tiny_models import EXACT_TYPES, save_hf_dir, tiny_model, write_gguf

peft = pytest.importorskip("peft")

ATOL = 2e-3
ADAPTERS = {  # name → (r, alpha, target modules)
    "attn": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": (4, 12, ["gate_proj", "up_proj", "down_proj"]),
    "all": (16, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def save_adapter(base: Any, path: Path, r: int, alpha: int, targets: list[str], seed: int) -> Any:
    """A PEFT LoRA on a copy of `base` with random A and B (B is zero at init), saved to path; the PEFT model."""
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                                      lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model.eval()
    model.save_pretrained(str(path))
    return model


class Setup:
    def __init__(self, root: Path) -> None:
        self.tiny = tiny_model("llama", layers=2)
        self.gguf = write_gguf(self.tiny, root / "base.gguf", EXACT_TYPES)  # the HF weights become the file's
        self.hf_dir = save_hf_dir(self.tiny, root / "base")
        self.peft: dict[str, Any] = {}
        self.paths: dict[str, Path] = {}
        for seed, (name, (r, alpha, targets)) in enumerate(ADAPTERS.items()):
            self.paths[name] = root / f"lora-{name}"
            self.peft[name] = save_adapter(self.tiny.hf_model, self.paths[name], r, alpha, targets, seed)

    def reference(self, adapter: str | None, ids: list[int]) -> torch.Tensor:
        model = self.tiny.hf_model if adapter is None else self.peft[adapter]
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return Setup(tmp_path_factory.mktemp("lora"))


MODELS = ["hf-dense", "hf-torch-ops", *(["gguf-blocks"] if kernels.load() is not None else [])]


def load_model(setup: Setup, kind: str) -> LlamaModel:
    path = setup.gguf if kind == "gguf-blocks" else setup.hf_dir
    config = load_model_config(path)
    weights = load_weights(path, config, torch.float32, CPU, keep_blocks=kind == "gguf-blocks")
    return LlamaModel(config, weights, ops=TorchOps() if kind == "hf-torch-ops" else None)


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", MODELS)
def test_logits_match_peft(setup: Setup, kind: str) -> None:
    """Each adapter and the base in one batch: a 24-token prefill per row (every position's logits), then
    four decode steps of all rows together; each row against transformers + PEFT alone."""
    model = load_model(setup, kind)
    adapters = {n: load_adapter(n, p, model.config, torch.float32, CPU) for n, p in setup.paths.items()}
    names: list[str | None] = [*ADAPTERS, None]
    bs, n_prompt, steps = 16, 24, 4
    cache = KVCache(model.config.num_layers, 4 * len(names), bs, model.config.num_kv_heads, model.config.head_dim,
                    torch.float32, CPU)
    runner = ModelRunner(model, cache)
    seqs = [DirectSeq(prompt(j, n_prompt + steps, model.config.vocab_size), list(range(4 * j, 4 * j + 4)),
                      () if name is None else (adapters[name],)) for j, name in enumerate(names)]
    prefill = runner.run([DirectChunk(s, 0, n_prompt) for s in seqs], [list(range(n_prompt))] * len(seqs))
    decodes = [runner.run([DirectChunk(s, n_prompt + t, 1) for s in seqs]) for t in range(steps)]
    worst = 0.0
    for j, (name, seq) in enumerate(zip(names, seqs)):
        theirs = setup.reference(name, seq.token_ids)
        ours = torch.cat([prefill[j * n_prompt:(j + 1) * n_prompt], *(d[j:j + 1] for d in decodes)])
        diff = float((ours - theirs).abs().max())
        worst = max(worst, diff)
        assert diff <= ATOL, f"{kind} {name}: max |logit diff| {diff:.2e}"
        if name is not None:  # the adapter changes the answer: the comparison is not vacuous
            assert float((theirs - setup.reference(None, seq.token_ids)).abs().max()) > 0.05
    print(f"{kind}: worst |logit diff| {worst:.1e}")


@pytest.mark.skipif("gguf-blocks" not in MODELS, reason="no C++ kernels here")
def test_fused_decode_step_takes_adapters(setup: Setup) -> None:
    """A decode-only step with adapter rows runs in the fused C++ step (backend/csrc/lora_step.h): its logits
    match the op-by-op path's, seven rows of one adapter in two runs included (more than one row group), and
    its base rows keep the bits of the same step without adapters. (The 200-row prefill groups rows by
    adapter: "all" gathered from two runs, the others as slices.)"""
    model = load_model(setup, "gguf-blocks")
    assert model.fused is not None
    adapters = {n: load_adapter(n, p, model.config, torch.float32, CPU) for n, p in setup.paths.items()}
    names: list[str | None] = ["all"] * 6 + ["attn", None, "mlp", "all"]  # "all": two runs of rows
    cache = KVCache(model.config.num_layers, 2 * len(names), 16, model.config.num_kv_heads, model.config.head_dim,
                    torch.float32, CPU)
    runner = ModelRunner(model, cache)
    seqs = [DirectSeq(prompt(40 + j, 21, model.config.vocab_size), [2 * j, 2 * j + 1],
                      () if name is None else (adapters[name],)) for j, name in enumerate(names)]
    runner.run([DirectChunk(s, 0, 20) for s in seqs])
    step = [DirectChunk(s, 20, 1) for s in seqs]
    model.fused.set_profiling(True)
    fused = runner.run(step)
    assert model.fused.profile()["lora"] > 0  # the adapters' terms ran in the fused step
    kept, model.fused = model.fused, None
    op_by_op = runner.run(step)
    model.fused = kept
    assert float((fused - op_by_op).abs().max()) < 1e-4
    bare = runner.run([DirectChunk(DirectSeq(s.token_ids, s.block_table), 20, 1) for s in seqs])
    assert torch.equal(fused[7], bare[7])  # the base row: the same bits as a step with no adapter at all
    assert not torch.equal(fused[0], bare[0])


def make_engine(model: LlamaModel, registry: LoraRegistry, num_blocks: int = 64) -> Engine:
    c = model.config
    cache = KVCache(c.num_layers, num_blocks, 16, c.num_kv_heads, c.head_dim, torch.float32, CPU)
    scheduler = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=16, max_num_seqs=16,
                                          max_num_batched_tokens=256))
    return Engine(ModelRunner(model, cache), scheduler, c.vocab_size, c.max_position_embeddings, loras=registry)


def request(rid: str, ids: list[int], adapter: str | None, steps: int = 10) -> GenerationRequest:
    return GenerationRequest(rid, ids, SamplingParams(adapter=adapter or ""),
                             StopConditions(max_new_tokens=steps, ignore_eos=True))


def run(engine: Engine, reqs: list[GenerationRequest]) -> dict[str, tuple[list[int], int]]:
    """Greedy to the end: per request, its tokens and the prompt tokens the prefix cache served."""
    for req in reqs:
        engine.validate(req)
        engine.add(req)
    out: dict[str, tuple[list[int], int]] = {req.request_id: ([], 0) for req in reqs}
    while engine.has_work:
        for o in engine.step():
            out[o.request_id][0].append(o.token_id)
            out[o.request_id] = (out[o.request_id][0], o.aux.reuse_len)
    return out


def registry_for(setup: Setup, model: LlamaModel) -> LoraRegistry:
    registry = LoraRegistry(model.config, torch.float32, CPU)
    for name, path in setup.paths.items():
        registry.load(name, str(path))
    return registry


@pytest.mark.parametrize("kind", MODELS)
def test_mixed_batch_gives_each_row_its_alone_answer(setup: Setup, kind: str) -> None:
    model = load_model(setup, kind)
    names: list[str | None] = [*ADAPTERS, None]
    ids = {name: prompt(10 + j, 20, model.config.vocab_size) for j, name in enumerate(names)}
    alone = {}
    for name in names:
        alone[name] = run(make_engine(model, registry_for(setup, model)), [request("r", ids[name], name)])["r"][0]
    together = run(make_engine(model, registry_for(setup, model)),
                   [request(f"r{j}", ids[name], name) for j, name in enumerate(names)])
    for j, name in enumerate(names):
        assert together[f"r{j}"][0] == alone[name], name
    # And each adapter answers differently from the base on its own prompt (the rows are not all base rows).
    base_engine = make_engine(model, registry_for(setup, model))
    base = run(base_engine, [request(f"b{j}", ids[name], None) for j, name in enumerate(names[:-1])])
    assert sum(base[f"b{j}"][0] != alone[name] for j, name in enumerate(names[:-1])) >= 2


def test_prefix_cache_never_shared_across_adapters(setup: Setup) -> None:
    model = load_model(setup, "hf-dense")
    engine = make_engine(model, registry_for(setup, model))
    ids = prompt(3, 40, model.config.vocab_size)
    first = {}
    for name in [None, *ADAPTERS]:  # the same prompt under four weights: never a hit
        out = run(engine, [request(f"{name}", ids, name, steps=3)])[f"{name}"]
        assert out[1] == 0, f"{name} reused another's KV"
        first[name] = out[0]
    for name in ["attn", None]:  # the same again under the same weights: the prefix cache serves it
        out = run(engine, [request(f"again-{name}", ids, name, steps=3)])[f"again-{name}"]
        assert out == (first[name], 32)
    # Reloading a name is a new adapter: its cache starts cold.
    engine.loras.load("attn", str(setup.paths["mlp"]))
    assert run(engine, [request("reloaded", ids, "attn", steps=3)])["reloaded"] == (first["mlp"], 0)


def test_unload_with_requests_in_flight(setup: Setup) -> None:
    model = load_model(setup, "hf-dense")
    engine = make_engine(model, registry_for(setup, model))
    ids = prompt(4, 20, model.config.vocab_size)
    alone = run(make_engine(model, registry_for(setup, model)), [request("a", ids, "all", steps=12)])["a"][0]
    req = request("inflight", ids, "all", steps=12)
    engine.validate(req)
    engine.add(req)
    tokens = [o.token_id for _ in range(3) for o in engine.step()]
    engine.loras.unload("all")
    with pytest.raises(RequestError) as err:
        engine.validate(request("late", ids, "all"))
    assert err.value.code is ErrorCode.MODEL_NOT_FOUND and "'all'" in err.value.message
    while engine.has_work:
        tokens.extend(o.token_id for o in engine.step())
    assert tokens == alone
    with pytest.raises(RequestError) as err:
        engine.loras.unload("all")
    assert err.value.code is ErrorCode.MODEL_NOT_FOUND


def test_scoring_with_an_adapter_matches_peft(setup: Setup) -> None:
    """ScoreCall (prompt logprobs) with an adapter: its logprobs are PEFT's, not the base model's."""
    model = load_model(setup, "hf-dense")
    engine = make_engine(model, registry_for(setup, model))
    ids = prompt(6, 16, model.config.vocab_size)
    scored: dict[str | None, list[float]] = {}
    for name in ["all", None]:
        req = ScoreRequest(f"s-{name}", ids[:4], ids[4:], adapter_name=name or "")
        engine.validate(req)
        engine.add(req)
        results = []
        while engine.has_work:
            results.extend(o for o in engine.step() if isinstance(o, ScoreResult))
        theirs = torch.log_softmax(setup.reference(name, ids), dim=-1)
        want = [float(theirs[p - 1, ids[p]]) for p in range(4, len(ids))]
        scored[name] = [s.logprob for s in results[0].logprobs]
        assert len(scored[name]) == len(want) and max(abs(a - b) for a, b in zip(scored[name], want)) < ATOL, name
    assert max(abs(a - b) for a, b in zip(scored["all"], scored[None])) > 0.05  # the adapter made a difference
    with pytest.raises(RequestError) as err:
        engine.validate(ScoreRequest("s-gone", ids[:4], ids[4:], adapter_name="gone"))
    assert err.value.code is ErrorCode.MODEL_NOT_FOUND


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_prefill_decode_split_refuses_adapters(setup: Setup, role: Role) -> None:
    """The hand-over does not carry adapters: a PREFILL or DECODE backend refuses a request naming one (a
    400 at the frontend), never computes it with the base model."""
    model = load_model(setup, "hf-dense")
    engine = make_engine(model, registry_for(setup, model))
    engine.role = role
    with pytest.raises(RequestError) as err:
        engine.validate(request("pd", prompt(5, 8, model.config.vocab_size), "attn"))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT and "prefill/decode split" in err.value.message
    engine.validate(request("pd-base", prompt(5, 8, model.config.vocab_size), None))  # the base model is served


def test_lru_bound(setup: Setup) -> None:
    model = load_model(setup, "hf-dense")
    registry = LoraRegistry(model.config, torch.float32, CPU, max_adapters=2)
    registry.load("a", str(setup.paths["attn"]))
    registry.load("b", str(setup.paths["mlp"]))
    registry.resolve("a")  # a is now the most recently used
    registry.load("c", str(setup.paths["all"]))
    assert registry.names() == ["a", "c"]


@pytest.mark.parametrize("change,needle", [
    ({"use_rslora": True}, "use_rslora"), ({"use_dora": True}, "use_dora"), ({"bias": "all"}, "bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"), ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"), ({"peft_type": "IA3"}, "IA3"),
    ({"r": 0}, "r must be"), ({"r": 4}, "do not fit r=4"), ({"init_lora_weights": "pissa"}, "PiSSA"),
    ({"init_lora_weights": "olora"}, "init_lora_weights"), ({"init_lora_weights": "loftq"}, "not converted"),
])
def test_refused_configs(setup: Setup, tmp_path: Path, change: dict[str, Any], needle: str) -> None:
    src = setup.paths["attn"]
    dst = tmp_path / "adapter"
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **change}))
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    config = load_model_config(setup.hf_dir)
    with pytest.raises(AdapterError, match=needle):
        load_adapter("x", dst, config, torch.float32, CPU)


def test_registry_paths(setup: Setup, tmp_path: Path) -> None:
    config = load_model_config(setup.hf_dir)
    registry = LoraRegistry(config, torch.float32, CPU, allowed_root=tmp_path)
    for path, needle in [(str(setup.paths["attn"]), "outside LORA_ROOT"), ("s3://bucket/x", "local directory"),
                         (str(tmp_path / "missing"), "not a directory")]:
        with pytest.raises(AdapterError, match=needle):
            registry.load("x", path)
    with pytest.raises(AdapterError, match="name"):
        LoraRegistry(config, torch.float32, CPU).load("a/b", str(setup.paths["attn"]))
    assert isinstance(load_adapter("ok", setup.paths["all"], config, torch.float32, CPU), LoraAdapter)


def test_backend_routes(setup: Setup, tmp_path: Path) -> None:
    """vLLM's load/unload, RTP-LLM's /update (peft_info: the whole set), the list; errors as OpenAI objects."""
    import shutil

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from backend.lora_routes import lora_routes
    from kvyard.http_errors import install_error_handlers

    for name in ADAPTERS:
        shutil.copytree(setup.paths[name], tmp_path / name)
    registry = LoraRegistry(load_model_config(setup.hf_dir), torch.float32, CPU, allowed_root=tmp_path)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(lora_routes(registry))
    http = TestClient(app)
    resp = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path / "attn")})
    assert resp.status_code == 200 and resp.json()["adapter"]["rank"] == 8, resp.text
    resp = http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(setup.paths["mlp"])})
    assert resp.status_code == 400 and "outside LORA_ROOT" in resp.json()["error"]["message"]
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "b"}).status_code == 400
    resp = http.post("/update", json={"peft_info": {"lora_info": {"m": str(tmp_path / "mlp"), "x": str(tmp_path / "all")}}})
    assert resp.status_code == 200 and resp.json()["unloaded"] == ["a"], resp.text
    assert [a["name"] for a in http.get("/v1/lora_adapters").json()["data"]] == ["m", "x"]
    resp = http.post("/update", json={"peft_info": {"lora_info": {"m": str(tmp_path / "mlp")}}})
    assert resp.json() == {"status": "ok", "loaded": [], "unloaded": ["x"]}  # m kept as it was
    for body, key in [({"models_info": {"m": "/x"}}, "models_info"), ({"sampler_info": {"k": 1}}, "sampler_info"),
                      ({"other": 1}, "other"), ({"peft_info": {"lora_info": {"m": 3}}}, "lora_info")]:
        resp = http.post("/update", json=body)
        assert resp.status_code == 400 and key in resp.json()["error"]["message"], resp.text
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "m"}).status_code == 200
    resp = http.post("/v1/unload_lora_adapter", json={"lora_name": "m"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    closed = LoraRegistry(load_model_config(setup.hf_dir), torch.float32, CPU)
    app2 = FastAPI()
    install_error_handlers(app2)
    app2.include_router(lora_routes(closed))
    resp = TestClient(app2).post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path / "attn")})
    assert resp.status_code == 400 and "LORA_ROOT" in resp.json()["error"]["message"]
