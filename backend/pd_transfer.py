"""Prefill/decode split: the prefill backend hands a request's prompt KV to a decode backend over gRPC.

Prefill side (`prefill_then_hand_over`): run the prompt, send the first token to the client, hold the
prompt's blocks, open RemoteDecode on the decode backend, send the blocks it asks for, free ours on
its "loaded" ack, then relay its tokens. Decode side (`remote_decode`): check the header against our
own cache layout, allocate (prefix hits by block key need no transfer), load the blocks, continue.

Both sides run on the backend's asyncio thread; whatever touches the engine (the held sequence, the
block pool, the KV cache itself) goes to the engine thread as an EngineLoop command, so nothing here
changes engine state in the middle of a step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

import grpc
import torch

from backend.attention import KVCache
from backend.constraints import GrammarCompiler, compile_constraint
from backend.engine import Engine
from backend.engine_loop import EngineLoop
from backend.engine_types import GenerationRequest, ImportPlan, KVLayout, TokenOutput
from backend.pb_convert import handover_request_from_pb, outputs_to_pb
from backend.sequence import FinishReason
from kvyard.cluster_auth import client_interceptors
from kvyard.grpc_keepalive import CLIENT_OPTIONS
from kvyard.errors import ErrorCode, RequestError
from kvyard.pb_errors import error_from_pb, error_to_pb
from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc

HANDOVER_TIMEOUT_S = 30.0  # header → blocks → loaded ack; past it the prefill side frees its copy
BLOCKS_PER_READ = 8  # blocks copied out of the cache per engine command (steps run between them)


# ---- KV blocks as bytes ----------------------------------------------------------------------

def read_block(cache: KVCache, block_id: int) -> bytes:
    bs = cache.block_size
    t = cache.data[:, :, block_id * bs:(block_id + 1) * bs].contiguous().cpu()  # [L, 2, bs, Hkv, d]
    return t.view(torch.uint8).numpy().tobytes()


def write_block(cache: KVCache, block_id: int, data: bytes) -> None:
    bs = cache.block_size
    shape = cache.layout().block_shape
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(cache.data.dtype).view(shape)
    cache.data[:, :, block_id * bs:(block_id + 1) * bs] = t.to(cache.data.device)


# ---- prefill side ----------------------------------------------------------------------------

class DecodeChannels:
    """One gRPC channel per decode backend address, owned by the prefill backend's servicer."""

    def __init__(self, token: str = "") -> None:
        self.token = token  # the cluster token: the decode backend refuses calls without it
        self._stubs: dict[str, pb_grpc.ModelRpcServiceStub] = {}

    def stub(self, address: str) -> pb_grpc.ModelRpcServiceStub:
        if address not in self._stubs:
            channel = grpc.aio.insecure_channel(address, interceptors=client_interceptors(self.token), options=[
                ("grpc.max_send_message_length", 256 * 1024 * 1024),
                ("grpc.max_receive_message_length", 256 * 1024 * 1024), *CLIENT_OPTIONS])
            self._stubs[address] = pb_grpc.ModelRpcServiceStub(channel)
        return self._stubs[address]


async def prefill_then_hand_over(loop: EngineLoop, msg: pb.GenerateInputPB, req: GenerationRequest,
                                 decode: pb_grpc.ModelRpcServiceStub, decode_address: str
                                 ) -> AsyncIterator[pb.GenerateOutputsPB]:
    if req.n > 1:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "n > 1 is not supported with the prefill/decode split", "n")
    prefill = dataclasses.replace(req, stop=dataclasses.replace(req.stop, max_new_tokens=1), hold_blocks=True)
    first: TokenOutput | None = None
    try:
        async for outs in loop.generate(prefill):
            first = outs[0]
        assert first is not None
        prompt_len = len(req.prompt_ids)
        ended = (first.finish_reason is FinishReason.STOP or req.stop.max_new_tokens <= 1
                 or (req.stop.max_total_len is not None and prompt_len + 1 >= req.stop.max_total_len))
        if ended:
            yield outputs_to_pb(req.request_id, [first])
            return
        yield outputs_to_pb(req.request_id, [dataclasses.replace(first, finish_reason=None)])
        async for out in _hand_over(loop, msg, req, first, decode, decode_address):
            yield out
    finally:
        request_id = req.request_id
        loop.post(lambda engine: engine.release(request_id))


@dataclasses.dataclass(frozen=True)
class _Held:
    """What the hand-over needs of the prefill's held sequence, copied on the engine thread."""
    block_table: list[int]
    block_keys: list[int]
    layout: KVLayout


def _held(engine: Engine, request_id: str, prompt_len: int) -> _Held | None:
    seq = engine.held_sequence(request_id)
    if seq is None:
        return None
    layout = engine.runner.cache.layout()
    return _Held(list(seq.block_table), list(seq.block_keys[:prompt_len // layout.block_size]), layout)


async def _hand_over(loop: EngineLoop, msg: pb.GenerateInputPB, req: GenerationRequest, first: TokenOutput,
                     decode: pb_grpc.ModelRpcServiceStub, address: str) -> AsyncIterator[pb.GenerateOutputsPB]:
    request_id, prompt_len = req.request_id, len(req.prompt_ids)
    held = await loop.call(lambda engine: _held(engine, request_id, prompt_len))
    if held is None:
        raise RequestError(ErrorCode.INTERNAL, "the prefill KV was not held for the hand-over")
    layout = held.layout
    n_blocks = -(-prompt_len // layout.block_size)
    header = pb.KVTransferHeaderPB(
        request_id=request_id, prompt_ids=req.prompt_ids, first_token=first.token_id,
        generate_config=msg.generate_config, block_size=layout.block_size, num_blocks=n_blocks,
        block_keys=held.block_keys, dtype=layout.dtype, block_shape=layout.block_shape, first_token_output_len=1,
        image_digests=[im.digest for im in req.images], image_grids=[n for im in req.images for n in im.grid or ()])
    start = time.monotonic()
    call = decode.RemoteDecode()
    sent_bytes = sent = skipped = 0
    try:
        async with asyncio.timeout(HANDOVER_TIMEOUT_S):
            await call.write(pb.KVTransferPB(header=header))
            need = await _expect(call, "need")
            skipped = need.need.skipped
            wanted = list(need.need.indices)
            if any(not 0 <= index < n_blocks for index in wanted):
                raise RequestError(ErrorCode.INTERNAL, f"decode backend asked for blocks {wanted} of {n_blocks}")
            for at in range(0, len(wanted), BLOCKS_PER_READ):
                part = [held.block_table[index] for index in wanted[at:at + BLOCKS_PER_READ]]
                datas = await loop.call(lambda engine, part=part: [read_block(engine.runner.cache, b) for b in part])
                for index, data in zip(wanted[at:at + BLOCKS_PER_READ], datas):
                    sent_bytes += len(data)
                    sent += 1
                    await call.write(pb.KVTransferPB(block=pb.KVBlockPB(index=index, data=data)))
            await call.write(pb.KVTransferPB(done=True))
            await call.done_writing()
            await _expect(call, "loaded")
        loop.post(lambda engine: engine.release(request_id))  # the decode side has its own copy now
        transfer_us = int((time.monotonic() - start) * 1e6)
        while (reply := await call.read()) is not grpc.aio.EOF:
            out = reply.outputs
            if out.HasField("error"):
                raise error_from_pb(out.error)
            for item in out.generate_outputs:
                a = item.aux_info
                a.output_len += 1  # the first token was ours
                a.kv_transfer_bytes, a.kv_blocks_sent, a.kv_blocks_skipped = sent_bytes, sent, skipped
                a.kv_transfer_time_us = transfer_us
            yield out
    except grpc.aio.AioRpcError as exc:
        raise RequestError(ErrorCode.UNAVAILABLE, f"decode backend {address} failed: {exc.code().name}") from exc
    except asyncio.InvalidStateError as exc:
        # A write to a call that already failed (say, connection refused), or, with the cluster token's
        # interceptors, grpc's rendering of *our* cancellation (the client left, or the request timed out)
        # caught while the call was set up. The latter must stay a cancellation: swallowed, this handler
        # would go on holding the prompt's KV, and nothing cancels it a second time.
        if (task := asyncio.current_task()) is not None and task.cancelling():
            raise asyncio.CancelledError from exc
        call.cancel()  # no-op on a finished call; else code() would wait for a status nobody sends
        raise RequestError(ErrorCode.UNAVAILABLE, f"decode backend {address} failed: {(await call.code()).name}"
                           ) from exc
    except TimeoutError as exc:
        raise RequestError(ErrorCode.UNAVAILABLE, f"decode backend {address} did not take the KV in time") from exc
    finally:
        call.cancel()


async def _expect(call: grpc.aio.StreamStreamCall, field: str) -> pb.RemoteDecodeReplyPB:
    reply = await call.read()
    if reply is grpc.aio.EOF:
        raise RequestError(ErrorCode.UNAVAILABLE, "decode backend closed the hand-over")
    if reply.WhichOneof("msg") == "outputs" and reply.outputs.HasField("error"):
        raise error_from_pb(reply.outputs.error)
    if reply.WhichOneof("msg") != field:
        raise RequestError(ErrorCode.INTERNAL, f"decode backend sent {reply.WhichOneof('msg')}, expected {field}")
    return reply


# ---- decode side -----------------------------------------------------------------------------

async def remote_decode(loop: EngineLoop, messages: AsyncIterator[pb.KVTransferPB], eos: frozenset[int],
                        max_model_len: int, grammars: GrammarCompiler | None = None
                        ) -> AsyncIterator[pb.RemoteDecodeReplyPB]:
    request_id = ""
    plan: ImportPlan | None = None
    submitted = False
    try:
        first = await anext(messages, None)
        if first is None or first.WhichOneof("msg") != "header":
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "RemoteDecode must start with a header")
        h = first.header
        request_id = h.request_id
        req, prompt_len = _decode_request(loop, h, eos, max_model_len)
        # A constraint travels in generate_config: our own grammar state, past the first token the prefill
        # side sampled under it, before any step of ours samples the second.
        req.grammar = await compile_constraint(grammars, req.constraint)
        if req.grammar is not None and not req.grammar.advance(h.first_token):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"the prefill side's first token {h.first_token} does "
                               f"not follow the constraint: {req.grammar.error}")
        loop.engine.validate(req)  # pure: reads the engine's fixed limits only; wants the grammar compiled
        plan = await loop.call(lambda engine: engine.plan_import(req, prompt_len),
                               undo=lambda engine, p: p and engine.drop_import(p))
        if plan is None:
            raise RequestError(ErrorCode.OVERLOADED, "no free KV blocks for the hand-over right now")
        yield pb.RemoteDecodeReplyPB(need=pb.BlockRequestPB(indices=plan.need, skipped=plan.skipped))
        blocks = await _receive_blocks(loop.kv_layout, messages, plan)
        targets = plan.seq.block_table
        await loop.call(lambda engine: [write_block(engine.runner.cache, targets[i], data)
                                        for i, data in blocks.items()])
        yield pb.RemoteDecodeReplyPB(loaded=True)
        submitted = True
        async for outs in loop.generate(req, imported=(plan, prompt_len)):
            yield pb.RemoteDecodeReplyPB(outputs=outputs_to_pb(request_id, outs))
    except RequestError as exc:
        yield pb.RemoteDecodeReplyPB(outputs=error_to_pb(request_id, exc))
    finally:
        if plan is not None and not submitted:
            dropped = plan
            loop.post(lambda engine: engine.drop_import(dropped))


def _decode_request(loop: EngineLoop, h: pb.KVTransferHeaderPB, eos: frozenset[int],
                    max_model_len: int) -> tuple[GenerationRequest, int]:
    layout = loop.kv_layout
    bs = layout.block_size
    prompt_len = len(h.prompt_ids)
    problems = []
    if h.block_size != bs:
        problems.append(f"block_size {h.block_size} != {bs}")
    if h.dtype != layout.dtype or tuple(h.block_shape) != layout.block_shape:
        problems.append(f"KV layout {h.dtype}{list(h.block_shape)} != {layout.dtype}{list(layout.block_shape)}")
    if prompt_len == 0 or h.num_blocks != -(-prompt_len // bs):
        problems.append(f"num_blocks {h.num_blocks} does not cover {prompt_len} prompt tokens")
    if problems:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "incompatible hand-over: " + "; ".join(problems))
    return handover_request_from_pb(h, eos, max_model_len), prompt_len


async def _receive_blocks(layout: KVLayout, messages: AsyncIterator[pb.KVTransferPB], plan: ImportPlan
                          ) -> dict[int, bytes]:
    """Every asked block, by prompt block index; anything else (unasked, repeated, wrong size, missing)
    rejects the hand-over. Nothing is written here: the engine thread loads them in one command."""
    expected = layout.block_bytes
    missing = set(plan.need)
    blocks: dict[int, bytes] = {}
    async for m in messages:
        kind = m.WhichOneof("msg")
        if kind == "done":
            break
        if kind != "block":
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"unexpected {kind} in the block stream")
        if m.block.index not in missing or len(m.block.data) != expected:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"bad block {m.block.index} ({len(m.block.data)} bytes, expected {expected})")
        blocks[m.block.index] = m.block.data
        missing.discard(m.block.index)
    if missing:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"partial block stream: blocks {sorted(missing)} never came")
    return blocks
