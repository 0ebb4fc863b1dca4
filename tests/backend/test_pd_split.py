"""PREFILL + DECODE roles: same greedy tokens as PDFUSION, block skipping, failures, no leaked KV."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from kvyard.tokenizer import TextTokenizer
from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc
from tests.conftest import Cluster
from tests.support.procs import RoleProcess, free_port_block

pytestmark = pytest.mark.slow

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def pd_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """(decode START_PORT, prefill START_PORT), both serving, always stopped."""
    dport, pport = free_port_block(), free_port_block()
    common = {"KV_CACHE_MB": "128", "TORCH_NUM_THREADS": "1"}
    log_dir = tmp_path_factory.mktemp("pd")
    decode = RoleProcess({**common, "ROLE_TYPE": "DECODE", "START_PORT": str(dport)}, log_dir / "decode.log")
    prefill = RoleProcess({**common, "ROLE_TYPE": "PREFILL", "START_PORT": str(pport),
                           "DECODE_ADDRESS": f"127.0.0.1:{dport + 1}"}, log_dir / "prefill.log")
    try:
        decode.wait_healthy(f"http://127.0.0.1:{dport + 5}/health")
        prefill.wait_healthy(f"http://127.0.0.1:{pport + 5}/health")
        yield dport, pport
    finally:
        prefill.stop()
        decode.stop()


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
                                                               generate_config=cfg, decode_address=decode_address)))


def tokens(outs: list[pb.GenerateOutputsPB]) -> list[int]:
    assert not any(o.HasField("error") for o in outs), outs[-1].error
    return [t for o in outs for g in o.generate_outputs for t in g.output_ids]


def status(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port + 5}/worker_status").json()


def assert_no_leaks(*ports: int) -> None:
    for port in ports:
        for _ in range(40):
            st = status(port)
            if st["running"] == 0 and st["free_blocks"] == st["total_blocks"]:
                break
            time.sleep(0.1)
        assert (st["running"], st["free_blocks"]) == (0, st["total_blocks"]), st


def test_pd_matches_pdfusion_and_skips_held_blocks(pd_pair: tuple[int, int], pdfusion: Cluster,
                                                   tokenizer: TextTokenizer) -> None:
    dport, pport = pd_pair
    ps = prompts(tokenizer)
    reference = [tokens(generate(pdfusion.grpc_address, ids, f"ref{i}")) for i, ids in enumerate(ps)]
    for round_ in ("cold", "warm"):  # warm: the decode side already holds every full prompt block
        for i, ids in enumerate(ps):
            outs = generate(f"127.0.0.1:{pport + 1}", ids, f"{round_}{i}")
            assert tokens(outs) == reference[i], (round_, i)
            aux = outs[-1].generate_outputs[-1].aux_info
            n_blocks, full = -(-len(ids) // 16), len(ids) // 16
            assert aux.output_len == NEW_TOKENS and aux.input_len == len(ids) + 1
            if round_ == "cold" and i == 0:
                assert (aux.kv_blocks_sent, aux.kv_blocks_skipped) == (n_blocks, 0)
            if round_ == "warm":
                assert (aux.kv_blocks_sent, aux.kv_blocks_skipped) == (n_blocks - full, full)
            assert aux.kv_transfer_bytes == aux.kv_blocks_sent * 30 * 2 * 16 * 3 * 64 * 4
    assert_no_leaks(dport, pport)


def test_unreachable_decode_fails_the_request_and_frees_prefill(pd_pair: tuple[int, int],
                                                                tokenizer: TextTokenizer) -> None:
    _, pport = pd_pair
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


def test_decode_dying_mid_stream_reaches_the_client_as_an_error(pd_pair: tuple[int, int],
                                                                tokenizer: TextTokenizer) -> None:
    _, pport = pd_pair
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
        return list(pb_grpc.ModelRpcServiceStub(channel).RemoteDecode(iter(messages)))


def _header(ids: list[int], **overrides: object) -> pb.KVTransferHeaderPB:
    fields = dict(request_id="bad", prompt_ids=ids, first_token=5, block_size=16, num_blocks=-(-len(ids) // 16),
                  dtype="float32", block_shape=[30, 2, 16, 3, 64], first_token_output_len=1,
                  generate_config=pb.GenerateConfigPB(max_new_tokens=4))
    fields.update(overrides)
    return pb.KVTransferHeaderPB(**fields)


@pytest.mark.parametrize("case", ["wrong_size", "missing_block", "unasked_block", "bad_layout", "no_header"])
def test_bad_block_streams_are_rejected(case: str, pd_pair: tuple[int, int]) -> None:
    dport, _ = pd_pair
    ids = list(range(1000, 1040))  # 3 blocks, none cached on the decode side
    block = 30 * 2 * 16 * 3 * 64 * 4
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
