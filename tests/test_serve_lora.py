"""LoRA adapters end to end, as a user runs them: `kvyard serve` (PDFUSION: frontend + backend) on a tiny random
Llama with an adapter from --lora-modules' variable, run-time loads under LORA_ROOT through the frontend's
vLLM and RTP-LLM routes (behind the API key), requests naming an adapter as `model` or
`extra_configs.adapter_name`, each answer checked against transformers + PEFT's greedy tokens; an unload with a
stream in flight (it finishes; the next request is a 404)."""
from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from websockets.sync.client import connect

from tests.backend.test_lora import save_adapter
from tests.support.procs import RoleProcess, free_port_block
from tests.support.tiny_models import hf_greedy, save_hf_dir, tiny_model

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft")

KEY = "lora-test-key"
STEPS = 8


class Served:
    def __init__(self, root: Path) -> None:
        self.tiny = tiny_model("llama", layers=2)
        self.model_dir = save_hf_dir(self.tiny, root / "base")
        self.lora_root = root / "adapters"
        self.peft = {"attn": save_adapter(self.tiny.hf_model, self.lora_root / "attn", 8, 16,
                                          ["q_proj", "k_proj", "v_proj", "o_proj"], 1),
                     "all": save_adapter(self.tiny.hf_model, self.lora_root / "all", 16, 32,
                                         ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"], 2)}
        self.port = free_port_block()
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        self.ids = torch.randint(10, self.tiny.config.vocab_size, (12,),
                                 generator=torch.Generator().manual_seed(7)).tolist()

    def reference(self, adapter: str | None) -> list[int]:
        return hf_greedy(self.tiny.hf_model if adapter is None else self.peft[adapter], self.ids, STEPS)[0]

    def generate(self, model: str | None = None, max_tokens: int = STEPS, **extra: Any) -> httpx.Response:
        """A greedy completion of the prompt's ids (their ids back as logprob tokens); extra: extra_configs."""
        body = {"prompt": self.ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0,
                "return_tokens_as_token_ids": True, "extra_configs": extra}
        return self.http.post("/v1/completions", json=body if model is None else {**body, "model": model})


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("serve-lora")
    s = Served(root)
    env = {"CHECKPOINT_PATH": str(s.model_dir), "START_PORT": str(s.port), "KV_CACHE_MB": "16", "API_KEY": KEY,
           "LORA_MODULES": f"attn={s.lora_root / 'attn'}", "LORA_ROOT": str(s.lora_root)}
    proc = RoleProcess(env, root / "server.log")
    try:
        proc.wait_healthy(f"{s.url}/health", timeout_s=180)
        yield s
    finally:
        proc.stop()


def peft_prompt_logprobs(served: Served, adapter: str | None) -> list[float]:
    """Each prompt token's logprob after the ones before it, by transformers (+ PEFT with an adapter)."""
    model = served.tiny.hf_model if adapter is None else served.peft[adapter]
    with torch.inference_mode():
        ref = torch.log_softmax(model(input_ids=torch.tensor([served.ids])).logits[0].float(), dim=-1)
    return [float(ref[p - 1, served.ids[p]]) for p in range(1, len(served.ids))]


def output_ids(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return [int(t.removeprefix("token_id:")) for t in resp.json()["choices"][0]["logprobs"]["tokens"]]


def test_models_lists_adapters_with_their_parent(served: Served) -> None:
    data = {m["id"]: m for m in served.http.get("/v1/models").json()["data"]}
    base = next(iter(data))
    assert data["attn"]["parent"] == base and data["attn"]["root"].endswith("attn")


def test_adapter_by_model_or_adapter_name_matches_peft(served: Served) -> None:
    base, attn = served.reference(None), served.reference("attn")
    assert base != attn  # the adapter changes the answer
    assert output_ids(served.generate()) == base
    assert output_ids(served.generate("attn")) == attn
    assert output_ids(served.generate(adapter_name="attn")) == attn
    assert served.generate("attn").json()["model"] == "attn"
    raw = served.http.post("/", json={"prompt": "Hello", "model": "attn", "generate_config": {"max_new_tokens": 2}})
    assert raw.status_code == 200, raw.text
    resp = served.generate("nope")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found", resp.text
    resp = served.generate("attn", adapter_name="all")
    assert resp.status_code == 400 and "adapter_name" in resp.text


def test_render_answers_for_a_held_adapter_and_refuses_others_as_completions_does(served: Served) -> None:
    """/v1/chat/render generates nothing: it asks the paired backend which adapters it holds (it rendered any
    name, a 200, where completions is a 404)."""
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    for body, adapter in (({**chat, "model": "attn"}, "attn"), ({**chat, "extra_configs": {"adapter_name": "attn"}},
                                                                "attn"), (chat, "")):
        resp = served.http.post("/v1/chat/render", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["generate_config"]["adapter"] == adapter
    for body in ({**chat, "model": "nope"}, {**chat, "extra_configs": {"adapter_name": "nope"}}):
        for path in ("/v1/chat/render", "/v1/chat/completions"):
            resp = served.http.post(path, json=body)
            assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found", (path, resp.text)


def test_prompt_logprobs_with_an_adapter(served: Served) -> None:
    """Prompt logprobs (the backend's ScoreCall) with an adapter named by model or extra_configs: PEFT's."""
    def prompt_logprobs(model: str | None = None, **extra: Any) -> list[float]:
        body = {"prompt": served.ids, "max_tokens": 1, "prompt_logprobs": 0, "extra_configs": extra}
        resp = served.http.post("/v1/completions", json=body if model is None else {**body, "model": model})
        assert resp.status_code == 200, resp.text
        entries = resp.json()["choices"][0]["prompt_logprobs"]
        return [e[str(t)]["logprob"] for e, t in zip(entries[1:], served.ids[1:])]

    got = {"by model": prompt_logprobs("attn"), "adapter_name": prompt_logprobs(adapter_name="attn"),
           "base": prompt_logprobs()}
    for how, lps in got.items():
        want = peft_prompt_logprobs(served, None if how == "base" else "attn")
        assert len(lps) == len(want) and max(abs(a - b) for a, b in zip(lps, want)) < 2e-3, how
    assert max(abs(a - b) for a, b in zip(got["by model"], got["base"])) > 0.05


def test_lmtp_generate_and_score_with_an_adapter(served: Served) -> None:
    """LMTP (LMQL's WebSocket protocol) names an adapter as its model, as the HTTP dialects do: GENERATE gives
    PEFT's greedy tokens, SCORE PEFT's logprobs, MODEL_INFO answers for it; an unknown name is a stream's
    model_not_found error item."""
    frames = [("GENERATE", {"model": "attn", "prompt": served.ids, "stream_id": 1, "max_tokens": STEPS,
                            "temperature": 0}),
              ("SCORE", {"model": "attn", "prompt": served.ids[:1], "scored": served.ids[1:], "stream_id": 2}),
              ("SCORE", {"model": "nope", "prompt": served.ids[:1], "scored": served.ids[1:], "stream_id": 3}),
              ("MODEL_INFO", {"model": "attn", "stream_id": 4})]
    items: dict[int, list[dict[str, Any]]] = {1: [], 2: [], 3: [], 4: []}
    with connect(f"ws://127.0.0.1:{served.port}/lmtp?api_key={KEY}", open_timeout=30) as ws:
        for command, payload in frames:
            ws.send(f"{command} {json.dumps(payload)}")
        while not all(i and ("error" in i[-1] or i[-1].get("finish_reason") or "model_info" in i[-1])
                      for i in items.values()):
            for item in json.loads(ws.recv(timeout=60).partition(" ")[2]):
                items[item["stream_id"]].append(item)
    tokens, want = [i["token"] for i in items[1]], served.reference("attn")
    assert want != served.reference(None) and items[1][-1]["finish_reason"] in ("length", "stop"), items[1]
    assert tokens == want[:len(tokens)] and (len(tokens) == STEPS or items[1][-1]["finish_reason"] == "stop")
    lps = [i["logprob"] for i in items[2]]
    want_lps = peft_prompt_logprobs(served, "attn")
    assert len(lps) == len(want_lps) and max(abs(a - b) for a, b in zip(lps, want_lps)) < 2e-3, items[2]
    assert len(items[3]) == 1 and "model_not_found" in items[3][0]["error"], items[3]
    assert items[4][0]["model_info"]["model"] == "attn", items[4]


def test_bad_adapters_and_bodies_are_400s_that_change_nothing(served: Served) -> None:
    """Each of these was accepted or a 500 before: an adapter whose lora_alpha or weights are NaN loaded
    and then failed every request naming it (500 at sampling); a NUL in lora_path was a 500; unknown
    fields were ignored; an /update whose third adapter could not be read left the first two loaded and
    answered 400; an adapter named as the base model loaded out of reach."""
    from safetensors.torch import load_file, save_file
    attn = served.lora_root / "attn"
    nan_alpha, nan_weights = served.lora_root / "nan-alpha", served.lora_root / "nan-weights"
    for bad in (nan_alpha, nan_weights):
        shutil.copytree(attn, bad)
    config = json.loads((attn / "adapter_config.json").read_text())
    (nan_alpha / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": float("nan")}))
    tensors = load_file(str(attn / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    save_file(tensors, str(nan_weights / "adapter_model.safetensors"))
    before = served.http.get("/v1/lora_adapters").json()["data"]
    base = served.http.get("/v1/models").json()["data"][0]["id"]

    def refused(path: str, body: dict[str, Any], needle: str, param: str | None = None) -> None:
        resp = served.http.post(path, json=body)
        assert resp.status_code == 400 and needle in resp.json()["error"]["message"], resp.text
        assert param is None or resp.json()["error"]["param"] == param, resp.text

    refused("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(nan_alpha)}, "lora_alpha must be a positive finite")
    refused("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(nan_weights)}, "NaN or infinite")
    refused("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": f"{attn}\x00"}, "is not a directory")
    refused("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(attn), "base_model_name": "m"},
            "Unrecognized request argument", "base_model_name")
    refused("/v1/load_lora_adapter", {"lora_name": "attn", "lora_path": str(attn), "load_inplace": False},
            "already loaded", "load_inplace")
    refused("/v1/load_lora_adapter", {"lora_name": base, "lora_path": str(attn)}, "is a model served here")
    refused("/v1/unload_lora_adapter", {"lora_name": "attn", "lora_int_id": 1}, "Unrecognized request argument",
            "lora_int_id")
    wanted = {"fresh": str(served.lora_root / "all"), "broken": str(nan_alpha)}
    refused("/update", {"peft_info": {"lora_info": wanted}}, "nothing was changed")
    refused("/update", {"peft_info": {"lora_info": {"attn": f"{attn}\x00"}}}, "is not a directory")
    assert served.http.get("/v1/lora_adapters").json()["data"] == before
    resp = served.http.post("/v1/load_lora_adapter", json={"lora_name": "attn", "lora_path": str(attn),
                                                           "load_inplace": True})
    assert resp.status_code == 200, resp.text
    assert output_ids(served.generate("attn")) == served.reference("attn")


def test_run_time_load_unload_and_update(served: Served) -> None:
    open_http = httpx.Client(base_url=served.url, timeout=30)
    body = {"lora_name": "all", "lora_path": str(served.lora_root / "all")}
    assert open_http.post("/v1/load_lora_adapter", json=body).status_code == 401  # the API key guards it
    resp = served.http.post("/v1/load_lora_adapter", json=body)
    assert resp.status_code == 200 and resp.json()["adapter"]["rank"] == 16, resp.text
    assert output_ids(served.generate("all")) == served.reference("all")
    outside = served.lora_root.parent / "elsewhere"
    shutil.copytree(served.lora_root / "all", outside)
    resp = served.http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(outside)})
    assert resp.status_code == 400 and "LORA_ROOT" in resp.json()["error"]["message"]
    for key in ("models_info", "sampler_info"):
        resp = served.http.post("/update", json={key: {"a": "b"}})
        assert resp.status_code == 400 and key in resp.json()["error"]["message"], resp.text
    resp = served.http.post("/update_eplb_config", json={"mode": "ALL"})
    assert resp.status_code == 400 and "mixture-of-experts" in resp.text
    # RTP-LLM's peft_info: the whole set. "all" stays, "attn" goes, "again" comes.
    lora_info = {"all": str(served.lora_root / "all"), "again": str(served.lora_root / "attn")}
    resp = served.http.post("/update", json={"peft_info": {"lora_info": lora_info}})
    assert resp.status_code == 200 and resp.json()["unloaded"] == ["attn"], resp.text
    assert served.generate("attn").status_code == 404
    assert output_ids(served.generate("again")) == served.reference("attn")
    served.http.post("/update", json={"peft_info": {"lora_info": {"attn": str(served.lora_root / "attn")}}})


def test_unload_with_a_stream_in_flight(served: Served) -> None:
    steps = 160
    want = hf_greedy(served.peft["attn"], served.ids, steps)[0]
    done: dict[str, Any] = {}

    def long_request() -> None:
        done["resp"] = served.generate("attn", max_tokens=steps)

    thread = threading.Thread(target=long_request)
    thread.start()
    while not served.http.get("/worker_status").json().get("running_task_info"):
        assert "resp" not in done, "the request finished before it was seen running"
        time.sleep(0.01)
    resp = served.http.post("/v1/unload_lora_adapter", json={"lora_name": "attn"})
    assert resp.status_code == 200, resp.text
    thread.join(timeout=120)
    assert output_ids(done["resp"]) == want  # it finished, with the adapter's weights
    resp = served.generate("attn")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    resp = served.http.post("/v1/unload_lora_adapter", json={"lora_name": "attn"})
    assert resp.status_code == 404
