"""Backend role start-up: load the model, size the KV cache, start the engine thread and gRPC server."""
from __future__ import annotations

import asyncio
import logging
import resource
import signal
import socket
from pathlib import Path

import torch
import uvicorn

from backend.attention import KVCache
from backend.config import BackendConfig
from backend.constraints import GrammarCompiler
from backend.engine import Engine
from backend.engine_loop import EngineLoop
from backend.debug_views import BackendFacts
from backend.http_server import create_backend_http_app
from backend.decoder_pooling import DecoderPoolingModel
from backend.encoder import EncoderModel
from backend.lora import LoraRegistry
from backend.model import LlamaModel, default_ops
from backend.ops import TorchOps, Weight
from backend.pooling_engine import PoolingEngine
from backend.model_runner import ModelRunner
from backend.openmp_threads import in_passing_thread, one_openmp_master
from backend.registration import register_forever
from backend.scheduler import Scheduler, SchedulerConfig
from backend.gemma_encoder import GemmaEncoderModel
from backend.grpc_server import set_serving, start_grpc_server
from backend.pd_transfer import DecodeChannels
from backend.server import ModelRpcServicer, watch_engine
from backend.static_embedding import StaticEmbeddingModel
from backend.vision_tower import load_vision_tower
from backend.vit_client import VitClient
from backend.weights import load_weights
from kvyard.model_config import ModelConfig, load_model_config
from kvyard.roles import Role
from kvyard.pooling_model import GEMMA_TYPES, ModelKind, load_pooling_spec
from kvyard.tokenizer import TextTokenizer

log = logging.getLogger("kvyard.backend")


def build_engine_loop(cfg: BackendConfig) -> tuple[EngineLoop, frozenset[int], int, GrammarCompiler | None]:
    """Returns the started-ready engine loop, the ids that end generation (eos and the model's end-of-turn
    ids), the served context length and the compiler of constraints (it builds its token tables on first use;
    None for a pooling model, which generates nothing)."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if cfg.model_kind is not ModelKind.GENERATE:
        return build_pooling_loop(cfg), frozenset(), load_pooling_spec(cfg.checkpoint_path).max_len, None
    device = torch.device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    model_cfg = load_model_config(cfg.checkpoint_path)
    tokenizer = TextTokenizer.from_path(cfg.tokenizer_path)
    before = resident_mb()
    reset_peak_resident()  # reading the GGUF's vocabulary above peaks higher than the weights of a small model
    weights, ops = load_decoder(cfg, model_cfg)
    max_model_len = min(cfg.max_seq_len or model_cfg.max_position_embeddings,
                        model_cfg.max_position_embeddings)
    model = LlamaModel(model_cfg, weights, ops=ops, max_positions=max_model_len, cuda_graphs=cfg.cuda_graphs)
    loaded, load_peak = resident_mb(), peak_resident_mb()
    log.info("weights: %.0f MB as %s, %s, %s activations%s, on %s in %s", model.weight_bytes() / 2**20,
             cfg.weight_format, type(model.ops).__name__, cfg.activations,
             f" (prefill chunks: {cfg.prefill_gemm} GEMM, K-quants {cfg.kquants})" if cfg.activations == "int16" else "",
             model.device.type, cfg.dtype)
    if model.graphs is not None:
        log.info("decode steps: CUDA graphs (up to %d rows; captured per padded shape on first use; CUDA_GRAPHS=0: "
                 "eager)", model.graphs.max_rows)
    kv_dtype = getattr(torch, cfg.kv_cache_dtype)
    per_block = KVCache.bytes_per_block(model_cfg.num_layers, cfg.block_size, model_cfg.num_kv_heads,
                                        model_cfg.head_dim, kv_dtype)
    num_blocks = max(1, cfg.kv_cache_mb * 1024 * 1024 // per_block)
    cache = KVCache(model_cfg.num_layers, num_blocks, cfg.block_size, model_cfg.num_kv_heads,
                    model_cfg.head_dim, kv_dtype, device)
    log.info("KV cache: %d blocks of %d tokens (%d tokens, %.0f MB, %s)", num_blocks, cfg.block_size,
             num_blocks * cfg.block_size, num_blocks * per_block / 2**20, cfg.kv_cache_dtype)
    # What loading cost in memory, beside what it keeps: the benchmarks read this line.
    log.info("resident: %.0f MB before the weights, %.0f MB after them (+%.0f MB for %.0f MB of weights, "
             "+%.0f MB at the peak of loading), %.0f MB with the KV cache", before, loaded, loaded - before,
             model.weight_bytes() / 2**20, load_peak - before, resident_mb())
    scheduler = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=cfg.block_size,
                                          max_num_seqs=cfg.max_num_seqs,
                                          max_num_batched_tokens=cfg.max_num_batched_tokens))
    tower = (load_vision_tower(cfg.checkpoint_path, model_cfg, dtype, device)
             if model_cfg.vision is not None and cfg.role is not Role.DECODE and not cfg.vit_addresses else None)
    engine = Engine(ModelRunner(model, cache), scheduler, model_cfg.vocab_size, max_model_len, cfg.role,
                    vision=model_cfg.vision, tower=tower, loras=lora_registry(cfg, model))
    eos = tokenizer.stop_token_ids
    return (EngineLoop(engine, model_name=cfg.model_name), eos, max_model_len,
            GrammarCompiler(tokenizer.to_json(), model_cfg.vocab_size, eos))


def lora_registry(cfg: BackendConfig, model: LlamaModel) -> LoraRegistry:
    """The adapters LORA_MODULES names, loaded (an unreadable one stops the start, naming it)."""
    registry = LoraRegistry(model.config, model.dtype, model.device, cfg.max_loras,
                            Path(cfg.lora_root) if cfg.lora_root else None)
    for name, path in cfg.lora_modules:
        registry.load(name, path, start_up=True)
    return registry


def load_decoder(cfg: BackendConfig, model_cfg: ModelConfig) -> tuple[dict[str, Weight], TorchOps | None]:
    """A decoder's weights in the format this backend serves (a GGUF's blocks with the C++ kernels, else dense
    in DTYPE) and the ops that read them (None: the model's default): for chat and for a decoder that pools."""
    blocks = cfg.weight_format == "gguf"
    weights = load_weights(cfg.checkpoint_path, model_cfg, getattr(torch, cfg.dtype), torch.device(cfg.device),
                           keep_blocks=blocks, block_layout="n16" if cfg.activations == "int16" else "rows",
                           kquants=cfg.kquants)
    return weights, default_ops(torch.device(cfg.device), torch.float32, cfg.prefill_gemm) if blocks else None


def build_pooling_loop(cfg: BackendConfig) -> EngineLoop:
    """A pooling model (an encoder, or a decoder pooling its last token) behind the same engine loop: no KV
    cache, no tokenizer (the frontend tokenizes)."""
    spec = load_pooling_spec(cfg.checkpoint_path)
    before = resident_mb()
    dtype, device = getattr(torch, cfg.dtype), torch.device(cfg.device)
    model: DecoderPoolingModel | EncoderModel | GemmaEncoderModel | StaticEmbeddingModel
    if spec.is_decoder:
        weights, ops = load_decoder(cfg, load_model_config(cfg.checkpoint_path))
        model = DecoderPoolingModel(spec, dtype, device, weights, ops)
    elif spec.model_type in GEMMA_TYPES:  # EmbeddingGemma
        model = GemmaEncoderModel(spec, dtype, device)
    elif spec.model_type == "static":  # sentence-transformers' StaticEmbedding
        model = StaticEmbeddingModel(spec, dtype, device)
    else:
        model = EncoderModel(spec, dtype, device)
    log.info("pooling model %s (%s, %s pooling%s, heads %s): %.0f MB of weights, %s; resident %.0f -> %.0f MB",
             cfg.model_name, spec.kind, spec.pooling, ", normalised" if spec.normalize else "", ",".join(spec.heads),
             model.weight_bytes() / 2**20, cfg.weight_format if spec.is_decoder else cfg.dtype, before, resident_mb())
    engine = PoolingEngine(model, cfg.model_name, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size, cfg.role)
    return EngineLoop(engine, model_name=cfg.model_name)


def resident_mb() -> float:
    """This process's resident set now (Linux; 0 elsewhere)."""
    return _status_mb("VmRSS") or 0.0


def peak_resident_mb() -> float:
    """This process's most resident memory since it started or since reset_peak_resident(). VmHWM, not
    ru_maxrss: that one carries over the parent's peak through fork and exec (a backend started by a
    launcher that had loaded torch would report the launcher's size)."""
    return _status_mb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def _status_mb(key: str) -> float | None:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith(key + ":")), None)


def reset_peak_resident() -> None:
    """Start peak_resident_mb() over from the resident set now (Linux: clear_refs 5 resets the high-water
    mark); elsewhere the peak keeps counting from the start, an upper bound."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _bind_or_warn(host: str, port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        log.warning("START_PORT %d is busy (%s): the health and debug app is on START_PORT+5 only", port, exc)
        return None
    return sock


async def serve_backend(cfg: BackendConfig) -> None:
    """Load, then serve gRPC on START_PORT+1 and HTTP on START_PORT+5 until SIGTERM/SIGINT, which
    turns health to NOT_SERVING and lets requests in flight finish for up to cfg.drain_grace_s."""
    one_openmp_master()  # the engine thread steps the model: backend/openmp_threads.py
    engine_loop, eos, max_model_len, grammars = await in_passing_thread(build_engine_loop, cfg)
    engine_loop.start()
    servicer = ModelRpcServicer(engine_loop, eos, max_model_len, cfg.role, cfg.decode_address, grammars)
    servicer.decode_channels = DecodeChannels(cfg.cluster_token)  # a PREFILL backend's hand-overs carry it
    servicer.vision = engine_loop.engine.vision if isinstance(engine_loop.engine, Engine) else None
    servicer.tower = engine_loop.engine.tower if isinstance(engine_loop.engine, Engine) else None
    if cfg.vit_addresses and servicer.vision is not None:  # the images go there; no tower was loaded here
        runner = engine_loop.engine.runner  # type: ignore[union-attr]
        servicer.vit = VitClient(cfg.vit_addresses, cfg.cluster_token, servicer.vision, runner.model.config.hidden_size,
                                 getattr(torch, cfg.dtype), runner.device)
    server, health_servicer = await start_grpc_server(servicer, cfg.host, cfg.grpc_port, cfg.cluster_token)
    facts = BackendFacts(cfg.server_port or cfg.grpc_port - 1, cfg.grpc_port, cfg.http_port, cfg.max_num_seqs)
    app = create_backend_http_app(engine_loop, cfg.cluster_token, servicer.tasks, facts,
                                  getattr(engine_loop.engine, "loras", None))
    https = [uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=port, log_level="warning", access_log=False))
             for port in (cfg.http_port, cfg.server_port) if port]
    for http in https:
        http.install_signal_handlers = lambda: None  # this function owns the signals
    # START_PORT's copy is a convenience (probes and debugging as on RTP-LLM's backends): bound here, before
    # anything dials out and may take it as an ephemeral port, and a busy port only costs a warning.
    extra = _bind_or_warn(cfg.host, cfg.server_port) if cfg.server_port else None
    if cfg.server_port and extra is None:
        https.pop()
    log.info("backend HTTP (status, debug) on %s:%s", cfg.host, " and ".join(str(h.config.port) for h in https))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serving = [asyncio.create_task(http.serve(sockets=[extra] if i and extra else None)) for i, http in enumerate(https)]
    helpers = [asyncio.create_task(watch_engine(engine_loop, health_servicer))]
    if cfg.master_address:
        helpers.append(asyncio.create_task(register_forever(cfg)))
    try:
        await stop.wait()
        log.info("draining: NOT_SERVING, up to %.0f s for requests in flight", cfg.drain_grace_s)
        await set_serving(health_servicer, False)
        await server.stop(grace=cfg.drain_grace_s)
    finally:
        for http in https:
            http.should_exit = True
        for task in helpers:
            task.cancel()
        await asyncio.gather(*serving, *helpers, return_exceptions=True)
        engine_loop.stop()
        if grammars is not None:
            grammars.close()
