"""BackendConfig: built once from the environment by the role launcher, then passed down."""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvyard.cluster_auth import internal_token
from kvyard.env import INTERNAL_HOST, env_choice, env_int, env_names, env_str
from kvyard.model_config import load_model_config
from kvyard.model_path import default_model_name, is_gguf, resolve_model_path
from kvyard.pooling_model import ModelKind, embedding_model_name, load_pooling_spec, model_kind
from kvyard.ports import backend_grpc_port, backend_http_port, start_port
from kvyard.roles import Role, parse_role
from kvyard.tokenizer import TextTokenizer

log = logging.getLogger("kvyard.backend")


@dataclass(frozen=True)
class BackendConfig:
    checkpoint_path: Path        # GGUF file or HF directory with the weights
    tokenizer_path: Path         # where eos ids come from (defaults to checkpoint_path)
    host: str                    # bind address
    grpc_port: int               # START_PORT + 1
    http_port: int               # START_PORT + 5 (worker status, debug)
    device: str                  # "cpu" or "cuda"
    dtype: str                   # "float32" or "bfloat16"
    kv_cache_dtype: str          # KV_CACHE_DTYPE: "float16" for the CPU kernels by default, else dtype
    weight_format: str           # WEIGHT_FORMAT: "gguf" keeps a GGUF's Q4_1/Q8_0 blocks (C++ kernels), "dense"
    activations: str             # ACTIVATIONS: what the GGUF-block linears multiply by, "int16" or "float32"
    prefill_gemm: str            # PREFILL_GEMM: what int16-activation prefill chunks multiply in, kernels.PREFILL_GEMMS
    kquants: str                 # KQUANTS: a GGUF's Q4_K/Q5_K/Q6_K blocks "native", "mixed" or "convert" (kquant.py)
    block_size: int              # tokens per KV block
    kv_cache_mb: int             # memory for the KV cache
    max_num_seqs: int            # sequences running at once
    max_num_batched_tokens: int  # token budget of one engine step
    max_seq_len: int             # 0 = the model's own context length
    num_threads: int             # torch intra-op threads; 0 = torch's default
    master_address: str = ""     # MASTER_ADDRESS: the master to register with (host:port); "" = none
    model_name: str = ""         # MODEL_NAME: what it registers as serving
    advertise_host: str = ""     # ADVERTISE_HOST: address the master should dial; "" = the one it sees
    role: Role = Role.PDFUSION   # ROLE_TYPE: PDFUSION, PREFILL (hands KV to a decode backend) or DECODE
    decode_address: str = ""     # DECODE_ADDRESS: PREFILL's decode backend when a request names none
    cluster_token: str = ""      # CLUSTER_TOKEN(_FILE): gRPC/HTTP callers must carry it; sent to master and decode
    drain_grace_s: float = 30.0  # DRAIN_GRACE_S: after SIGTERM, how long RPCs in flight may finish (as the frontend's)
    server_port: int = 0         # START_PORT, where a backend-only process (PREFILL, DECODE, PDFUSION with
                                 # FRONTEND_SERVER_COUNT=0) also serves its health/debug app; 0 = a frontend has it
    model_kind: ModelKind = ModelKind.GENERATE  # from the checkpoint: a decoder, or an encoder (embed / classify)
    lora_modules: tuple[tuple[str, str], ...] = ()  # LORA_MODULES: (name, adapter directory) loaded at start-up
    lora_root: str = ""          # LORA_ROOT: run-time loads (/v1/load_lora_adapter, /update) only from under it;
                                 # "" = run-time loading off
    max_loras: int = 0           # MAX_LORAS: adapters held at once, least recently used evicted; 0 = no bound
    cuda_graphs: bool = True     # CUDA_GRAPHS: decode steps replay CUDA graphs (DEVICE=cuda; 0: every step eagerly)
    vit_addresses: tuple[str, ...] = ()  # VIT_ADDRESSES: ROLE_TYPE=VIT processes (gRPC host:port) that embed this
                                 # backend's images; () = it runs its own tower

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> BackendConfig:
        start = start_port(env)
        checkpoint = resolve_model_path(env.get("CHECKPOINT_PATH"))
        tokenizer = resolve_model_path(env.get("TOKENIZER_PATH") or str(checkpoint))
        device = env_choice(env, "DEVICE", _default_device(), ("cpu", "cuda"))
        host = env_str(env, "HOST", INTERNAL_HOST)
        dtype = env_choice(env, "DTYPE", "bfloat16" if device == "cuda" else "float32",
                           ("float32", "bfloat16", "float16"))
        kind = model_kind(checkpoint)
        if kind is ModelKind.GENERATE:
            load_model_config(checkpoint)  # an unsupported architecture or RoPE type fails the launch, by name
            TextTokenizer.check_path(tokenizer)  # (its stop ids come from the tokenizer)
        else:
            load_pooling_spec(checkpoint)  # an encoder: its pooling files must be ones we can honour
            if env_choice(env, "ROLE_TYPE", "pdfusion", ("pdfusion", "prefill", "decode")) != "pdfusion":
                raise ValueError(f"{checkpoint} is {kind.a}: it runs as ROLE_TYPE=PDFUSION only")
        weight_format = _weight_format(env, device, dtype, checkpoint)
        role = parse_role(env.get("ROLE_TYPE"))
        if not role.is_backend and role is not Role.VIT:
            raise ValueError(f"ROLE_TYPE must be a backend role (PDFUSION, PREFILL, DECODE) or VIT, got {role.name}")
        vits = _vit_addresses(env, role, checkpoint, kind)
        alone = role is not Role.PDFUSION or env_int(env, "FRONTEND_SERVER_COUNT", 1, minimum=0) == 0
        return cls(
            checkpoint_path=checkpoint,
            tokenizer_path=tokenizer,
            host=host,
            grpc_port=backend_grpc_port(start),
            http_port=backend_http_port(start),
            device=device,
            dtype=dtype,
            weight_format=weight_format,
            activations=(activations := _activations(env, weight_format)),
            prefill_gemm=_prefill_gemm(env, activations),
            kquants=_kquants(env, activations),
            kv_cache_dtype=_kv_cache_dtype(env, dtype, weight_format),
            block_size=env_int(env, "BLOCK_SIZE", 16, minimum=1),
            kv_cache_mb=env_int(env, "KV_CACHE_MB", 1024, minimum=1),
            max_num_seqs=env_int(env, "MAX_NUM_SEQS", 64, minimum=1),
            max_num_batched_tokens=env_int(env, "MAX_NUM_BATCHED_TOKENS", 2048, minimum=1),
            max_seq_len=env_int(env, "MAX_SEQ_LEN", 0, minimum=0),
            num_threads=env_int(env, "TORCH_NUM_THREADS", 0, minimum=0),
            master_address=env_str(env, "MASTER_ADDRESS", ""),
            model_name=env_names(env, "MODEL_NAME", default_model_name(checkpoint) if kind is ModelKind.GENERATE
                                 else embedding_model_name(checkpoint))[0],  # aliases: frontend
            advertise_host=env_str(env, "ADVERTISE_HOST", ""),
            role=role,
            decode_address=env_str(env, "DECODE_ADDRESS", ""),
            cluster_token=internal_token(env, host),
            drain_grace_s=float(env_int(env, "DRAIN_GRACE_S", 30, minimum=0)),
            server_port=start if alone else 0,
            model_kind=kind,
            lora_modules=lora_modules(env.get("LORA_MODULES", "")),
            lora_root=env_str(env, "LORA_ROOT", ""),
            max_loras=env_int(env, "MAX_LORAS", 0, minimum=0),
            vit_addresses=vits,
            cuda_graphs=_cuda_graphs(env, device),
        )


def _vit_addresses(env: Mapping[str, str], role: Role, checkpoint: Path, kind: ModelKind) -> tuple[str, ...]:
    """VIT_ADDRESSES, refused where no image would go there; ROLE_TYPE=VIT needs a vision model."""
    vits = tuple(a.strip() for a in env.get("VIT_ADDRESSES", "").split(",") if a.strip())
    vision = kind is ModelKind.GENERATE and load_model_config(checkpoint).vision is not None
    if role is Role.VIT and not vision:
        raise ValueError(f"ROLE_TYPE=VIT needs a vision-language checkpoint (one with an image tower), not {checkpoint}")
    if vits and (role in (Role.VIT, Role.DECODE) or not vision):
        raise ValueError("VIT_ADDRESSES is for a PDFUSION or PREFILL backend of a vision model: "
                         + ("a DECODE backend never sees the images" if role is Role.DECODE else
                            "a VIT runs the tower itself" if role is Role.VIT else f"{checkpoint} takes no images"))
    return vits


def lora_modules(raw: str) -> tuple[tuple[str, str], ...]:
    """LORA_MODULES / --lora-modules: "name=path" entries separated by commas."""
    out: list[tuple[str, str]] = []
    for entry in filter(None, (e.strip() for e in raw.split(","))):
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"LORA_MODULES entries are name=path, got {entry!r}")
        out.append((name.strip(), path.strip()))
    if len({n for n, _ in out}) != len(out):
        raise ValueError(f"LORA_MODULES names an adapter twice: {raw!r}")
    return tuple(out)


def _kv_cache_dtype(env: Mapping[str, str], dtype: str, weight_format: str) -> str:
    """auto: float16 where the C++ kernels read the cache (half the bytes per decode step, twice the
    tokens per KV_CACHE_MB), else the model's dtype. Any choice works with any weights; without the
    kernels a cache in another dtype than the model's costs a conversion of every gathered block."""
    choice = env_choice(env, "KV_CACHE_DTYPE", "auto", ("auto", "float32", "float16", "bfloat16"))
    if choice == "auto":
        return "float16" if weight_format == "gguf" else dtype
    return choice


def _weight_format(env: Mapping[str, str], device: str, dtype: str, checkpoint: Path) -> str:
    """auto: GGUF blocks where the C++ kernels run (float32 on an AVX2 CPU), dense elsewhere."""
    fmt = env_choice(env, "WEIGHT_FORMAT", "auto", ("auto", "gguf", "dense"))
    if fmt == "gguf" and (device != "cpu" or dtype != "float32"):
        raise ValueError(f"WEIGHT_FORMAT=gguf needs DEVICE=cpu and DTYPE=float32 (got {device}, {dtype})")
    if fmt == "gguf" and not is_gguf(checkpoint):
        raise ValueError(f"WEIGHT_FORMAT=gguf needs a .gguf checkpoint, not {checkpoint}")
    if fmt == "dense" or (fmt == "auto" and (device != "cpu" or dtype != "float32" or not is_gguf(checkpoint))):
        return "dense"
    from backend import kernels
    usable = env.get("KVYARD_KERNELS", "1") != "0" and kernels.load() is not None  # built by `make setup`
    if fmt == "gguf" and not usable:
        raise ValueError("WEIGHT_FORMAT=gguf needs the C++ CPU kernels, which are off or unavailable here "
                         "(an AVX2 CPU and a compiler; see the log)")
    return "gguf" if usable else "dense"


def _activations(env: Mapping[str, str], weight_format: str) -> str:
    """auto: int16 (rounded per 32 values, top-1 agreement with float32 1.00): ~2x the float32 linears' speed
    with AVX-512 VNNI, and on AVX2 (qlinear_n16_avx2.h, the same bits). Only the GGUF-block kernels read it."""
    choice = env_choice(env, "ACTIVATIONS", "auto", ("auto", "int16", "float32"))
    if weight_format != "gguf":
        if choice == "int16":
            raise ValueError("ACTIVATIONS=int16 needs the GGUF-block kernels (WEIGHT_FORMAT=gguf)")
        return "float32"
    return "int16" if choice == "auto" else choice


def _kquants(env: Mapping[str, str], activations: str) -> str:
    """native: every Q4_K/Q5_K/Q6_K block as the file has it; convert: Q4_K to Q4_1 (its scale products rounded
    to float16), Q5_K and Q6_K requantized to Q8_0; mixed: Q4_K converted, Q5_K's and Q6_K's codes widened to
    bytes (Q5_K8, Q6_K8: the file's numbers at Q8_0's size). auto: native where the int16 kernels run on
    AVX-512; mixed on an AVX2-only CPU, whose 256-bit loops unpack Q4_K's and Q6_K's packed codes slower than the
    converted blocks' kernels (one 1.7B Q4_K_M stream: native 0.71x convert; mixed 0.91-0.96x, 32 streams
    0.98-1.0x). Agreement with float32 on the random-weight 1.7B, its top two logits 0.14 apart (the harshest
    case): 0.93 convert, 0.992 mixed, 0.997 native (docs/performance.md). K-quant blocks need int16
    activations."""
    choice = env_choice(env, "KQUANTS", "auto", ("auto", "native", "mixed", "convert"))
    if choice in ("native", "mixed") and activations != "int16":
        raise ValueError(f"KQUANTS={choice} needs int16 activations (ACTIVATIONS=int16); this backend runs {activations}")
    if activations != "int16":
        return "convert"
    from backend.weights import resolve_kquants
    return resolve_kquants(choice)


def _prefill_gemm(env: Mapping[str, str], activations: str) -> str:
    """auto: kernels.default_prefill_gemm() (bfloat16 through AMX where the CPU has it, the int16 kernels
    on Sapphire/Emerald Rapids without AMX, else float32 on exactly dequantized tiles). Only prefill chunks (ops.N16_GEMM_ROWS rows or more) over int16-activation
    weights read it; decode steps keep the int16 kernels and their batch-invariant bits."""
    from backend import kernels
    choice = env_choice(env, "PREFILL_GEMM", "auto", ("auto", *kernels.PREFILL_GEMMS))
    if choice not in ("auto", "float32") and activations != "int16":
        raise ValueError(f"PREFILL_GEMM={choice} applies to int16 activations (ACTIVATIONS=int16); "
                         f"this backend runs {activations} activations")
    if choice == "bfloat16" and not kernels.cpu_has_native_bf16():
        log.warning("PREFILL_GEMM=bfloat16 on a CPU without AMX-BF16: the operands are rounded to bfloat16 "
                    "in copies and multiplied in float32, slower than float32")
    if activations != "int16":
        return "float32"  # float32-activation blocks: prefill chunks dequantize to float32 and call the GEMM
    return kernels.default_prefill_gemm() if choice == "auto" else choice


def _cuda_graphs(env: Mapping[str, str], device: str) -> bool:
    """On by default where DEVICE=cuda; CUDA_GRAPHS=1 elsewhere is refused (there is nothing to record)."""
    choice = env_choice(env, "CUDA_GRAPHS", "auto", ("auto", "1", "0"))
    if choice == "1" and device != "cuda":
        raise ValueError(f"CUDA_GRAPHS=1 needs DEVICE=cuda (got {device})")
    return choice != "0" and device == "cuda"


def _default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"
