"""Master routing policy: (request, backend loads) → the backend with the lowest estimated cost. Pure.

Interface: `choose_backend(RouteRequest, [BackendLoad, ...], PolicyConfig) -> Decision`; the gateway's,
for servers that report nothing (`ServerLoad`: only what it sent them), is `choose_server`. No I/O, no clock, no state: the caller owns the backend view (polled status, cache keys,
what it routed since) and records the choice. BackendLoad fields the caller does not track keep their
defaults, which turn their term off (no pending or recent keys: no cost for them).

For every healthy backend serving the model:

    hit            = longest leading run of the request's block keys the backend holds × block_size,
                     capped at seq_len − 1 (the last prompt token is always computed)
    prefill        = seq_len − hit
    rate           = the backend's measured prefill tokens/s; until it has measured one, the mean of
                     the measured rates of the model's other backends (the configured default if none)
    waiting_ms     = (queued_prefill_tokens + prefill tokens routed to it since its last poll) / rate
    ttft_ms        = waiting_ms + prefill / rate

(No term for the step in flight: the reported step latency averages prefill and decode steps, so it
is noise next to the prefill terms, and a status up to one poll old may still show a finished request
running. Decode-heavy load is the imbalance guard's job.)

    copy_ms        = (best hit among the backends − hit) / rate × stickiness
    added          = prompt tokens whose blocks are not in the backend's working set (recent_keys: blocks
                     of prompts routed to it lately)
    evict_ms       = min(added, working set + added − KV pool) / rate × stickiness   (0 when it fits)
    cost_ms        = ttft_ms + copy_ms + evict_ms

Both terms price what a greedy TTFT misses under KV pressure: what a placement costs later requests.
copy_ms: computing here a prefix another backend already holds makes a second copy, and in a full cache
that copy evicts some other prefix, whose next request pays a whole prefill. evict_ms: a prefix new to a
backend whose working set already fills its pool pushes out a prefix it will be asked for again. The
working set also remembers a prefix's home after the backend evicted it: measured on the shared-prefix
benchmark (12 system prompts, two backends that hold ~5 each) with copy_ms alone, 5 of the 12 prompts,
once evicted, were recomputed on the other backend because its queue was shorter at that instant; 12
prompts got 17 homes and thrashed both caches. So a prefix stays with its backend until that backend's
queue costs more than recomputing the prefix `1 + stickiness` times elsewhere, and a prompt cached
nowhere goes to its old home, or to a backend with room in its working set, unless another starts it
much sooner. A caller that does not track working sets leaves recent_keys empty: evict_ms is then 0.

Backends whose free KV cannot hold the prefill, or whose queue is at the limit, are skipped. If the
remaining pool is badly imbalanced (SGLang's guard: max_load − min_load > imbalance_abs and
max_load > imbalance_ratio × min_load, load = running + waiting + routed since the poll), the least
loaded backend wins whatever the cache says. Otherwise the lowest cost wins; candidates within
tie_ratio of it count as tied and the least recently chosen of them wins (RTP-LLM), which spreads a
burst of identical-looking requests instead of piling them on one backend.

Prefill/decode split: the above picks among PREFILL and PDFUSION backends alike (a pool being moved from
one to the other holds both, and each can start any request); when it picks a PREFILL one, a DECODE
backend is paired by KV room and load (`choose_decode`): skip the unhealthy and those without free KV
for the whole prompt, then the lowest load, then the lowest KV usage. With no DECODE room a PDFUSION
backend takes the request whole, if there is one. DECODE backends are first choice only when nothing
else serves the model.
"""
from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass, field, replace

from kvyard.errors import ErrorCode
from kvyard.roles import Role

# Why a backend was not a candidate (Candidate.skipped).
SKIP_UNHEALTHY = "unhealthy"
SKIP_KV_FULL = "kv_full"          # not enough free KV blocks right now
SKIP_TOO_LONG = "too_long"        # the prompt can never fit its KV pool
SKIP_QUEUE_FULL = "queue_full"    # waiting queue at max_waiting


@dataclass(frozen=True)
class PolicyConfig:
    default_prefill_tokens_per_s: float = 2000.0  # assumed while no backend of the model has measured its rate
    max_waiting: int = 64          # a backend with this many queued sequences takes no more
    imbalance_abs: int = 8         # imbalance guard: max_load − min_load must exceed this ...
    imbalance_ratio: float = 1.5   # ... and max_load must exceed ratio × min_load
    tie_ratio: float = 0.05        # costs within 5 % of the best count as tied
    stickiness: float = 1.0        # extra cost, in prefill time, of recomputing tokens another backend caches
                                   # or of evicting tokens of its working set


@dataclass(frozen=True)
class RouteRequest:
    """What the frontend tells the master about one request (POST /rtp_llm/schedule)."""
    model: str
    block_cache_keys: Sequence[int]  # chained keys of the prompt's full blocks (kvyard.block_keys)
    seq_len: int                     # prompt tokens
    adapter: str = ""                # a LoRA adapter of the model ("" = the base model): only backends holding it


@dataclass(frozen=True)
class BackendLoad:
    """One backend as the policy sees it: its last polled status plus what was routed since."""
    name: str                        # "host:grpc_port", unique
    model: str                       # the model it serves
    healthy: bool                    # answered a sane status within the expiry window
    role: Role = Role.PDFUSION       # PDFUSION, PREFILL or DECODE
    running: int = 0                 # sequences holding KV blocks
    waiting: int = 0                 # sequences queued
    queued_prefill_tokens: int = 0   # prompt tokens still to compute
    step_latency_ms: float = 0.0     # recent engine step time
    prefill_tokens_per_s: float = 0.0  # measured prefill throughput (0 = not measured yet)
    free_blocks: int = 0             # free KV blocks (cached-but-unreferenced count as free)
    total_blocks: int = 0            # KV blocks in its pool
    block_size: int = 16             # tokens per block
    cached_keys: Set[int] = field(default_factory=frozenset)   # block keys from its last cache poll
    pending_keys: Set[int] = field(default_factory=frozenset)  # keys of prompts just routed to it
    recent_keys: Set[int] = field(default_factory=frozenset)   # working set: keys of prompts routed to it
                                                               # lately (the registry's window), cached or not
    routed_requests: int = 0         # requests routed to it since its last poll
    routed_prefill_tokens: int = 0   # their prefill tokens
    routed_kv_tokens: int = 0        # KV tokens they will take
    last_chosen: float = 0.0         # when the policy last picked it (monotonic seconds; 0 = never)
    kv_reported: bool = True         # False: its KV pool is unknown (a ServerLoad), so no KV check or eviction cost
    adapters: Set[str] = field(default_factory=frozenset)  # LoRA adapters it holds

    @property
    def load(self) -> int:
        return self.running + self.waiting + self.routed_requests


@dataclass(frozen=True)
class ServerLoad:
    """A server that reports nothing to its router (the gateway's upstreams: any OpenAI-compatible server),
    known only by what the router sent it. Its KV pool is unknown, so no KV check or eviction cost applies;
    its prefill rate is unknown, so every server is assumed equally fast and costs compare queued work.
    Sizes are in the router's own unit, the same for the prompt, the queue and a prefix block (the
    gateway: bytes of the request's text)."""
    name: str                        # unique (the gateway: the upstream's URL)
    model: str                       # the model asked for, which it serves
    in_flight: int                   # requests sent there and not finished: its queue
    queued_work: int                 # uncached prompt size of those still to be answered
    block_size: int                  # prompt size one prefix key covers
    cached_keys: Set[int] = field(default_factory=frozenset)  # keys of prompts sent there (its likely cache)
    last_chosen: float = 0.0         # when it was last picked (monotonic seconds; 0 = never)


@dataclass(frozen=True)
class Candidate:
    """One backend's score for one request; the master returns them all when asked to debug."""
    name: str
    hit_cache_len: int               # prompt tokens its prefix cache would serve
    prefill_tokens: int              # tokens left to compute there
    waiting_time_ms: float           # queue ahead of the request
    estimate_ttft_ms: float          # waiting + own prefill
    cost_ms: float                   # estimate_ttft_ms + copy_ms + evict_ms (see the module doc)
    available_kv_cache_len: int      # free KV tokens after what was routed since the poll
    load: int                        # running + waiting + routed since the poll
    skipped: str | None = None       # why it cannot take the request (SKIP_*), None = eligible


@dataclass(frozen=True)
class Decision:
    chosen: str | None               # the backend's name, None when nothing can take the request
    reason: str                      # "prefix_hit", "shortest_ttft", "imbalance" or why none
    candidates: list[Candidate]      # every backend serving the model, in input order
    error: ErrorCode | None = None   # set when chosen is None
    message: str = ""                # for humans, with the error
    decode: str | None = None        # prefill/decode split: the DECODE backend paired with `chosen`

    def candidate(self, name: str) -> Candidate:
        return next(c for c in self.candidates if c.name == name)


def cache_local(decision: Decision) -> int:
    """RTP-LLM's ScheduleMeta.cache_local: 0 (LOCAL) when the chosen backend holds as much of the prompt's
    prefix as any candidate (or none holds any), 1 (REMOTE) when another backend holds more of it."""
    assert decision.chosen is not None
    best = max((c.hit_cache_len for c in decision.candidates), default=0)
    return 0 if decision.candidate(decision.chosen).hit_cache_len >= best else 1


def hit_tokens(keys: Sequence[int], backend: BackendLoad, seq_len: int) -> int:
    """Prompt tokens served by the backend's cache: the leading run of keys it holds, never the last token."""
    run = 0
    for key in keys:
        if key not in backend.cached_keys and key not in backend.pending_keys:
            break
        run += 1
    return max(0, min(run * backend.block_size, seq_len - 1))


def evicted_tokens(request: RouteRequest, b: BackendLoad) -> int:
    """Tokens of the backend's working set this prompt would push out of its KV pool: the prompt's part
    new to the working set, as far as the working set plus that part overflows the pool."""
    if not b.kv_reported:
        return 0
    added = sum(1 for key in request.block_cache_keys if key not in b.recent_keys) * b.block_size
    overflow = (len(b.recent_keys) * b.block_size + added) - b.total_blocks * b.block_size
    return max(0, min(added, overflow))


def score(request: RouteRequest, b: BackendLoad, hit: int, best_hit: int, default_rate: float,
          cfg: PolicyConfig) -> Candidate:
    prefill = request.seq_len - hit
    rate = b.prefill_tokens_per_s if b.prefill_tokens_per_s > 0 else default_rate
    waiting_ms = (b.queued_prefill_tokens + b.routed_prefill_tokens) / rate * 1000.0
    ttft_ms = waiting_ms + prefill / rate * 1000.0
    copy_ms = (best_hit - hit) / rate * 1000.0 * cfg.stickiness
    evict_ms = evicted_tokens(request, b) / rate * 1000.0 * cfg.stickiness
    available = b.free_blocks * b.block_size - b.routed_kv_tokens
    skipped = None
    if not b.healthy:
        skipped = SKIP_UNHEALTHY
    elif b.kv_reported and request.seq_len > b.total_blocks * b.block_size:
        skipped = SKIP_TOO_LONG
    elif b.kv_reported and prefill > available:
        skipped = SKIP_KV_FULL
    elif b.waiting >= cfg.max_waiting:
        skipped = SKIP_QUEUE_FULL
    return Candidate(b.name, hit, prefill, waiting_ms, ttft_ms, ttft_ms + copy_ms + evict_ms, available, b.load, skipped)


def choose_backend(request: RouteRequest, backends: Sequence[BackendLoad],
                   cfg: PolicyConfig = PolicyConfig()) -> Decision:
    backends = [b for b in backends if b.role != Role.VIT]  # a VIT embeds images for backends; it generates nothing
    serving = [b for b in backends if b.model == request.model]
    if not backends:
        return Decision(None, "no_backends", [], ErrorCode.UNAVAILABLE, "no backend has registered yet")
    if not serving:
        models = sorted({b.model for b in backends})
        return Decision(None, "unknown_model", [], ErrorCode.MODEL_NOT_FOUND,
                        f"The model '{request.model}' does not exist; this cluster serves: {', '.join(models)}")
    if request.adapter:
        serving = [b for b in serving if request.adapter in b.adapters]
        if not serving:
            return Decision(None, "unknown_adapter", [], ErrorCode.MODEL_NOT_FOUND,
                            f"The model '{request.adapter}' does not exist: no backend of '{request.model}' holds a "
                            "LoRA adapter of that name")
    first = [b for b in serving if b.role != Role.DECODE] or serving
    decision = _choose_first_stage(request, first, cfg)
    roles = {b.name: b.role for b in first}
    if decision.chosen is None or roles[decision.chosen] != Role.PREFILL:
        return decision
    decode = choose_decode(request, [b for b in serving if b.role == Role.DECODE])
    if decode is not None:
        return replace(decision, decode=decode)
    fused = [b for b in first if b.role == Role.PDFUSION]
    if fused:  # no DECODE room, but a PDFUSION backend can take the whole request
        return _choose_first_stage(request, fused, cfg)
    return Decision(None, "no_decode", decision.candidates, ErrorCode.OVERLOADED,
                    f"no DECODE backend of '{request.model}' is healthy with KV room for "
                    f"{request.seq_len} tokens; retry shortly")


def choose_server(model: str, keys: Sequence[int], size: int, servers: Sequence[ServerLoad],
                  cfg: PolicyConfig = PolicyConfig()) -> Decision:
    """choose_backend over servers known only by what was sent to them: the same cost (the prompt's
    uncached size plus the queued work ahead of it, the prefix stickiness, the imbalance guard, the ties),
    in the caller's unit. `size`: the prompt's (at least 1); `keys`: its prefix keys, block_size each."""
    loads = [BackendLoad(name=s.name, model=s.model, healthy=True, waiting=s.in_flight,
                         queued_prefill_tokens=s.queued_work, block_size=s.block_size, cached_keys=s.cached_keys,
                         last_chosen=s.last_chosen, kv_reported=False) for s in servers]
    return choose_backend(RouteRequest(model, keys, max(1, size)), loads, cfg)


def choose_decode(request: RouteRequest, decoders: Sequence[BackendLoad]) -> str | None:
    """The DECODE backend for a hand-over: KV room for the whole prompt, then least loaded, then
    least KV used (RTP-LLM's decode choice, made deterministic)."""
    def room(b: BackendLoad) -> int:
        return b.free_blocks * b.block_size - b.routed_kv_tokens

    eligible = [b for b in decoders if b.healthy and room(b) > request.seq_len]
    if not eligible:
        return None
    return min(eligible, key=lambda b: (b.load, 1 - b.free_blocks / max(1, b.total_blocks), b.name)).name


def _choose_first_stage(request: RouteRequest, serving: Sequence[BackendLoad], cfg: PolicyConfig) -> Decision:
    measured = [b.prefill_tokens_per_s for b in serving if b.prefill_tokens_per_s > 0]
    default_rate = sum(measured) / len(measured) if measured else cfg.default_prefill_tokens_per_s
    hits = [hit_tokens(request.block_cache_keys, b, request.seq_len) for b in serving]
    # The copy cost counts only hits a backend could serve now (healthy), else a dead one would hold its
    # prefixes hostage.
    best_hit = max((h for h, b in zip(hits, serving) if b.healthy), default=0)
    candidates = [score(request, b, h, best_hit, default_rate, cfg) for b, h in zip(serving, hits)]
    by_name = {b.name: b for b in serving}
    eligible = [c for c in candidates if c.skipped is None]
    if not eligible:
        return _none_eligible(request, candidates)

    loads = [c.load for c in eligible]
    if max(loads) - min(loads) > cfg.imbalance_abs and max(loads) > cfg.imbalance_ratio * min(loads):
        least = min(loads)
        tied = [c for c in eligible if c.load == least]
        return Decision(_least_recent(tied, by_name), "imbalance", candidates)

    best = min(c.cost_ms for c in eligible)
    tied = [c for c in eligible if c.cost_ms <= best * (1 + cfg.tie_ratio)]
    chosen = _least_recent(tied, by_name)
    hit = next(c.hit_cache_len for c in tied if c.name == chosen)
    return Decision(chosen, "prefix_hit" if hit > 0 else "shortest_ttft", candidates)


def _least_recent(tied: list[Candidate], by_name: dict[str, BackendLoad]) -> str:
    # Among equals, the longest-unused backend; then the longer cache hit; then the name, for determinism.
    return min(tied, key=lambda c: (by_name[c.name].last_chosen, -c.hit_cache_len, c.name)).name


def _none_eligible(request: RouteRequest, candidates: list[Candidate]) -> Decision:
    reasons = {c.skipped for c in candidates}
    if reasons == {SKIP_UNHEALTHY}:
        return Decision(None, "all_unhealthy", candidates, ErrorCode.UNAVAILABLE,
                        f"no healthy backend serves '{request.model}' right now")
    if reasons <= {SKIP_UNHEALTHY, SKIP_TOO_LONG}:
        return Decision(None, "too_long", candidates, ErrorCode.OUT_OF_KV_CACHE,
                        f"{request.seq_len} prompt tokens can never fit the KV cache of any backend serving "
                        f"'{request.model}'")
    return Decision(None, "all_busy", candidates, ErrorCode.OVERLOADED,
                    f"every backend serving '{request.model}' is out of KV room or queue space; retry shortly")
