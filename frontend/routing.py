"""Frontend → which backend: ask the master with the prompt's block keys, else round-robin the direct list.

Every request calls `Router.generate`. With a master configured it computes the prompt's block keys with
the engine's own function (kvyard.block_keys, the exact token ids sent to the backend), POSTs them to
/rtp_llm/schedule and streams from the chosen backend. The master's refusals are the client's answer
(unknown model 404; no room 429, after the master held the request up to MASTER_QUEUE_WAIT_MS); a master that cannot be reached (or has no healthy backend) sends the
request to the direct backend list instead, and a backend that cannot be reached before its first output
is retried once on another. So is one that went silent before it (FIRST_TOKEN_TIMEOUT_S, then a health
check: frontend/deadlines.py); one silent mid-stream (INTER_TOKEN_TIMEOUT_S) ends the request with a
timeout error.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from frontend.backend_client import BackendClient, BackendOutput, PoolInput, PoolOutput
from frontend.rtp_backend_client import RtpBackendClient
from frontend.config import FrontendConfig
from frontend.master_leader import answers, leader_of, leader_url
from frontend.deadlines import BackendSilent, watched
from frontend.images import LoadedImage
from kvyard.block_keys import block_cache_keys, image_block_salts
from kvyard.cluster_auth import auth_headers
from kvyard.errors import ErrorCode, RequestError
from kvyard.roles import Role
from kvyard.sampling_params import SamplingParams
from kvyard.vision_config import image_spans

log = logging.getLogger("kvyard.frontend")

# SGLang's router forwards a request that names no model with this name (its placeholder model id).
ROUTER_PLACEHOLDER_MODEL = "unknown"
MASTER_RETRY_S = 1.0  # after a failed master call, go direct for this long before asking it again
ATTEMPTS = 2          # backends tried per request (only before its first output)


@dataclass(frozen=True)
class Route:
    """Where one request goes."""
    address: str         # host:grpc_port of the backend
    via_master: bool     # False: the direct fallback list
    hit_cache_len: int   # the master's estimate of its prefix-cache hit (0 when direct)
    decode_address: str = ""  # prefill/decode split: the DECODE backend the PREFILL one hands over to


def model_to_route(cfg: FrontendConfig, name: str | None) -> str | None:
    """The model a request asks for, as the client named it (an alias too, so the answer echoes it; the
    Router maps aliases to our name); None for this frontend's own when the request names none: no name,
    an empty one, or SGLang's placeholder (so a request without `model` works behind SGLang's router).
    Without a master only our own names exist and any other is a 404; with one, the master answers for
    every name."""
    if not name or name == ROUTER_PLACEHOLDER_MODEL:
        if cfg.generates:
            return None
        name = cfg.model_name  # the only model here pools: the 400 below
    if cfg.embedding is not None and (name == cfg.embedding_model_name or (not cfg.generates and cfg.serves(name))):
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"model {name!r} is {cfg.embedding.kind.a}: it "
                           "cannot generate text (it answers /v1/embeddings, /v1/rerank, /v1/classifier as its kind "
                           "allows)", "model")
    if not cfg.serves(name) and not cfg.master_address and not cfg.lora:
        raise unknown_model(name, cfg.model_name)
    return name


def unknown_model(model: str, served: str) -> RequestError:
    return RequestError(ErrorCode.MODEL_NOT_FOUND, f"The model '{model}' does not exist; this server serves "
                        f"'{served}'", "model")


class Router:
    """Owns the master HTTP client and one BackendClient (gRPC channel) per backend address."""

    def __init__(self, cfg: FrontendConfig) -> None:
        self.cfg = cfg
        self._clients: dict[str, BackendClient] = {}
        self._client_type = RtpBackendClient if cfg.backend_protocol == "rtp_llm" else BackendClient
        self._round_robin = itertools.count()
        self._probes: dict[str, tuple[float, asyncio.Task[bool]]] = {}  # address → its latest health probe
        self._master_down_until = 0.0
        self._master: httpx.AsyncClient | None = None
        if cfg.master_address:
            base = cfg.master_address if "://" in cfg.master_address else f"http://{cfg.master_address}"
            # One connection per admitted request: a smaller pool makes requests queue for a connection
            # past master_timeout_s under load, and they would be routed blind.
            pool = httpx.Limits(max_connections=cfg.concurrency_limit, max_keepalive_connections=cfg.concurrency_limit)
            self._master = httpx.AsyncClient(base_url=base, timeout=cfg.master_timeout_s, limits=pool,
                                             headers=auth_headers(cfg.cluster_token))
        self._configured_master = self._master  # asked which master leads (POST /rtp_llm/master)
        self._leader_known = False               # asked since start-up or the last master failure
        self._retired: list[httpx.AsyncClient] = []  # clients of earlier leaders, closed with the router

    async def close(self) -> None:
        for master in {id(c): c for c in (self._master, self._configured_master, *self._retired) if c}.values():
            await master.aclose()
        for client in self._clients.values():
            await client.close()

    def client(self, address: str) -> BackendClient:
        if address not in self._clients:
            self._clients[address] = self._client_type(address, self.cfg.cluster_token)
        return self._clients[address]

    async def generate(self, request_id: str, input_ids: list[int], params: SamplingParams,
                       model: str | None = None, images: Sequence[LoadedImage] = ()
                       ) -> AsyncIterator[list[BackendOutput]]:
        """BackendClient.generate on the chosen backend, watched by the first-token and inter-token
        deadlines; a backend unreachable or silent is retried elsewhere as long as nothing was streamed yet."""
        failed: set[str] = set()
        for attempt in range(ATTEMPTS):
            # A LoRA adapter runs on its base model's backends: routed as the base model.
            route = await self.route(self.cfg.model_name if params.adapter else model or self.cfg.model_name,
                                     input_ids, exclude=failed, images=images, adapter=params.adapter)
            started = False
            stream = self.client(route.address).generate(request_id, input_ids, params, route.decode_address,
                                                         [im.data for im in images])
            try:
                async for outs in watched(stream, route.address, self.cfg.first_token_timeout_s,
                                          self.cfg.inter_token_timeout_s,
                                          lambda t, at=route.address: self._probe(at, t)):
                    started = True
                    yield outs
                return
            except (RequestError, BackendSilent) as exc:
                failed.add(route.address)
                others = [a for a in self.cfg.fallback_addresses if a not in failed]
                silent = isinstance(exc, BackendSilent)
                retry = silent or exc.code is ErrorCode.UNAVAILABLE
                if started or not retry or attempt == ATTEMPTS - 1 or not others:
                    if silent:
                        log.warning("%s; %s fails", exc, request_id)
                        raise RequestError(ErrorCode.TIMEOUT, str(exc)) from None
                    raise
                log.warning("%s for %s; trying another", exc if silent else f"backend {route.address} unreachable",
                            request_id)

    async def _probe(self, address: str, timeout_s: float) -> bool:
        """Whether the backend answers a health check: one probe per backend at a time, shared by every
        request waiting on it (a thousand waiting requests make one call, not a thousand)."""
        now = time.monotonic()
        at, task = self._probes.get(address, (0.0, None))
        if task is None or (task.done() and now - at > timeout_s):
            task = asyncio.ensure_future(self.client(address).responsive(timeout_s))
            self._probes[address] = (now, task)
        return await asyncio.shield(task)

    async def route(self, model: str, input_ids: list[int], exclude: set[str] = frozenset(),
                    direct: tuple[str, ...] | None = None, images: Sequence[LoadedImage] = (),
                    adapter: str = "") -> Route:
        """direct: the backends to call without a master (default: the chat model's fallback list);
        adapter: a LoRA adapter of `model`, which the master sends to a backend holding it."""
        model = self.cfg.model_name if self.cfg.serves(model) else model  # the master knows no aliases
        if self._master is not None and time.monotonic() >= self._master_down_until:
            if not self._leader_known:
                await self._follow_leader()
            route = await self._ask_master(model, input_ids, images, adapter)
            if route is not None and route.address not in exclude:
                return route
        return self._direct(exclude, self.cfg.fallback_addresses if direct is None else direct)

    async def pool(self, request_id: str, items: list[PoolInput], task: str, model: str,
                   direct: tuple[str, ...], timeout_s: float | None = None) -> PoolOutput:
        """BackendClient.pool on the backend the master picks for `model` (else one of `direct`); an
        unreachable backend is tried once more elsewhere (nothing ran yet)."""
        failed: set[str] = set()
        ids = [t for it in items for t in it.token_ids]
        for attempt in range(ATTEMPTS):
            route = await self.route(model, ids, exclude=failed, direct=direct)
            try:
                return await self.client(route.address).pool(request_id, items, task, timeout_s)
            except RequestError as exc:
                failed.add(route.address)
                if exc.code is not ErrorCode.UNAVAILABLE or attempt == ATTEMPTS - 1 or not set(direct) - failed:
                    raise
        raise AssertionError("unreachable")

    def _direct(self, exclude: set[str], addresses: tuple[str, ...]) -> Route:
        choices = [a for a in addresses if a not in exclude]
        if not choices:
            raise RequestError(ErrorCode.UNAVAILABLE, "no backend is reachable")
        return Route(choices[next(self._round_robin) % len(choices)], False, 0)

    async def _ask_master(self, model: str, input_ids: list[int], images: Sequence[LoadedImage] = (),
                          adapter: str = "") -> Route | None:
        """The master's pick; None when it cannot answer (then the caller goes direct). Raises the
        master's verdict when it says no backend should take this request."""
        assert self._master is not None
        salts = None
        if images and self.cfg.vision is not None:  # the backend's keys hold the images' digests too
            salts = image_block_salts(image_spans(input_ids, self.cfg.vision), [im.digest for im in images],
                                      self.cfg.block_size)
        # An adapter's KV is keyed by its load on one backend: no prefix keys the master could match.
        keys = [] if adapter else block_cache_keys(input_ids, self.cfg.block_size, salts=salts)
        body: dict[str, Any] = {"model": model, "block_cache_keys": keys, "seq_len": len(input_ids), "debug": False,
                                "generate_timeout": int(self.cfg.request_timeout_s * 1000), "request_priority": 0}
        if adapter:
            body["adapter"] = adapter
        # The master holds a request while every backend is busy (MASTER_QUEUE_WAIT_MS) instead of a 429.
        wait = self.cfg.master_timeout_s + self.cfg.master_queue_wait_s
        timeout = httpx.Timeout(self.cfg.master_timeout_s, read=wait)
        try:
            resp = await self._master.post("/rtp_llm/schedule", json=body, timeout=timeout)
            data = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            return self._master_failed(f"{type(exc).__name__}: {exc}")
        if resp.status_code == 200:
            try:
                servers = data["server_status"]
                server = next(s for s in servers if s["role"] != Role.DECODE.rtp_type)
                decode = next((f"{s['server_ip']}:{int(s['grpc_port'])}" for s in servers if s["role"] == Role.DECODE.rtp_type), "")
                return Route(f"{server['server_ip']}:{int(server['grpc_port'])}", True,
                             int((server.get("debug_info") or {}).get("hit_cache_len", 0)), decode)
            except (KeyError, IndexError, TypeError, ValueError, StopIteration):
                return self._master_failed(f"malformed schedule answer: {str(data)[:200]}")
        error = _master_error(data)
        if error is None or error.code in (ErrorCode.UNAVAILABLE, ErrorCode.INTERNAL, ErrorCode.INVALID_ARGUMENT,
                                           ErrorCode.UNAUTHENTICATED):
            # Nothing the client did wrong: the master has no healthy backend, misbehaves or refuses our
            # cluster token (a 401 to the client would read as a bad API key).
            return self._master_failed(f"HTTP {resp.status_code}: {str(data)[:200]}")
        raise error

    async def _follow_leader(self) -> None:
        """Route through the master the configured one names as leader (RTP-LLM's real_master_host)."""
        assert self._master is not None and self._configured_master is not None
        self._leader_known = True
        leader = await leader_of(self._configured_master)
        if leader is None:
            return
        url = leader_url(self._configured_master.base_url, leader)
        if url != self._master.base_url and await answers(url, self._configured_master.timeout):
            log.info("master %s names %s as the leader: routing through it", self.cfg.master_address, leader)
            if self._master is not self._configured_master:
                self._retired.append(self._master)
            self._master = httpx.AsyncClient(base_url=url, timeout=self._configured_master.timeout,
                                             headers=auth_headers(self.cfg.cluster_token),
                                             limits=httpx.Limits(max_connections=self.cfg.concurrency_limit,
                                                                 max_keepalive_connections=self.cfg.concurrency_limit))

    def _master_failed(self, why: str) -> None:
        self._leader_known = False  # the leader may have moved: ask again before the next try
        if time.monotonic() >= self._master_down_until:
            log.warning("master %s cannot route (%s); calling backends directly for %.0f s",
                        self.cfg.master_address, why, MASTER_RETRY_S)
        self._master_down_until = time.monotonic() + MASTER_RETRY_S
        return None

    async def healthy(self) -> bool:
        """A healthy master (it has a healthy backend) or any healthy direct backend."""
        if self._master is not None:
            try:
                if (await self._master.get("/health")).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
        for address in self.cfg.fallback_addresses:
            if await self.client(address).healthy():
                return True
        return False

    async def models(self) -> list[str]:
        """Every model the cluster serves, per the master (this frontend's own model and its aliases first)."""
        names = [self.cfg.model_name, *self.cfg.model_aliases]
        return names + [m["id"] for m in await self._master_models() if "parent" not in m and m["id"] not in names]

    async def adapters(self) -> list[dict[str, Any]]:
        """The LoRA adapters of this frontend's model that the master's backends hold (its /v1/models entries
        with this model as `parent`); none without a master."""
        return [m for m in await self._master_models() if m.get("parent") == self.cfg.model_name]

    async def _master_models(self) -> list[dict[str, Any]]:
        if self._master is None:
            return []
        try:
            resp = await self._master.get("/v1/models")
            return [m for m in resp.json()["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return []


def _master_error(data: Any) -> RequestError | None:
    try:
        err = data["error"]
        return RequestError(ErrorCode(err["code"]), str(err["message"]), err.get("param"))
    except (KeyError, TypeError, ValueError):
        return None
