"""ROLE_TYPE=VIT (RTP-LLM's RoleType 3): a vision model's image tower and projector in a process of their own,
without the language model. It serves EmbedImages (image files → embeddings, kept by the files' SHA-256)
on START_PORT+1, health and RTP-LLM's /worker_status (role VIT) on START_PORT+5, and registers with the
master like a backend; the master shows and polls it but routes no request to it. Backends given
VIT_ADDRESSES call it."""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
import uvicorn
from typing import Any

from fastapi import Body, FastAPI
from fastapi.responses import PlainTextResponse

from backend.config import BackendConfig
from backend.debug_views import CACHE_VERSION_KEYS, FINISHED_VERSION_KEYS, BackendFacts, version_arg, worker_status_view
from backend.engine_types import ImageInput
from backend.grpc_server import set_serving, start_grpc_server
from backend.image_preprocess import prompt_images
from backend.main import peak_resident_mb, resident_mb
from backend.openmp_threads import in_passing_thread, one_openmp_master
from backend.pb_convert import embedding_to_pb, worker_status_to_pb
from backend.registration import register_forever
from backend.image_tower import ImageTower
from backend.task_log import TaskLog
from backend.vision_tower import load_vision_tower
from kvyard.errors import RequestError
from kvyard.model_config import load_model_config
from kvyard.pb_errors import error_to_pb
from kvyard.roles import Role
from kvyard.worker_status import WorkerStatus
from proto import model_rpc_pb2 as pb
from proto import model_rpc_pb2_grpc as pb_grpc

log = logging.getLogger("kvyard.vit")


class VitServicer(pb_grpc.ModelRpcServiceServicer):
    """EmbedImages and the load report; the other ModelRpcService calls are UNIMPLEMENTED here. The tower
    runs on one thread of its own (its embedding cache is that thread's), pictures are decoded beside it."""

    def __init__(self, tower: ImageTower) -> None:
        self.tower = tower
        self._runner = ThreadPoolExecutor(1, thread_name_prefix="vit-tower")
        self.running = 0          # calls whose images are being embedded or wait for the tower
        self.waiting_images = 0   # images of those calls not embedded yet
        self.calls = 0            # EmbedImages calls answered (the load report's iterate_count)
        self.latency_ms = 0.0     # the last call's tower time
        self.tasks = TaskLog()    # calls running and finished, for /worker_status

    async def EmbedImages(self, request: pb.EmbedImagesInputPB, context: grpc.aio.ServicerContext
                          ) -> pb.EmbedImagesOutputPB:
        self.running += 1
        try:
            with self.tasks.track(request.request_id, len(request.images)) as task:
                reply = await self._embed_call(request)
                if reply.HasField("error"):
                    self.tasks.mark_error(task)
                return reply
        finally:
            self.running -= 1
            self.calls += 1

    async def _embed_call(self, request: pb.EmbedImagesInputPB) -> pb.EmbedImagesOutputPB:
        try:
            images = await asyncio.to_thread(prompt_images, [im.data for im in request.images], self.tower.config,
                                             self.tower.known)
            self.waiting_images += len(images)
            try:
                start = time.monotonic()
                rows = await asyncio.get_running_loop().run_in_executor(self._runner, self._embed, images)
                self.latency_ms = (time.monotonic() - start) * 1000
            finally:
                self.waiting_images -= len(images)
            return pb.EmbedImagesOutputPB(embeddings=[embedding_to_pb(t) for t in rows])
        except RequestError as exc:
            log.info("request %s: %s", request.request_id, exc.message)
            return pb.EmbedImagesOutputPB(error=error_to_pb(request.request_id, exc).error)

    def _embed(self, images: list[ImageInput]) -> list[torch.Tensor]:
        out = []
        for im in images:
            out.append(self.tower.embed(im.digest, im.pixels, im.grid, im.file))
        return out

    async def GetWorkerStatus(self, request: pb.WorkerStatusRequestPB,
                              context: grpc.aio.ServicerContext) -> pb.WorkerStatusPB:
        return worker_status_to_pb(self.status())

    def status(self) -> WorkerStatus:
        """The load report: calls in flight and images queued; no KV (one nominal block)."""
        return WorkerStatus(role=Role.VIT, running=self.running, waiting=self.waiting_images, queued_prefill_tokens=0,
                            step_latency_ms=self.latency_ms, prefill_tokens_per_s=0.0, free_blocks=1, total_blocks=1,
                            block_size=1, version=self.calls, iterate_count=self.calls, alive=True, cache_version=0)

    async def GetCacheStatus(self, request: pb.CacheStatusRequestPB,
                             context: grpc.aio.ServicerContext) -> pb.CacheStatusPB:
        return pb.CacheStatusPB(version=0, block_size=1)  # no prefix cache


def health_app(servicer: VitServicer, facts: BackendFacts) -> FastAPI:
    """Open paths only (probes and the load report), as on a backend."""
    app = FastAPI(title="kvyard VIT", openapi_url=None, docs_url=None, redoc_url=None)

    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def worker_status(body: dict[str, Any] | None = Body(default=None)) -> dict[str, Any]:
        since = version_arg(body, FINISHED_VERSION_KEYS, CACHE_VERSION_KEYS)
        view = worker_status_view(servicer.status(), servicer.tasks, facts, since)
        return {**view, "cache_status": None}  # no prefix cache

    for path in ("/health", "/status", "/"):
        app.add_api_route(path, health, methods=["GET"])
    for path in ("/worker_status", "/rtp_llm/worker_status"):
        app.add_api_route(path, worker_status, methods=["GET", "POST"])
    return app


async def serve_vit(cfg: BackendConfig) -> None:
    """Load the tower (only vision.* and projector.* are read), serve until SIGTERM/SIGINT."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    one_openmp_master()  # the tower's thread (VitServicer._runner) steps it: backend/openmp_threads.py
    model_cfg = load_model_config(cfg.checkpoint_path)
    before = resident_mb()
    tower = await in_passing_thread(load_vision_tower, cfg.checkpoint_path, model_cfg, getattr(torch, cfg.dtype),
                                    torch.device(cfg.device))
    log.info("VIT resident: %.0f MB (%.0f MB before the tower, %.0f MB of tower weights, peak %.0f MB)",
             resident_mb(), before, tower.weight_bytes() / 2**20, peak_resident_mb())
    servicer = VitServicer(tower)
    server, health_servicer = await start_grpc_server(servicer, cfg.host, cfg.grpc_port, cfg.cluster_token)
    facts = BackendFacts(0, cfg.grpc_port, cfg.http_port, max_concurrency=1)  # one tower pass at a time
    http = uvicorn.Server(uvicorn.Config(health_app(servicer, facts), host=cfg.host, port=cfg.http_port, log_level="warning",
                                         access_log=False))
    http.install_signal_handlers = lambda: None  # this function owns the signals
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(http.serve())]
    if cfg.master_address:
        tasks.append(asyncio.create_task(register_forever(cfg)))
    log.info("VIT serving EmbedImages on %s:%d", cfg.host, cfg.grpc_port)
    try:
        await stop.wait()
        await set_serving(health_servicer, False)
        await server.stop(grace=cfg.drain_grace_s)
    finally:
        http.should_exit = True
        for task in tasks[1:]:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
