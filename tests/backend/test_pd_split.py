"""PREFILL + DECODE roles: same greedy tokens as PDFUSION, block skipping, failures, no leaked KV."""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import httpx
import pytest

from kvyard.tokenizer import TextTokenizer
from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc
from tests.conftest import Cluster
from tests.support.procs import RoleProcess, cluster_metadata, free_port_block

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
# One KV block of SmolLM2 on the wire: 30 layers x K,V x 16 tokens x 3 KV heads x 64, in the default CPU
# cache's float16 (KV_CACHE_DTYPE=auto with the C++ kernels).
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 2


@dataclass
class PD:
    decode: int      # START_PORT of the DECODE backend
    prefill: int     # START_PORT of the PREFILL backend (registered with the master, no DECODE_ADDRESS)
    frontend: str    # base URL of a FRONTEND that asks the master for (prefill, decode) pairs
    decode_pid: int = 0  # the DECODE backend's launcher process

    @property
    def decode_grpc(self) -> str:
        return f"127.0.0.1:{self.decode + 1}"


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    mport, dport, pport, fport = (free_port_block() for _ in range(4))
    master = f"127.0.0.1:{mport}"
    common = {"KV_CACHE_MB": "128", "TORCH_NUM_THREADS": "1", "MASTER_ADDRESS": master}
    logs = tmp_path_factory.mktemp("pd")
    procs = [RoleProcess({"ROLE_TYPE": "MASTER", "START_PORT": str(mport)}, logs / "master.log"),
             RoleProcess({**common, "ROLE_TYPE": "DECODE", "START_PORT": str(dport)}, logs / "decode.log"),
             RoleProcess({**common, "ROLE_TYPE": "PREFILL", "START_PORT": str(pport)}, logs / "prefill.log"),
             RoleProcess({"ROLE_TYPE": "FRONTEND", "START_PORT": str(fport), "MASTER_ADDRESS": master,
                          "BACKEND_ADDRESS": f"127.0.0.1:{pport + 1}"}, logs / "frontend.log")]
    try:
        procs[1].wait_healthy(f"http://127.0.0.1:{dport + 5}/health", timeout_s=180)
        procs[2].wait_healthy(f"http://127.0.0.1:{pport + 5}/health", timeout_s=180)
        procs[0].wait_healthy(f"http://{master}/health")  # 200 once a backend has registered
        procs[3].wait_healthy(f"http://127.0.0.1:{fport}/health")
        for _ in range(100):  # both roles registered and polled healthy
            backends = httpx.get(f"http://{master}/backends").json()
            roles = {b["role"] for b in backends["backends"] if b.get("healthy")}
            if {"PREFILL", "DECODE"} <= roles:
                break
            time.sleep(0.1)
        yield PD(dport, pport, f"http://127.0.0.1:{fport}", procs[1].proc.pid)
    finally:
        for proc in reversed(procs):
            proc.stop()


def prompts(tokenizer: TextTokenizer) -> list[list[int]]:
    topics = ["the sea", "mountains", "a robot", "bread", "the moon", "rivers", "music", "trains"]
    return [tokenizer.encode(f"<|im_start|>user\nWrite {i + 1} sentences about {t}, please, in a friendly "
                             f"tone for a child who is {i + 4} years old.<|im_end|>\n<|im_start|>assistant\n",
                             parse_special=True) for i, t in enumerate(topics)]


def generate(address: str, ids: list[int], request_id: str, decode_address: str = "") -> list[pb.GenerateOutputsPB]:
    with grpc.insecure_channel(address) as channel:
        cfg = pb.GenerateConfigPB(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        stub = pb_grpc.ModelRpcServiceStub(channel)
        return list(stub.GenerateStreamCall(pb.GenerateInputPB(request_id=request_id, token_ids=ids,
                                                               generate_config=cfg, decode_address=decode_address),
                                            metadata=cluster_metadata()))


def tokens(outs: list[pb.GenerateOutputsPB]) -> list[int]:
    assert not any(o.HasField("error") for o in outs), outs[-1].error
    return [t for o in outs for g in o.generate_outputs for t in g.output_ids]


def status(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port + 5}/worker_status").json()


def test_chat_through_master_pairs_prefill_with_decode(pd: PD, pdfusion: Cluster) -> None:
    """The whole path: frontend → master (pair) → PREFILL → hand-over → DECODE → tokens back."""
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
            "max_tokens": 20}
    before = status(pd.decode)["iterate_count"]
    split = httpx.post(f"{pd.frontend}/v1/chat/completions", json=body, timeout=60).json()
    fused = httpx.post(f"{pdfusion.base_url}/v1/chat/completions", json=body, timeout=60).json()
    assert split["choices"][0]["message"]["content"] == fused["choices"][0]["message"]["content"]
    assert "Paris" in split["choices"][0]["message"]["content"]
    assert split["usage"] == fused["usage"]
    assert status(pd.decode)["iterate_count"] > before  # the decode backend generated the rest
    with httpx.stream("POST", f"{pd.frontend}/v1/chat/completions", json={**body, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and sum('"finish_reason": "stop"' in ln for ln in lines) == 1
    assert_no_leaks(pd.decode, pd.prefill)


def test_a_prefill_backend_asked_without_a_decode_side_serves_the_request_whole(
        pd: PD, pdfusion: Cluster, tokenizer: TextTokenizer) -> None:
    """While the master is unreachable frontends call every address behind the backends' headless name, PREFILL
    ones included (tests/multihost/): with no decode side named, it prefills and decodes itself."""
    ids = prompts(tokenizer)[1]
    whole = generate(f"127.0.0.1:{pd.prefill + 1}", ids, "whole")
    assert tokens(whole) == tokens(generate(pdfusion.grpc_address, ids, "whole-ref"))
    assert whole[-1].generate_outputs[-1].aux_info.kv_blocks_sent == 0
    assert_no_leaks(pd.prefill)


def test_a_constraint_crosses_the_split(pd: PD, pdfusion: Cluster) -> None:
    """The PREFILL side samples the first token under the grammar, the DECODE side compiles its own state
    and takes it past that token: the same greedy answer as PDFUSION, valid under the schema, sampled too."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"enum": ["France", "Spain", "Italy"]}},
              "required": ["city", "country"], "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
            "max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
    answers = []
    for url, extra in ((pd.frontend, {"temperature": 0}), (pdfusion.base_url, {"temperature": 0}),
                       (pd.frontend, {"temperature": 1.0, "seed": 5}), (pd.frontend, {"temperature": 1.0, "seed": 6})):
        resp = httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert resp.status_code == 200, (url, resp.text)
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        answer = json.loads(choice["message"]["content"])
        assert set(answer) == {"city", "country"} and answer["country"] in ("France", "Spain", "Italy"), answer
        answers.append(choice["message"]["content"])
    assert answers[0] == answers[1]
    done = httpx.post(f"{pd.frontend}/v1/completions", timeout=60, json={
        "prompt": "The year the first man walked on the moon:", "max_tokens": 8, "temperature": 0,
        "guided_regex": " ?[12][0-9]{3}"}).json()["choices"][0]
    assert re.fullmatch(" ?[12][0-9]{3}", done["text"]) and done["finish_reason"] == "stop", done
    assert_no_leaks(pd.decode, pd.prefill)


def assert_no_leaks(*ports: int) -> None:
    for port in ports:
        for _ in range(40):
            st = status(port)
            if st["running"] == 0 and st["free_blocks"] == st["total_blocks"]:
                break
            time.sleep(0.1)
        assert (st["running"], st["free_blocks"]) == (0, st["total_blocks"]), st


def test_pd_matches_pdfusion_and_skips_held_blocks(pd: PD, pdfusion: Cluster, tokenizer: TextTokenizer) -> None:
    dport, pport = pd.decode, pd.prefill
    ps = prompts(tokenizer)
    reference = [tokens(generate(pdfusion.grpc_address, ids, f"ref{i}")) for i, ids in enumerate(ps)]
    for round_ in ("cold", "warm"):  # warm: the decode side already holds every full prompt block
        for i, ids in enumerate(ps):
            outs = generate(f"127.0.0.1:{pport + 1}", ids, f"{round_}{i}", pd.decode_grpc)
            assert tokens(outs) == reference[i], (round_, i)
            aux = outs[-1].generate_outputs[-1].aux_info
            n_blocks, full = -(-len(ids) // 16), len(ids) // 16
            assert aux.output_len == NEW_TOKENS and aux.input_len == len(ids) + 1
            if round_ == "cold" and i == 0:
                assert (aux.kv_blocks_sent, aux.kv_blocks_skipped) == (n_blocks, 0)
            if round_ == "warm":
                assert (aux.kv_blocks_sent, aux.kv_blocks_skipped) == (n_blocks - full, full)
            assert aux.kv_transfer_bytes == aux.kv_blocks_sent * BLOCK_BYTES
    assert_no_leaks(dport, pport)


def test_unreachable_decode_fails_the_request_and_frees_prefill(pd: PD, tokenizer: TextTokenizer) -> None:
    pport = pd.prefill
    dead = f"127.0.0.1:{free_port_block(1)}"
    outs = generate(f"127.0.0.1:{pport + 1}", prompts(tokenizer)[0], "dead-decode", decode_address=dead)
    assert len(tokens(outs[:-1])) == 1  # the first token still came first
    assert outs[-1].error.code == pb.UNAVAILABLE and "decode backend" in outs[-1].error.message
    assert_no_leaks(pport)


class _DyingDecode(pb_grpc.ModelRpcServiceServicer):
    """Takes the KV, acknowledges it, streams two tokens, then dies (aborts the stream)."""

    async def RemoteDecode(self, request_iterator, context):
        header = (await anext(request_iterator)).header
        yield pb.RemoteDecodeReplyPB(need=pb.BlockRequestPB(indices=list(range(header.num_blocks))))
        async for m in request_iterator:
            if m.WhichOneof("msg") == "done":
                break
        yield pb.RemoteDecodeReplyPB(loaded=True)
        for t in (5, 6):
            out = pb.GenerateOutputsPB(request_id=header.request_id)
            out.generate_outputs.add(output_ids=[t])
            yield pb.RemoteDecodeReplyPB(outputs=out)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "decode process died")


def test_decode_dying_mid_stream_reaches_the_client_as_an_error(pd: PD, tokenizer: TextTokenizer) -> None:
    pport = pd.prefill
    port = free_port_block(1)
    loop = asyncio.new_event_loop()

    async def start() -> grpc.aio.Server:
        server = grpc.aio.server()  # created inside the loop that runs it
        pb_grpc.add_ModelRpcServiceServicer_to_server(_DyingDecode(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        outs = generate(f"127.0.0.1:{pport + 1}", prompts(tokenizer)[1], "dies", f"127.0.0.1:{port}")
        assert tokens(outs[:-1])[1:] == [5, 6]
        assert outs[-1].error.code == pb.UNAVAILABLE and "decode backend" in outs[-1].error.message
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
    assert_no_leaks(pport)


def _remote_decode(dport: int, messages: list[pb.KVTransferPB]) -> list[pb.RemoteDecodeReplyPB]:
    with grpc.insecure_channel(f"127.0.0.1:{dport + 1}") as channel:
        return list(pb_grpc.ModelRpcServiceStub(channel).RemoteDecode(iter(messages), metadata=cluster_metadata()))


def _header(ids: list[int], **overrides: object) -> pb.KVTransferHeaderPB:
    fields = dict(request_id="bad", prompt_ids=ids, first_token=5, block_size=16, num_blocks=-(-len(ids) // 16),
                  dtype="float16", block_shape=[30, 2, 16, 3, 64], first_token_output_len=1,
                  generate_config=pb.GenerateConfigPB(max_new_tokens=4))
    fields.update(overrides)
    return pb.KVTransferHeaderPB(**fields)


@pytest.mark.parametrize("case", ["wrong_size", "missing_block", "unasked_block", "bad_layout", "no_header"])
def test_bad_block_streams_are_rejected(case: str, pd: PD) -> None:
    dport = pd.decode
    ids = list(range(1000, 1040))  # 3 blocks, none cached on the decode side
    block = BLOCK_BYTES
    msgs = [pb.KVTransferPB(header=_header(ids))]
    if case == "wrong_size":
        msgs += [pb.KVTransferPB(block=pb.KVBlockPB(index=0, data=b"\0" * (block - 4)))]
    elif case == "missing_block":
        msgs += [pb.KVTransferPB(block=pb.KVBlockPB(index=i, data=b"\0" * block)) for i in (0, 1)]
    elif case == "unasked_block":
        msgs += [pb.KVTransferPB(block=pb.KVBlockPB(index=7, data=b"\0" * block))]
    elif case == "bad_layout":
        msgs = [pb.KVTransferPB(header=_header(ids, block_size=32, num_blocks=2))]
    else:
        msgs = [pb.KVTransferPB(done=True)]
    msgs.append(pb.KVTransferPB(done=True))
    replies = _remote_decode(dport, msgs)
    last = replies[-1]
    assert last.WhichOneof("msg") == "outputs" and last.outputs.error.code == pb.INVALID_ARGUMENT, replies
    assert not any(r.WhichOneof("msg") == "loaded" for r in replies)
    assert_no_leaks(dport)


def _cancel_after_first(address: str, ids: list[int], request_id: str, decode_address: str = "") -> None:
    """A client that leaves after the first streamed message: the request is aborted mid-flight."""
    with grpc.insecure_channel(address) as channel:
        cfg = pb.GenerateConfigPB(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        stream = pb_grpc.ModelRpcServiceStub(channel).GenerateStreamCall(
            pb.GenerateInputPB(request_id=request_id, token_ids=ids, generate_config=cfg,
                               decode_address=decode_address), metadata=cluster_metadata())
        next(stream)
        stream.cancel()


def test_hand_overs_beside_ordinary_requests_and_aborts(pd: PD, pdfusion: Cluster,
                                                        tokenizer: TextTokenizer) -> None:
    """Hand-overs, plain requests on the decode backend and clients that leave mid-stream, all at once: the
    engines' state is only touched on their engine threads, so every answer is its PDFUSION answer and
    every block comes back. (Greedy and float32 activations: a batch computes what a run alone does up
    to the order of float additions, which has never flipped a token of these prompts.)"""
    prefill, decode = f"127.0.0.1:{pd.prefill + 1}", pd.decode_grpc
    ps = prompts(tokenizer)
    reference = [tokens(generate(pdfusion.grpc_address, ids, f"stress-ref{i}")) for i, ids in enumerate(ps)]
    jobs = []
    for round_ in range(3):
        for i, ids in enumerate(ps):
            jobs.append(("pd", i, lambda ids=ids, k=f"s{round_}-pd{i}": generate(prefill, ids, k, decode)))
            jobs.append(("decode", i, lambda ids=ids, k=f"s{round_}-dec{i}": generate(decode, ids, k)))
            jobs.append(("abort", i, lambda ids=ids, k=f"s{round_}-xpd{i}": _cancel_after_first(prefill, ids, k,
                                                                                                 decode)))
            jobs.append(("abort", i, lambda ids=ids, k=f"s{round_}-xdec{i}": _cancel_after_first(decode, ids, k)))
    with ThreadPoolExecutor(max_workers=24) as pool:
        results = list(pool.map(lambda job: (job[0], job[1], job[2]()), jobs))
    answered = 0
    for kind, i, outs in results:
        if kind != "abort":
            assert tokens(outs) == reference[i], (kind, i)
            answered += 1
    assert answered == 3 * 2 * len(ps)
    assert_no_leaks(pd.decode, pd.prefill)


def test_killing_decode_mid_hand_over_answers_or_fails_every_request(pd: PD, tokenizer: TextTokenizer) -> None:
    """Chaos, and last in this module (the DECODE backend stays dead): chats through the master's
    (prefill, decode) pairs, streaming and not, while the DECODE engine is killed with SIGKILL mid-way.
    Every request ends within a bound, each answered in full or failed with an error object (a stream: an
    error chunk then [DONE]); the PREFILL backend keeps no KV; new requests then fail fast, not hang."""
    import os
    import signal

    from tests.support.proc_tree import descendants

    def chat(i: int) -> str:
        body = {"messages": [{"role": "user", "content": f"Tell me about the number {i}."}], "max_tokens": 24,
                "temperature": 0, "stream": i % 2 == 1}
        resp = httpx.post(f"{pd.frontend}/v1/chat/completions", json=body, timeout=60)
        if not body["stream"]:
            if resp.status_code == 200:
                return "answered"
            assert resp.json()["error"]["message"], resp.text
            return "errored"
        events = [line[5:].strip() for line in resp.text.splitlines() if line.startswith("data:")]
        assert resp.status_code != 200 or events[-1] == "[DONE]", resp.text[-500:]  # never cut short
        if resp.status_code != 200 or any('"error"' in e for e in events):
            return "errored"
        return "answered"

    engine = next(pid for pid in descendants(pd.decode_pid)
                  if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read())
    started = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(chat, i) for i in range(18)]
        while sum(f.done() for f in futures) < 3:  # hand-overs are under way
            assert time.monotonic() - started < 120
            time.sleep(0.05)
        os.kill(engine, signal.SIGKILL)
        outcomes = [f.result(timeout=90) for f in futures]
    assert len(outcomes) == 18 and outcomes.count("answered") >= 3, outcomes
    assert_no_leaks(pd.prefill)
    after = time.monotonic()
    assert chat(100) == "errored" and time.monotonic() - after < 30  # no decode: a quick error, no hang

