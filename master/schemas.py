"""The master's HTTP bodies (RTP-LLM's shapes): strict, so a bad field is a 400 naming it, never a guess."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from master.policy import Candidate, Decision

INT64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
PORT = Annotated[int, Field(ge=1, le=65535)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ScheduleRequest(_Strict):
    """POST /rtp_llm/schedule."""
    model: str = Field(min_length=1)       # the model the client asked for
    block_cache_keys: list[INT64]          # chained keys of the prompt's full blocks (kvyard.block_keys)
    seq_len: int = Field(ge=1)             # prompt tokens
    debug: bool = False                    # also return every candidate's score
    generate_timeout: int = Field(default=0, ge=0)  # ms (0 = none): held no longer than this while all are busy (504)
    request_priority: int = 0              # order among held requests: lower first (then arrival order)
    adapter: str = ""                      # kvyard: the LoRA adapter asked for ("" = the base model)


class RegisterRequest(_Strict):
    """POST /rtp_llm/register: a backend announcing itself (repeated, so a restarted master relearns it)."""
    model: str = Field(min_length=1)
    role: Literal["PDFUSION", "PREFILL", "DECODE", "VIT"] = "PDFUSION"
    server_ip: str = ""                    # "" = the address the registration came from
    grpc_port: PORT
    http_port: PORT


def debug_info(c: Candidate, running: int, step_latency_ms: float) -> dict[str, int]:
    """RTP-LLM's DebugInfo for one backend."""
    return {"running_batch_size": running, "queue_size": c.load - running,
            "waiting_time_ms": round(c.waiting_time_ms), "available_kv_cache_len": c.available_kv_cache_len,
            "estimate_ttft_ms": round(c.estimate_ttft_ms), "estimate_ttot_ms": round(step_latency_ms),
            "hit_cache_len": c.hit_cache_len}


def candidates_view(decision: Decision) -> list[dict[str, Any]]:
    return [{"name": c.name, "hit_cache_len": c.hit_cache_len, "prefill_tokens": c.prefill_tokens,
             "waiting_time_ms": round(c.waiting_time_ms, 2), "estimate_ttft_ms": round(c.estimate_ttft_ms, 2),
             "cost_ms": round(c.cost_ms, 2),
             "available_kv_cache_len": c.available_kv_cache_len, "load": c.load, "skipped": c.skipped,
             "chosen": c.name == decision.chosen} for c in decision.candidates]
