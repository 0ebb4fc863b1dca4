"""A request's timings and cache facts so far, one type on both ends of GenerateStreamCall: the engine builds
it, the frontend shows it as RTP-LLM's `aux_info` (times in ms). Field for field AuxInfoPB, converted at the
gRPC edges only (backend/pb_convert.py, frontend/backend_client.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AuxInfo:
    input_len: int = 0                 # prompt tokens
    output_len: int = 0                # tokens generated so far
    iter_count: int = 0                # engine steps this request took part in so far
    reuse_len: int = 0                 # prompt tokens served from the prefix cache
    cost_time_us: int = 0              # since the backend received the request
    first_token_cost_time_us: int = 0  # from receipt to the first generated token
    wait_time_us: int = 0              # from receipt to its first scheduled step
    kv_transfer_bytes: int = 0         # prefill/decode split: KV bytes sent to the decode backend
    kv_blocks_sent: int = 0            # KV blocks sent
    kv_blocks_skipped: int = 0         # KV blocks the decode backend already held
    kv_transfer_time_us: int = 0       # from opening the hand-over to the decode side's load ack
